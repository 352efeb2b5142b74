"""`SharedBudget`: one tier section's `capacity`, shared by that tier of every object size.

Each object size has its own chain (`chains.SizeChains`), so its own instance of each
configured tier, in its own namespace (an nvme tier: its own directory). A tier bounds
only itself: N sizes would let one section hold N times its `capacity`, and LMCache's
`save_unfull_chunk: true` makes a size of every partial-chunk length. A bounded
section (its type evicts by itself, names its eviction candidates and counts its
`used_bytes`: memory, nvme) therefore gets one `SharedBudget`, which every size's
instance of it answers to:

- **Room is made before a store writes.** Each store job of an instance first
  reserves the bytes its new blocks take (their footprint on the tier; a key the
  tier holds already writes nothing), after evicting the least recently used blocks
  of any size's instance until `used + reserved + new <= capacity`. The evicted
  blocks are gone (`remove` returned: their files deleted) before the job writes, and
  evictions run one at a time per section, so the blocks held, being written and
  being deleted never take more than `capacity`. A key that cannot get room (the rest
  claimed, read or written now) fails `no room`, as a full tier fails it. Blocks of
  the storing instance itself are `evict`ed rather than removed: an nvme slab keeps
  their slots allocated for that very store to rewrite in place (punching them out
  made every store of a full section allocate its pages anew: 1 MiB objects stored
  at the speed of a first fill), and punches out, when the store ends, those it did
  not reuse.
- **Least recently used across sizes.** The budget stamps a key when a store or load
  job of its instance moves it; each instance names its next candidates
  (`eviction_candidates`: it passes over blocks a lookup claimed, i.e. LMCache's
  locks, and blocks being read) and the oldest stamp among their heads goes first.
  Blocks an earlier process left (recovered by an nvme tier's `open`) are oldest.
  Keys of store jobs running now are never victims.
- **Tenants' quotas hold over every size.** With `tenants.quotas` on the section, a
  store's room comes by the quota rule in bytes (`shares.SectionShares`): free room,
  then blocks of tenants with no guarantee and named tenants' excess, then the storing
  tenant's own blocks; never a named tenant's bytes within its quota. Without quotas,
  least recently used alone.
- **Each instance keeps `capacity` as its own bound**, which the shared one keeps it
  under: its own eviction does not run. Evictions are reported as the tier's own
  (`report_removed`), so the adapter's key record and LMCache's byte accounting
  follow them.

The count is conservative: a job's reservation stays until the job ends, while the
blocks it already wrote count as used too (the tier tells no progress per block), so
under many concurrent stores a section may evict a little early. Everything here but
`object_capacity` runs on the tiers' event-loop thread; that one only reads counters.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence

import anyio

from tierkv.contract.jobs import JobMetadata, JobResult
from tierkv.contract.keys import OffloadKey
from tierkv.contract.tier import NO_ROOM, SecondaryTierManager, TierConfig
from tierkv.contract.units import format_size
from tierkv.driver.guarded import GuardedTier
from tierkv.integrations.lmcache.shares import Accept, SectionShares
from tierkv.quotas.config import TierQuotas
from tierkv.registry import get_tier_class

__all__ = ["SharedBudget", "shared_capacity"]

logger = logging.getLogger(__name__)

ROUNDS = 4
"""Eviction passes one reservation makes at most (a pass falls short only when a
removal failed or a block was bigger than its estimate)."""

WALK = 1024
"""Eviction candidates a quota's choice walks past, beyond the blocks it takes, before
it gives up (a tenant whose own blocks are buried under others' guarantees is
declined rather than walking the whole section on the event loop)."""

Job = Callable[[JobMetadata], Awaitable[JobResult]]


def shared_capacity(config: TierConfig) -> int:
    """The bytes a tier section's instances share, or 0 where the section names no
    bound the budget can keep (redis, s3, sqlite: their own server or file decides)."""
    cls = get_tier_class(config.type)
    capacity = int(getattr(config, "capacity", 0) or 0)
    if capacity <= 0 or not (cls.names_eviction_candidates and cls.reports_evictions):
        return 0
    return capacity if hasattr(cls, "used_bytes") else 0


def _used(tier: SecondaryTierManager) -> int:
    return int(getattr(tier, "used_bytes", 0))


def _cost(tier: SecondaryTierManager, key: OffloadKey) -> int:
    """Bytes one block of `key` takes in `tier`: its disk footprint (nvme), else its
    frame (memory)."""
    footprint = getattr(tier, "footprint", None)
    if callable(footprint):
        return int(footprint(key))
    return int(tier.framer.frame_bytes(key, tier.primary.block_bytes))


class SharedBudget:
    """One section's `capacity` over its instances of every object size (see the
    module docstring)."""

    def __init__(self, name: str, capacity: int, quotas: TierQuotas | None = None) -> None:
        self.name = name
        self.capacity = capacity
        self.shares = (
            SectionShares(quotas, capacity)
            if quotas is not None and (quotas.tenants or quotas.default is not None)
            else None
        )
        """Tenants' bytes over every size, where the section has quotas."""
        self.evicted = 0
        """Blocks evicted to keep the section within `capacity`."""
        self._members: list[GuardedTier] = []
        self._stamps: dict[OffloadKey, int] = {}
        self._clock = itertools.count(1)
        self._reserved = 0
        self._busy: Counter[OffloadKey] = Counter()
        self._lock: anyio.Lock | None = None  # made on the loop
        self._empty_capacity = 0  # object bytes the section holds of its best size

    # -- counters ----------------------------------------------------------------------
    @property
    def used(self) -> int:
        """Bytes the instances hold (each counts its blocks' footprint)."""
        return sum(_used(g.tier) for g in self._members)

    def total(self) -> int:
        """Bytes held and reserved for stores running now."""
        return self.used + self._reserved

    def object_capacity(self) -> int:
        """What the section holds when full, in object bytes (LMCache's usage counts
        object bytes, the capacity counts footprints): as many blocks as fit at the
        mean footprint of those held now, each of their mean object size (for one
        size: `capacity // footprint * size`, as one tier's `room` says); holding
        nothing, what its best-packed size fills. Reads counters only: any thread."""
        used = held = blocks = 0
        for guarded in list(self._members):
            try:
                count = len(guarded.tier)  # type: ignore[arg-type]
            except TypeError:
                return self._empty_capacity or self.capacity
            used += _used(guarded.tier)
            blocks += count
            held += count * guarded.block_bytes
        if used > 0 and blocks > 0:
            return self.capacity * blocks // used * held // blocks
        return self._empty_capacity or self.capacity

    # -- the instances -------------------------------------------------------------------
    async def adopt(self, guarded: GuardedTier) -> None:
        """Make `guarded`'s tier answer to this budget (on the loop, before it serves):
        its stores reserve room first, its stores and loads stamp recency. The tier's
        own methods are wrapped on the instance: the driver calls `tier.store` and
        `tier.load`, and a wrapper tier would have to pass on the whole contract."""
        tier = guarded.tier
        store, load = tier.store, tier.load

        async def budgeted_store(job: JobMetadata) -> JobResult:
            return await self._store(guarded, store, job)

        async def stamped_load(job: JobMetadata) -> JobResult:
            result = await load(job)
            self._stamp(getattr(result, "ok_keys", ()))
            return result

        tier.store = budgeted_store  # type: ignore[method-assign]
        tier.load = stamped_load  # type: ignore[method-assign]
        self._members.append(guarded)
        if guarded.opened:
            full = tier.room().capacity_blocks * guarded.block_bytes
            self._empty_capacity = max(self._empty_capacity, min(full, self.capacity))
        await self.settle()

    async def settle(self) -> None:
        """Evict until the section is within `capacity` (an instance just opened with
        what an earlier process left, or `capacity` was lowered since)."""
        async with self._evicting():
            await self._shrink(self.capacity)

    def forget(self, keys: Iterable[OffloadKey]) -> None:
        """Keys that left their instance (removed, evicted, deleted)."""
        stamps = self._stamps
        keys = list(keys)
        for key in keys:
            stamps.pop(key, None)
        if self.shares is not None:
            self.shares.remove(keys)

    # -- stores --------------------------------------------------------------------------
    async def _store(self, guarded: GuardedTier, store: Job, job: JobMetadata) -> JobResult:
        """Reserve room for `job`'s new blocks (evicting across sizes), then store what
        got room; the rest fails `no room`."""
        tier, keys = guarded.tier, job.keys
        tenant = SectionShares.name(getattr(job.ctx, "tenant", None))
        self._busy.update(keys)
        reserved = 0
        try:
            held = list(await tier.lookup(keys, job.ctx))
            if len(held) != len(keys):  # a wrong answer: count every key as new
                held = [False] * len(keys)
            # a key held writes nothing; one bigger than the whole capacity is the
            # tier's to refuse (it says how to fix it)
            costs = [0 if was else cost for was, cost in zip(held, (_cost(tier, k) for k in keys))]
            costs = [0 if c > self.capacity else c for c in costs]
            who = _Store(tenant, guarded.block_bytes, costs)
            admitted, reserved = await self._reserve(costs, guarded, who)
            if all(admitted):
                result = await store(job)
            else:
                result = await self._store_some(store, job, admitted)
            ok = getattr(result, "ok_keys", ())  # the driver checks the answer
            self._stamp(ok)
            if self.shares is not None:
                cost_of = dict(zip(keys, costs))
                placed = [(k, cost_of[k], guarded.block_bytes) for k in ok if cost_of.get(k)]
                self.shares.add(tenant, placed)
            return result
        finally:
            self._reserved -= reserved
            if self.shares is not None and reserved:
                self.shares.release(tenant, reserved, who.objects(reserved))
            busy = self._busy
            for key in keys:
                left = busy[key] - 1
                if left > 0:
                    busy[key] = left
                else:
                    del busy[key]

    async def _store_some(self, store: Job, job: JobMetadata, admitted: list[bool]) -> JobResult:
        reason = (
            f"{NO_ROOM}: the {self.name} capacity of {format_size(self.capacity)}, shared "
            "by every object size, is taken by blocks being read, written or claimed by "
            "lookups; retry later or raise `capacity`"
        )
        failed = {k: reason for k, ok in zip(job.keys, admitted) if not ok}
        some = [(k, s) for k, s, ok in zip(job.keys, job.slots, admitted) if ok]
        if some:
            keys, slots = tuple(k for k, _ in some), tuple(s for _, s in some)
            part = JobMetadata(job.job_id, keys, slots, job.ctx)
            done = await store(part)
            failing = getattr(done, "failed_keys", part.keys)  # the driver checks the answer
            failed.update(dict.fromkeys(failing, getattr(done, "error", None) or "failed"))
        return JobResult.partial(job, failed)

    async def _reserve(
        self, costs: Sequence[int], storing: GuardedTier, who: _Store
    ) -> tuple[list[bool], int]:
        """Which keys of a job of `storing` get room, and the bytes reserved for them
        (evicting first where needed)."""
        need = sum(costs)
        lock = self._evicting()
        if not lock.locked() and self._room(who) >= need:
            self._hold(who, need)
            return [True] * len(costs), need
        async with lock:
            if self._room(who) < need:
                if self.shares is None:
                    # as many keys as evicting every candidate would make room for
                    _, freed = self._choose(self.total() + need - self.capacity)
                    admitted = _fit(costs, self.capacity - self.total() + freed)
                    need = sum(c for c, ok in zip(costs, admitted) if ok)
                    await self._shrink(self.capacity - need, storing)
                else:
                    await self._make_room(costs, who, storing)
            admitted = _fit(costs, self._room(who))
            need = sum(c for c, ok in zip(costs, admitted) if ok)
            self._hold(who, need)
            return admitted, need

    def _room(self, who: _Store) -> int:
        """Bytes a store may reserve now, evicting nothing: the free room, within its
        tenant's quota unless the section borrows."""
        free = max(0, self.capacity - self.total())
        if self.shares is None:
            return free
        took, _ = self.shares.split(who.tenant, free, free, who.ratio)
        return took

    def _hold(self, who: _Store, nbytes: int) -> None:
        self._reserved += nbytes
        if self.shares is not None and nbytes:
            self.shares.reserve(who.tenant, nbytes, who.objects(nbytes))

    async def _make_room(self, costs: Sequence[int], who: _Store, storing: GuardedTier) -> None:
        """Under the lock, with quotas: evict by the quota rule for a store of `costs`
        (`shares`: others' takeable blocks while its tenant grows within its quota,
        then its own), no more than the keys that can get room need."""
        shares = self.shares
        assert shares is not None
        free = max(0, self.capacity - self.total())
        walk = WALK + 8 * len(costs)
        tenant = who.tenant

        def plan(need: int) -> tuple[dict[GuardedTier, list[OffloadKey]], int]:
            took, grow = shares.split(tenant, need, free, who.ratio)
            victims, freed = self._choose(min(grow, need - took), shares.others(tenant), walk)
            if took + freed < need:
                own, more = self._choose(need - took - freed, shares.own(tenant), walk)
                for guarded, keys in own.items():
                    victims.setdefault(guarded, []).extend(keys)
                freed += more
            return victims, took + freed

        _, reachable = plan(sum(costs))
        victims, _ = plan(sum(c for c, ok in zip(costs, _fit(costs, reachable)) if ok))
        await self._evict(victims, storing)

    # -- eviction ------------------------------------------------------------------------
    def _evicting(self) -> anyio.Lock:
        if self._lock is None:
            self._lock = anyio.Lock()
        return self._lock

    async def _shrink(self, limit: int, storing: GuardedTier | None = None) -> None:
        """Under the lock: evict the least recently used blocks of every size until the
        section's total is within `limit` (or nothing more may go). Blocks of the
        instance `storing` (whose store the room is for) are `evict`ed: that store
        reuses their space (an nvme slab's slots, in place); others are `remove`d,
        their space given back, since another instance's store takes its own."""
        for _ in range(ROUNDS):
            excess = self.total() - limit
            if excess <= 0:
                return
            victims, _ = self._choose(excess)
            if not victims:
                return
            await self._evict(victims, storing)

    async def _evict(
        self, victims: dict[GuardedTier, list[OffloadKey]], storing: GuardedTier | None
    ) -> None:
        """Evict `victims` (by instance): the storing instance's are `evict`ed (their
        slots go to its store), others' `remove`d; each reported removed."""
        for guarded, keys in victims.items():
            try:
                if guarded is storing:  # its slots go to the store that evicts
                    await guarded.tier.evict(keys)
                else:
                    await guarded.tier.remove(keys)
            except anyio.get_cancelled_exc_class():
                # memory and nvme drop the keys before their first await (nvme
                # deletes the files shielded): they are gone, say so
                guarded.tier.report_removed(keys)
                raise
            except Exception as exc:  # the tier is down: its blocks stay counted
                logger.warning(
                    "tierkv below LMCache's L1: %s (%d-byte objects): eviction for "
                    "the shared capacity failed: %s",
                    self.name,
                    guarded.block_bytes,
                    exc,
                )
                continue
            self.evicted += len(keys)
            guarded.tier.report_removed(keys)  # the key record and stamps follow

    def _choose(
        self, excess: int, accept: Accept | None = None, walk: int = 0
    ) -> tuple[dict[GuardedTier, list[OffloadKey]], int]:
        """Victims freeing `excess` bytes (or as many as there are), oldest stamp
        first among each instance's next candidates; and the bytes they free. With
        `accept`, only blocks it accepts, walking past at most `walk` others."""
        if excess <= 0:
            return {}, 0
        stamps, busy = self._stamps, self._busy
        heads: list[tuple[int, int, OffloadKey]] = []
        candidates: list[Iterator[OffloadKey]] = []
        passed = 0

        def push(n: int) -> None:
            nonlocal passed
            for key in candidates[n]:
                if key in busy:
                    continue
                if accept is not None and not accept(key, _cost(self._members[n].tier, key)):
                    passed += 1
                    if passed > walk:
                        return
                    continue
                heapq.heappush(heads, (stamps.get(key, 0), n, key))
                return

        for n, guarded in enumerate(self._members):
            candidates.append(guarded.tier.eviction_candidates() if guarded.opened else iter(()))
            push(n)
        victims: dict[GuardedTier, list[OffloadKey]] = {}
        freed = 0
        while freed < excess and heads:
            _, n, key = heapq.heappop(heads)
            guarded = self._members[n]
            victims.setdefault(guarded, []).append(key)
            freed += _cost(guarded.tier, key)
            push(n)
        return victims, freed

    def _stamp(self, keys: Iterable[OffloadKey]) -> None:
        clock, stamps = self._clock, self._stamps
        for key in keys:
            stamps[key] = next(clock)


class _Store:
    """A store job as the quotas see it: its tenant, and its blocks' footprint per
    object byte (`ratio`), which converts a quota of object bytes."""

    __slots__ = ("block_bytes", "ratio", "tenant")

    def __init__(self, tenant: str, block_bytes: int, costs: Sequence[int]) -> None:
        self.tenant = tenant
        self.block_bytes = block_bytes
        costly = [c for c in costs if c > 0]
        self.ratio = sum(costly) / (len(costly) * block_bytes) if costly and block_bytes else 1.0

    def objects(self, footprint: int) -> int:
        """The object bytes of `footprint` bytes of this job's blocks."""
        return round(footprint / self.ratio) if self.ratio else 0


def _fit(costs: Sequence[int], room: int) -> list[bool]:
    """Keys in order, each taken while its bytes fit in what is left of `room`."""
    admitted = []
    for cost in costs:
        ok = cost <= room
        if ok:
            room -= cost
        admitted.append(ok)
    return admitted
