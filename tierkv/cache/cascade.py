"""Down the chain: `store` and the cascades it starts.

A store places blocks in key order (a stored prefix is useful, a suffix without its
prefix is not). The primary is a cache and a staging area: blocks are copied in
windows into the room the primary gives stores (`PrimaryTier.store_room`: free or
evictable slots, less the part of the promotions' share no promotion holds, so the
next request's load finds room while this store's cascades run); each window is sent
on to the write-through tiers at once (one job per tier per window), and its slots
become evictable when every tier it was sent to has answered. When the store's room
is used up, the next window waits (up to `store_timeout`, woken only when room is
released) and then evicts blocks some tier already accepted, so a store of any size
streams through the primary while the chain has room somewhere; it takes the
promotions' part too when nothing in flight can release room. Blocks of the request
that no tier accepted are never evicted by the request itself; when nothing in flight
can make room, the rest is rejected at once with the reason. Nothing is dropped
silently.

A store that says where each block sits in its group (`positions`) keeps only the
blocks a hit can use (`tierkv.retention`: every full-attention block, sliding-window
blocks inside a window before a checkpoint, states at checkpoints); the rest are
reported `skipped` and counted (`store_skipped`), never copied or cascaded.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import anyio

from tierkv.cache.core import CacheCore
from tierkv.cache.guard import TierHandle
from tierkv.cache.index import KeyIndex
from tierkv.cache.results import StoreResult
from tierkv.cache.validate import check_keys, checked_source, run_validate_hook
from tierkv.cache.writeback import WriteBack
from tierkv.contract.jobs import JobMetadata, ReqContext
from tierkv.contract.keys import OffloadKey
from tierkv.policies.admission import ReuseAdmission
from tierkv.retention import kept_blocks
from tierkv.room import Kind

logger = logging.getLogger(__name__)


class StoreWatch:
    """What one store's cascades did: keys of the request that no tier accepted (and
    that no cascade still carries) are `unsafe` to evict while the store runs."""

    def __init__(self, index: KeyIndex) -> None:
        self.index = index
        self.outstanding: dict[OffloadKey, int] = {}
        self.accepted: set[OffloadKey] = set()
        self.unsafe: set[OffloadKey] = set()

    def sent(self, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            self.outstanding[key] = self.outstanding.get(key, 0) + 1

    def settled(self, keys: Sequence[OffloadKey], ok_keys: Sequence[OffloadKey]) -> None:
        self.accepted.update(ok_keys)
        for key in keys:
            left = self.outstanding.get(key, 1) - 1
            if left > 0:
                self.outstanding[key] = left
                continue
            self.outstanding.pop(key, None)
            if key not in self.accepted:
                self.unsafe.add(key)

    def placed(self, keys: Sequence[OffloadKey]) -> None:
        """`keys` are in the primary and every cascade for them has been started."""
        for key in keys:
            # (dirty blocks are never evicted anyway)
            if (
                key not in self.outstanding
                and key not in self.accepted
                and self.index.is_clean(key)
            ):
                self.unsafe.add(key)

    def declined(self, keys: Iterable[OffloadKey]) -> None:
        """Admission kept `keys` out of a tier on purpose: evictable like accepted ones."""
        self.accepted.update(keys)

    def may_evict(self, key: OffloadKey) -> bool:
        return key not in self.unsafe and self.index.is_clean(key)


class Cascader:
    def __init__(self, core: CacheCore, writeback: WriteBack) -> None:
        self.core = core
        self.writeback = writeback
        self.selective = [h for h in core.tiers if h.policy == "write_through_selective"]
        # write-through tiers that take only blocks likely to be read again
        self.reuse = [h for h in core.tiers if h.config.admission == "reuse"]
        self.admission = ReuseAdmission() if self.reuse else None
        # a block reuse admission declines may be evicted by its own streaming store
        # only when no write-through tier takes every block (those decide its safety)
        self._declines_free = all(
            h.config.admission == "reuse" for h in core.tiers if h.policy == "write_through"
        )
        self.window = max(1, core.primary.num_blocks // 4)

    # -- cascades ----------------------------------------------------------------------
    def after_store(self, keys: Sequence[OffloadKey], watch: StoreWatch | None = None) -> None:
        """Send freshly stored `keys` on, per each tier's write policy."""
        if not keys:
            return
        index = self.core.index
        admitted: list[OffloadKey] | None = None
        for handle in self.core.tiers:
            if handle.policy == "write_through":
                if handle.config.admission == "reuse":
                    if admitted is None:
                        admitted = self._admitted(keys, watch)
                    handle.stats.declined += len(keys) - len(admitted)
                    if admitted:
                        self.cascade(handle, admitted, watch)
                    continue
                self.cascade(handle, keys, watch)
            elif handle.policy == "write_through_selective":
                need = handle.config.min_hits
                chosen = index.with_hits(keys, need)
                if chosen:
                    self.cascade(handle, chosen, watch)
        self.writeback.admit(keys)

    def _admitted(self, keys: Sequence[OffloadKey], watch: StoreWatch | None) -> list[OffloadKey]:
        """The `keys` reuse admission lets into its tiers; the rest are declined, and
        a streaming store may evict them as if a tier had taken them (they were judged
        not worth keeping: holding them would only make the store reject)."""
        assert self.admission is not None
        verdicts = self.admission.admits(keys)
        admitted = [k for k, ok in zip(keys, verdicts) if ok]
        if watch is not None and self._declines_free and len(admitted) < len(keys):
            watch.declined(k for k, ok in zip(keys, verdicts) if not ok)
        return admitted

    def cascade(
        self, handle: TierHandle, keys: Sequence[OffloadKey], watch: StoreWatch | None = None
    ) -> None:
        """Send `keys` (ready in the primary) to `handle` in the background, or drop
        them (tier down, or too far behind)."""
        core = self.core
        if not core.is_open:
            return
        if not handle.usable():
            handle.stats.skipped_unhealthy += len(keys)
            return
        nbytes = len(keys) * core.block_bytes
        stats = handle.stats
        if (
            stats.inflight_bytes
            and stats.inflight_bytes + nbytes > handle.config.max_inflight_bytes
        ):
            handle.breaker.abandon()
            stats.drops += len(keys)
            logger.debug(
                "tier %s is behind: dropped a cascade of %d blocks", handle.name, len(keys)
            )
            return
        slots = core.primary.prepare_load(keys)  # protected until the tier answers
        stats.inflight_bytes += nbytes
        core.index.add_cascading(keys, 1)
        if watch is not None:
            watch.sent(keys)
        job = JobMetadata(core.next_job_id(), tuple(keys), tuple(slots))
        core.spawn(self._cascade_job, handle, job, nbytes, watch)

    async def _cascade_job(
        self, handle: TierHandle, job: JobMetadata, nbytes: int, watch: StoreWatch | None
    ) -> None:
        core = self.core
        ok_keys: Sequence[OffloadKey] = ()
        try:
            result = await handle.run_job("store", job, core.block_bytes)
            ok_keys = result.ok_keys
        finally:
            handle.stats.inflight_bytes -= nbytes
            core.primary.complete_load(job.keys)
            core.index.add_cascading(job.keys, -1)
            if watch is not None:
                watch.settled(job.keys, ok_keys)
        core.index.note_held(ok_keys, handle.index)
        core.emit_tier(handle, ok_keys, removed=False)

    def count_hits(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, tail: Sequence[OffloadKey] = ()
    ) -> None:
        """A request looked up `keys` and missed `tail`. Reuse admission counts the
        sightings; selective write-through counts one hit per key per request (a
        request that looks up again is not a new hit). Keys reaching a tier's
        threshold while resident in the primary cascade to it in one batch."""
        if self.admission is not None:
            self._sighted(keys, tail)
        if not self.selective:
            return
        primary = self.core.primary
        chosen: dict[int, list[OffloadKey]] = {}
        thresholds = [(h.index, h.config.min_hits) for h in self.selective]
        for key, hits in self.core.index.count_hits(keys, ctx.request_id):
            for i, need in thresholds:
                if hits == need and primary.is_ready(key):
                    chosen.setdefault(i, []).append(key)
        for i, batch in chosen.items():
            self.cascade(self.core.tiers[i], batch)

    def _sighted(self, keys: Sequence[OffloadKey], tail: Sequence[OffloadKey]) -> None:
        """Count a request's sightings; a block resident in the primary that has just
        been seen for the admitting time is written to the reuse tiers now (it was
        declined when stored, and is about to earn its place)."""
        assert self.admission is not None
        counts = self.admission.sighted(keys, tail).tolist()
        need = self.admission.min_sightings
        primary, index = self.core.primary, self.core.index
        # resident blocks, hit or not (a block past the hit may still be resident)
        late = [
            k
            for k, c in zip(keys, counts)
            if c == need and primary.is_ready(k) and not index.cascading(k)
        ]
        if not late:
            return
        for handle in self.reuse:
            batch = [k for k in late if not index.held(k) & handle.bit]
            if batch:
                self.cascade(handle, batch)

    # -- store -------------------------------------------------------------------------
    def _streams(self) -> bool:
        """Whether a block that leaves the primary can land somewhere below."""
        return any(
            h.opened and h.policy in ("write_through", "write_back") for h in self.core.tiers
        )

    def _behind(self, nbytes: int) -> bool:
        """Whether a write-through tier would drop a cascade of `nbytes` now (it already
        has `max_inflight_bytes` in flight)."""
        for h in self.core.tiers:
            stats = h.stats
            if (
                h.policy == "write_through"
                and stats.inflight_bytes
                and stats.inflight_bytes + nbytes > h.config.max_inflight_bytes
                and h.usable()
            ):
                return True
        return False

    def _may_free_room(self) -> bool:
        """Whether something in flight will release primary slots."""
        primary = self.core.primary
        return self.core.background > 0 or primary.num_staged > 0 or primary.num_held > 0

    def _window(self, rest: int, deadline: float) -> int:
        """How many of the `rest` blocks the next window places: all when they fit the
        store's room, else a quarter of the primary (so copying a window overlaps the
        cascade of the one before), less when the room is smaller; 0 for no room now.
        The promotions' unheld share is taken only when nothing in flight can release
        room, or the deadline passed: a store always progresses."""
        room = self._room(deadline)
        return rest if rest <= room else min(self.window, room)

    def _room(self, deadline: float) -> int:
        """The store's room now (see `_window`)."""
        primary = self.core.primary
        room = primary.store_room()
        if not room and (not self._may_free_room() or anyio.current_time() >= deadline):
            room = primary.store_room(take_aside=True)
        return room

    async def _wait(self, deadline: float) -> bool:
        """Wait, up to `deadline`, until room a store can use is released. False when
        the deadline has passed."""
        left = deadline - anyio.current_time()
        if left <= 0:
            return False
        self.core.counters["store_waits"] += 1
        await self.core.primary.wait_for_room(Kind.STORE, 1, left)
        return True

    async def _await_room(
        self, want: Sequence[OffloadKey], watch: StoreWatch, deadline: float
    ) -> str | None:
        """No block of `want` could be placed: write dirty victims back, or wait for
        room. None to try again, or why the rest of the store is rejected."""
        if self.writeback.enabled:  # dirty victims: write them back, within the deadline
            made = False
            with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
                made = await self.writeback.make_room(len(want))
            if made or self._room_now(want, watch, deadline):  # loads may have let go meanwhile
                return None
        if not self._streams() or not self._may_free_room():
            return (
                "the primary tier has no room: its blocks are held by reads, writes "
                "or cascades, or no lower tier accepted the blocks that would make room"
            )
        if not await self._wait(deadline):
            timeout = self.core.config.store_timeout
            return f"no room in the primary tier within store_timeout ({timeout:g}s)"
        return None

    def _room_now(self, want: Sequence[OffloadKey], watch: StoreWatch, deadline: float) -> bool:
        """Whether a slot for the next key is there now (free, or a victim this store
        may evict): the next window then places at least one block."""
        primary = self.core.primary
        if not self._room(deadline):
            return False
        if primary.num_free:
            return True
        wanted = set(want)
        return bool(primary.candidates(1, lambda k: k not in wanted and watch.may_evict(k)))

    async def _settle(
        self, keys: list[OffloadKey], deadline: float
    ) -> tuple[list[OffloadKey], list[OffloadKey], list[OffloadKey]]:
        """Wait (up to `deadline`) for the writes others are making of `keys` to end.
        Returns (ready now, lost: the write failed and the slot is gone, still being
        written at the deadline)."""
        primary, index = self.core.primary, self.core.index
        while True:
            writing = [k for k in keys if k in primary and not primary.is_ready(k)]
            left = deadline - anyio.current_time()
            if not writing or left <= 0:
                break
            flight = next((f for k in writing if (f := index.flight(k)) is not None), None)
            with anyio.move_on_after(left):
                if flight is not None:  # a promotion: its end is an event
                    await flight.done.wait()
                else:  # another store's copy into its slots: short
                    await anyio.sleep(0.001)
        ready = [k for k in keys if primary.is_ready(k)]
        lost = [k for k in keys if k not in primary]
        late = [k for k in keys if k in primary and not primary.is_ready(k)]
        return ready, lost, late

    async def store(
        self,
        keys: Sequence[OffloadKey],
        source: object,
        positions: Sequence[int] | None = None,
        end_tokens: int | None = None,
    ) -> StoreResult:
        core = self.core
        core.check_open()
        keys = list(keys)
        check_keys(keys, "keys")
        src = checked_source(source, len(keys), core.block_bytes)
        primary = core.primary
        skipped: list[OffloadKey] = []
        if positions is None:
            position = {key: i for i, key in enumerate(keys)}
        else:  # blocks no hit at a checkpoint can use are not stored (tierkv.retention)
            keep = kept_blocks(core.config.layout, keys, positions, end_tokens)
            position = {key: i for i, (key, ok) in enumerate(zip(keys, keep)) if ok}
            skipped = [key for key, ok in zip(keys, keep) if not ok]
        if len(position) + len(skipped) != len(keys):  # rare: a key twice; its first place counts
            position, left_out = {}, set(skipped)
            for i, key in enumerate(keys):
                if key not in left_out:
                    position.setdefault(key, i)
        resident, in_flight, new = primary.partition(position)
        already = resident
        # keys another store or a promotion is writing right now: `already_present`
        # only once that write succeeded; if it fails, this store writes them
        pending: list[OffloadKey] = list(in_flight)
        if hasattr(src, "validate"):  # e.g. KVCacheBlocks: GPU block ids, coverage
            run_validate_hook(src, "store", [position[k] for k in new], primary.view)
        stored: list[OffloadKey] = []
        rejected: list[OffloadKey] = []
        error: str | None = None
        watch = StoreWatch(core.index)
        placed: list[OffloadKey] = []  # stored, not yet told to the watch (needed lazily)
        deadline = anyio.current_time() + core.config.store_timeout
        streaming = False
        i = 0
        while i < len(new) or pending:
            if i >= len(new):  # every new key placed: settle what others were writing
                ready, new, late = await self._settle(pending, deadline)
                already.extend(ready)
                pending, i = [], 0
                if late:
                    error = (
                        "another store or promotion of these blocks was still writing "
                        f"them at store_timeout ({core.config.store_timeout:g}s)"
                    )
                    rejected.extend(late)
                continue
            if new[i] in primary:  # stored meanwhile by someone else
                (already if primary.is_ready(new[i]) else pending).append(new[i])
                i += 1
                continue
            size = self._window(len(new) - i, deadline)
            got: list[OffloadKey] = []
            slots: list[int] = []
            if size:
                streaming = streaming or size < len(new) - i
                # a streaming store waits for a write-through tier that is behind rather
                # than have the window's cascade dropped: its blocks must leave the
                # primary to make room for the next windows (a store that fits never
                # waits here; its cascade is dropped and counted instead)
                behind = streaming and self._behind(size * core.block_bytes)
                if behind and await self._wait(deadline):
                    continue
                want = new[i : i + size]  # the primary skips keys stored meanwhile
                if placed:  # a later window may evict: this request's earlier blocks must be safe
                    watch.placed(placed)
                    placed.clear()
                veto = watch.may_evict if watch.unsafe or core.index.dirty_count else None
                prepared = primary.prepare_store_prefix(want, may_evict=veto)
                core.events.drain_primary()
                got, slots = prepared.keys_to_store, prepared.slots
            else:
                want = new[i : i + min(self.window, len(new) - i)]
            if not got:
                error = await self._await_room(want, watch, deadline)
                if error is not None:
                    break
                continue
            success = False
            try:
                await src.copy_to_slots(primary.view, [position[k] for k in got], slots)
                success = True
            finally:
                primary.complete_store(got, success=success)
                core.events.drain_primary()
            stats = core.primary_stats
            stats.store_jobs += 1
            stats.blocks_stored += len(got)
            stats.bytes_in += len(got) * core.block_bytes
            stored.extend(got)
            self.after_store(got, watch)
            placed.extend(got)
            if got == want[: len(got)]:  # nothing was skipped: a prefix of `new[i:]`
                i += len(got)
                continue
            got_set, last = set(got), got[-1]
            while True:  # move past the window; keys it skipped were stored meanwhile
                key = new[i]
                i += 1
                if key not in got_set:
                    (already if primary.is_ready(key) else pending).append(key)
                if key == last:
                    break
        if error is not None:
            for key in [*new[i:], *pending]:  # present only if ready; in flight is not
                (already if primary.is_ready(key) else rejected).append(key)
            core.primary_stats.drops += len(rejected)
            core.counters["store_rejected"] += len(rejected)
            if not rejected:
                error = None
        core.counters["store_skipped"] += len(skipped)  # counted once the store ran
        if len(already) != len(resident):  # some were settled later: back to key order
            already.sort(key=position.__getitem__)
        return StoreResult(
            stored=tuple(stored),
            already_present=tuple(already),
            rejected=tuple(rejected),
            error=error,
            skipped=tuple(skipped),
        )
