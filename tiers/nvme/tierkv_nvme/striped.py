"""`nvme` over several directories (`paths:`), one per drive, serving as one tier.

A `StripedNvmeTier` owns one `NvmeTier` per directory (a *stripe*): each with its own
directory lock, fan-out directories, index, `io_concurrency` queue and share of
`capacity`, exactly as a tier of one `path`. `NvmeTier(config, primary)` builds this
class when `config.paths` names more than one directory, so the `nvme` entry point and
every caller that constructs an `NvmeTier` get striping from YAML alone.

Where a block goes, and where it is found:

- The stripes' indexes are the truth of what is held: a lookup, load, store or touch
  asks them (in memory, as for one directory), so a block is found wherever it lies,
  whatever the order of `paths` or a change to it (a directory added keeps every
  block; one removed takes its blocks with it).
- A new block goes to its *home* stripe (a stable hash of its key, blake2b, never
  Python's `hash()`) while that stripe has room; else to another stripe with room (a
  second draw of the same hash, so a full or failed stripe's blocks spread evenly
  over the others); when no stripe has room, to the stripe holding the least recently
  used block of the whole tier, which that stripe's own eviction then takes. So the
  tier evicts as one LRU over `capacity` (`eviction_candidates` merges the stripes'
  LRU orders by the tier's own recency stamps), while each stripe stays within its
  share (no drive fills past it). Two stores running at once may each take a stripe's
  last free room; the later one then evicts that stripe's own oldest block.
- A block already held stays where it is (a repeated store refreshes it there); one
  being written by another job goes to the same stripe, so no key is held twice.
- A job is split by stripe and the stripes run their parts at once; the results are
  merged into one `JobResult`. Each stripe keeps the job's deadline (`job_timeout`)
  as one tier does.

Capacity is split in whole blocks (of the primary's block size, with a 36-byte key,
on 4 KiB filesystem blocks), the rest of a block to the first stripe, so the stripes
together hold as many blocks as `capacity` does.

Faults:

- A store a stripe fails for a fault (an OS error such as EPERM, EROFS, ENOSPC or EIO,
  its directory gone, an unexpected error, or its part of the job running past
  `job_timeout`) marks the stripe failing: the keys it failed are stored on the other
  stripes in the same job while the job's deadline allows, and new blocks skip it for
  `recovery_after` (the breaker's wait). Then it gets its share again; if it fails
  again its keys go elsewhere again. So an unwritable drive costs no stores, only its
  share of capacity. A key refused for want of room (`NO_ROOM`: the stripe is full of
  claimed or pinned blocks) is not a fault and is not moved.
- Blocks already on a failing stripe are still found and loaded: reads do not care
  whether it can write. A read error is the stripe's business as for one directory
  (kept for a few reads, then deleted and reported removed).
- When every stripe is failing, stores go to them anyway (as if none were).
- A directory that cannot be taken at `open` fails the whole open, naming it, as for
  `path:` (set `required: false` to start without the tier, or remove the path).
- A directory removed under the tier is made anew by its stripe (its blocks are
  reported removed); the other stripes go on.
- `open` keeps one copy of a key found in two directories (a crash between a write
  and its report can leave one), the most recently stored, and deletes the other.

Recency across a restart: each stripe orders its own blocks by mtime; the tier
interleaves the stripes' orders evenly (it does not stat every file again).
Memory: one recency stamp per block on top of the stripes' indexes.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
from pydantic import ByteSize

from tierkv.contract.errors import ConfigError
from tierkv.contract.units import format_size
from tierkv.tier import (
    InFlightJobs,
    JobMetadata,
    JobResult,
    OffloadKey,
    PrimaryView,
    ReqContext,
    SecondaryTierManager,
    TierConfig,
    TierRoom,
    TierUnavailable,
)
from tierkv_nvme.config import NvmeTierConfig
from tierkv_nvme.recovery import cycles_uncollected
from tierkv_nvme.tier import DEFAULT_FS_BLOCK, NvmeTier, RecoveryReport, disk_footprint

__all__ = ["StripedNvmeTier", "split_capacity", "stripe_hash"]

logger = logging.getLogger(__name__)

ESTIMATE_KEY_BYTES = 36
"""A sha256 block hash and its group: the key length capacity is split by."""

_FAULTS = ("nvme write failed", "unexpected ", "gone from the nvme tier", "did not finish")
"""How a stripe's store reasons begin or read when the stripe, not the block, is at
fault: `NvmeTier._io_error` ("nvme write failed: ..."), `_describe_error` ("unexpected
...", "block file is gone from the nvme tier"), the runner's deadline ("... did not
finish within job_timeout"). Anything else (`NO_ROOM`, a block bigger than the stripe)
would fail on every stripe alike."""

_LATE = "nvme store did not finish within job_timeout={}s"


def stripe_hash(key: OffloadKey) -> int:
    """A stable 64-bit hash of `key` (the same in every process and run)."""
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def split_capacity(capacity: int, stripes: int, block: int) -> list[int]:
    """`capacity` bytes over `stripes` in whole `block`s, as evenly as they go (the
    first stripes take one more where they do not divide), the bytes short of a block
    to the first stripe: the shares add up to `capacity`, and hold as many blocks
    together as it does. Below one block per stripe, bytes split evenly."""
    whole = capacity // block
    if whole < stripes:
        each, extra = divmod(capacity, stripes)
        return [each + (i < extra) for i in range(stripes)]
    each, extra = divmod(whole, stripes)
    shares = [(each + (i < extra)) * block for i in range(stripes)]
    shares[0] += capacity - whole * block
    return shares


class StripedNvmeTier(SecondaryTierManager):
    """Blocks as files under each of `config.paths`, spread by key hash, LRU-evicted
    as one tier past `config.capacity` (see the module docstring)."""

    Config = NvmeTierConfig
    config: NvmeTierConfig
    reports_evictions = True
    protects_claims = True
    lookup_answers_from_memory = True  # the stripes' indexes (and their `_ready` calls)
    names_eviction_candidates = True
    accepts_regions = True

    def __init__(self, config: TierConfig, primary: PrimaryView) -> None:
        super().__init__(config, primary)
        directories = self.config.directories()
        if directories[0] != self.config.path:
            raise ConfigError(
                f"nvme tier: `path` is {str(self.config.path)!r} but `paths` begins with "
                f"{str(directories[0])!r}: whatever changed one of them (a tool that moves "
                "a tier's files) must change both, `path` being the first of `paths`"
            )
        estimate = disk_footprint(
            self.framer.frame_bytes(bytes(ESTIMATE_KEY_BYTES), primary.block_bytes),
            DEFAULT_FS_BLOCK,
        )
        capacity = int(self.config.capacity)
        shares = split_capacity(capacity, len(directories), estimate)
        if capacity // estimate < len(directories):
            logger.warning(
                "nvme tier: capacity %s holds fewer blocks of %s than there are paths "
                "(%d); some directories can hold none",
                format_size(capacity),
                format_size(estimate),
                len(directories),
            )
        self.stripes: tuple[NvmeTier, ...] = tuple(
            NvmeTier(
                self.config.model_copy(
                    update={"path": path, "paths": None, "capacity": ByteSize(share)}
                ),
                primary,
            )
            for path, share in zip(directories, shares)
        )
        """One tier per directory, in the order of `paths`."""
        for stripe in self.stripes:
            stripe.claims = self.claims  # one table: `protect` on this tier reaches all
            stripe.set_removal_listener(self._removed)
        self._failing_until = [0.0] * len(self.stripes)  # time.monotonic()
        self._failing_why: list[str | None] = [None] * len(self.stripes)
        self._stamps: dict[OffloadKey, int] = {}
        """Recency across stripes: the higher, the more recently stored or used."""
        self._clock = itertools.count(1)
        self._placing: dict[OffloadKey, tuple[int, int]] = {}
        """New keys being stored: the stripe chosen for them and how many jobs store
        them there (a second store of a key goes where the first one went)."""
        self._inflight = InFlightJobs(self.name)
        self._state = "new"
        self.recovery: RecoveryReport | None = None
        """What the last `open` found, summed over the stripes."""

    @staticmethod
    def get_tier_type() -> str:
        return "nvme"

    @classmethod
    def installation(cls) -> dict[str, str]:
        return NvmeTier.installation()

    # -- introspection ------------------------------------------------------------
    @property
    def directories(self) -> list[Path]:
        """Each stripe's namespace directory, in the order of `paths`."""
        return [stripe.directory for stripe in self.stripes]

    @property
    def used_bytes(self) -> int:
        """Disk bytes of the blocks held, over all stripes."""
        return sum(stripe.used_bytes for stripe in self.stripes)

    def __len__(self) -> int:
        return sum(len(stripe) for stripe in self.stripes)

    def home(self, key: OffloadKey) -> int:
        """The stripe a new block of `key` goes to while that stripe has room."""
        return stripe_hash(key) % len(self.stripes)

    def footprint(self, key: OffloadKey) -> int:
        """Disk bytes one block stored under `key` takes (on its home stripe)."""
        return self.stripes[self.home(key)].footprint(key)

    def failing(self) -> list[int]:
        """The stripes new blocks skip now, after a fault of theirs."""
        now = time.monotonic()
        return [i for i, until in enumerate(self._failing_until) if until > now]

    def room(self) -> TierRoom:
        """The stripes' room added up (only those new blocks may go to, for free)."""
        free = sum(self.stripes[i].room().free_blocks for i in self._writable(set()))
        return TierRoom(free, sum(stripe.room().capacity_blocks for stripe in self.stripes))

    def eviction_candidates(self) -> Iterator[OffloadKey]:
        """The stripes' candidates merged, least recently used first (the order the
        placement of new blocks evicts in, when no stripe has room)."""
        return (key for _stamp, _i, key in self._victims(self._writable(set())))

    def describe(self) -> dict[str, Any]:
        failing = set(self.failing())
        return {
            "type": self.get_tier_type(),
            "paths": [str(stripe.config.path) for stripe in self.stripes],
            "blocks": len(self),
            "used_bytes": self.used_bytes,
            "capacity": int(self.config.capacity),
            "fsync": self.config.fsync,
            "io_concurrency": self.config.io_concurrency,
            "mac": self.framer.mac,
            "io_engine": self.stripes[0].describe()["io_engine"],
            "checksum_bits": self.stripes[0].describe()["checksum_bits"],
            "mac_lanes": self.stripes[0].describe()["mac_lanes"],
            "stripes": [
                {
                    "path": str(stripe.config.path),
                    "directory": str(stripe.directory),
                    "blocks": len(stripe),
                    "used_bytes": stripe.used_bytes,
                    "capacity": int(stripe.config.capacity),
                    "writable": i not in failing,
                    **({"failed": self._failing_why[i]} if i in failing else {}),
                }
                for i, stripe in enumerate(self.stripes)
            ],
        }

    # -- life cycle ---------------------------------------------------------------
    async def open(self) -> None:
        """Open every stripe (at once), then index the keys across them.

        Raises TierUnavailable, naming each directory that failed, when any stripe
        cannot open; the stripes that did are closed again."""
        if self._state != "new":
            raise TierUnavailable(f"nvme tier over {self._paths()} was already opened")
        errors: dict[int, Exception] = {}

        async def open_one(i: int) -> None:
            try:
                await self.stripes[i].open()
            except Exception as exc:  # gathered: the others are closed again
                errors[i] = exc

        async with anyio.create_task_group() as tg:
            for i in range(len(self.stripes)):
                tg.start_soon(open_one, i)
        if errors:
            for i, stripe in enumerate(self.stripes):
                if i not in errors:
                    await stripe.close()
            first = errors[min(errors)]
            if not all(isinstance(exc, TierUnavailable) for exc in errors.values()):
                raise first
            raise TierUnavailable(
                f"nvme tier over {len(self.stripes)} directories cannot open "
                f"{len(errors)} of them: " + "; ".join(str(errors[i]) for i in sorted(errors))
            ) from first
        self.data_path = self.stripes[0].data_path
        try:
            duplicates = await self._index_stripes()
        except BaseException:
            for stripe in self.stripes:
                await stripe.close()
            raise
        reports = [stripe.recovery for stripe in self.stripes if stripe.recovery is not None]
        self.recovery = RecoveryReport(
            blocks=len(self),
            bytes=self.used_bytes,
            removed_temp=sum(r.removed_temp for r in reports),
            removed_bad=sum(r.removed_bad for r in reports) + duplicates,
            evicted_over_capacity=sum(r.evicted_over_capacity for r in reports),
            moved_up=sum(r.moved_up for r in reports),
        )
        self._state = "open"
        logger.info(
            "nvme tier striped over %d directories (%s): %d blocks (%s) recovered",
            len(self.stripes),
            self._paths(),
            self.recovery.blocks,
            format_size(self.recovery.bytes),
        )

    async def _index_stripes(self) -> int:
        """Stamp every block found, interleaving the stripes' LRU orders evenly, and
        delete the older copy of a key found in two stripes; how many were deleted."""
        where: dict[OffloadKey, int] = {}
        older: dict[int, list[OffloadKey]] = {}
        with cycles_uncollected():  # objects by the block, as the stripes' own rebuilds
            orders = [list(stripe.eviction_candidates()) for stripe in self.stripes]
            ranked = [
                [((rank + 0.5) / len(order), i, key) for rank, key in enumerate(order)]
                for i, order in enumerate(orders)
            ]
            for _at, i, key in heapq.merge(*ranked):  # least recently used first
                if key in where:
                    older.setdefault(where[key], []).append(key)
                where[key] = i
                self._stamps[key] = next(self._clock)
        for i, keys in older.items():
            logger.warning(
                "nvme tier: %d blocks in %s are also held in another directory; deleted this copy",
                len(keys),
                self.stripes[i].directory,
            )
            await self.stripes[i].remove(keys)
        return sum(len(keys) for keys in older.values())

    async def close(self) -> None:
        """Let running jobs finish, then close every stripe. Idempotent."""
        if self._state == "closed":
            return
        self._state = "closing"
        await self._inflight.drain()
        async with anyio.create_task_group() as tg:
            for stripe in self.stripes:
                tg.start_soon(stripe.close)
        self._stamps.clear()
        self._placing.clear()
        self.claims.clear()
        self._state = "closed"

    def _check_open(self) -> None:
        if self._state != "open":
            raise TierUnavailable(f"nvme tier over {self._paths()} is not open ({self._state})")

    def _paths(self) -> str:
        return ", ".join(str(stripe.config.path) for stripe in self.stripes)

    # -- the contract -------------------------------------------------------------
    async def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[bool]:
        return [holder is not None for holder in await self._holders(keys, ctx)]

    async def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Refresh the blocks' recency in their stripe and across stripes (no I/O)."""
        if self._state != "open":
            return
        for stripe in self.stripes:
            await stripe.touch(keys)
        stamps = self._stamps
        for key in keys:
            if key in stamps:
                stamps[key] = next(self._clock)

    async def remove(self, keys: Sequence[OffloadKey]) -> None:
        self._check_open()
        async with self._inflight.job():
            async with anyio.create_task_group() as tg:
                for stripe in self.stripes:
                    tg.start_soon(stripe.remove, keys)
            for key in keys:
                self._stamps.pop(key, None)

    async def load(self, job: JobMetadata) -> JobResult:
        self._check_open()
        async with self._inflight.job():
            holders = await self._holders(job.keys, job.ctx)
            failed: dict[OffloadKey, str] = {}
            plan: dict[int, list[tuple[OffloadKey, int]]] = {}
            stamps = self._stamps
            for key, slot, holder in zip(job.keys, job.slots, holders):
                if holder is None:
                    failed[key] = "not in the nvme tier"
                    continue
                plan.setdefault(holder, []).append((key, slot))
                stamps[key] = next(self._clock)  # as its stripe moves it up its LRU
            results: dict[int, JobResult | Exception] = {}
            await self._run(plan, job, "load", results)
            for i, pairs in plan.items():
                for key, why in self._failures(pairs, results.get(i)).items():
                    failed[key] = why
            return JobResult.partial(job, failed)

    async def store(self, job: JobMetadata) -> JobResult:
        self._check_open()
        async with self._inflight.job():
            placed: list[OffloadKey] = []  # keys this job counts in `_placing`
            try:
                failed = await self._store(job, placed)
            finally:
                self._unplace(placed)
        result = JobResult.partial(job, failed)
        if failed:
            logger.warning(
                "nvme tier: %d of %d blocks of job %d not stored: %s",
                len(failed),
                len(job.keys),
                job.job_id,
                result.error,
            )
        return result

    # -- stores, by stripe --------------------------------------------------------
    async def _store(self, job: JobMetadata, placed: list[OffloadKey]) -> dict[OffloadKey, str]:
        """Store `job` by stripe; the keys that failed, with a reason. Keys a stripe
        fails for a fault are stored on the others while the deadline allows."""
        deadline = anyio.current_time() + float(self.config.job_timeout)
        slots = dict(zip(job.keys, job.slots))
        holders = await self._holders(job.keys, job.ctx)
        # from here to the stripes' jobs no await: no other store may place a key meanwhile
        plan: dict[int, list[OffloadKey]] = {}
        new: list[OffloadKey] = []
        for key, holder in zip(job.keys, holders):
            if holder is None and key in self._placing:
                holder = self._placing[key][0]
                self._place_at(key, holder, placed)
            if holder is None:
                new.append(key)
            else:
                plan.setdefault(holder, []).append(key)
        for i, keys in self._place(new, set()).items():
            plan.setdefault(i, []).extend(keys)
            for key in keys:
                self._place_at(key, i, placed)
        fresh = set(new)  # keys written anew (the others refresh a block held)
        failed: dict[OffloadKey, str] = {}
        avoid: set[int] = set()  # stripes that failed this job for a fault
        first = True
        while plan:
            results: dict[int, JobResult | Exception] = {}
            pairs = {i: [(key, slots[key]) for key in keys] for i, keys in plan.items()}
            if first:  # the stripes keep the job's deadline themselves
                await self._run(pairs, job, "store", results)
            else:
                with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
                    await self._run(pairs, job, "store", results)
            faulted: dict[int, list[OffloadKey]] = {}
            for i, keys in plan.items():
                outcome = results.get(i)
                why = self._failures(pairs[i], outcome)
                for key in keys:
                    if key in why:
                        failed[key] = why[key]
                    else:
                        failed.pop(key, None)  # stored here after failing elsewhere
                fault = self._fault_of(outcome)
                if fault is not None and why:
                    self._mark_failing(i, fault)
                    faulted[i] = list(why)
                elif self._failing_why[i] is not None and any(
                    key in fresh and key not in why for key in keys
                ):
                    self._mark_writable(i)
            first = False
            avoid |= set(faulted)
            plan = await self._replan(faulted, avoid, deadline, job, placed, failed)
        stamps = self._stamps
        for key in job.keys:
            if key not in failed:
                stamps[key] = next(self._clock)
        return failed

    async def _replan(
        self,
        faulted: dict[int, list[OffloadKey]],
        avoid: set[int],
        deadline: float,
        job: JobMetadata,
        placed: list[OffloadKey],
        failed: dict[OffloadKey, str],
    ) -> dict[int, list[OffloadKey]]:
        """Where the keys faulted stripes failed go next: the keys a faulted stripe
        holds after all (written as its deadline passed) stay there and count as
        stored; the rest go to the stripes that have not failed this job (`avoid`),
        while time is left."""
        if not faulted or anyio.current_time() >= deadline:
            return {}
        retry: list[OffloadKey] = []
        for i, keys in faulted.items():
            try:
                held = await self.stripes[i].lookup(keys, job.ctx)
            except TierUnavailable:
                held = [False] * len(keys)
            for key, there in zip(keys, held):
                if there:
                    failed.pop(key, None)
                else:
                    retry.append(key)
        plan = self._place(retry, avoid)
        for i, keys in plan.items():
            for key in keys:
                self._place_at(key, i, placed)
        if plan:
            logger.info(
                "nvme tier: job %d: %d blocks a failing directory did not store go to "
                "the other directories",
                job.job_id,
                len(retry),
            )
        return plan

    def _place(self, keys: Sequence[OffloadKey], avoid: set[int]) -> dict[int, list[OffloadKey]]:
        """Choose a stripe for each new key (the module docstring's rule), among the
        writable stripes not in `avoid` (all not in `avoid` when none is writable).
        No await: the stripes' rooms and candidates are read as they are now."""
        usable = self._writable(avoid)
        if not usable or not keys:
            return {}
        n = len(self.stripes)
        free = {i: self.stripes[i].room().free_blocks for i in usable}
        victims: Iterator[tuple[int, int, OffloadKey]] | None = None
        plan: dict[int, list[OffloadKey]] = {}
        for key in keys:
            h = stripe_hash(key)
            home = h % n
            target: int | None = home if free.get(home, 0) > 0 else None
            if target is None:  # another stripe with room, from a second draw
                start = (h // n) % len(usable)
                for j in range(len(usable)):
                    if free[usable[(start + j) % len(usable)]] > 0:
                        target = usable[(start + j) % len(usable)]
                        break
            if target is not None:
                free[target] -= 1
            else:  # no room anywhere: the stripe of the tier's least recently used block
                if victims is None:
                    victims = self._victims(usable)
                victim = next(victims, None)
                target = victim[1] if victim is not None else (home if home in free else usable[0])
            plan.setdefault(target, []).append(key)
        return plan

    def _victims(self, stripes: Sequence[int]) -> Iterator[tuple[int, int, OffloadKey]]:
        """(stamp, stripe, key) of the eviction candidates of `stripes`, merged oldest
        first. Lazy over the stripes' indexes: drop it before any await."""
        stamps = self._stamps

        def stamped(i: int) -> Iterator[tuple[int, int, OffloadKey]]:
            for key in self.stripes[i].eviction_candidates():
                yield stamps.get(key, 0), i, key

        return heapq.merge(*(stamped(i) for i in stripes))

    def _writable(self, avoid: set[int]) -> list[int]:
        now = time.monotonic()
        others = [i for i in range(len(self.stripes)) if i not in avoid]
        return [i for i in others if self._failing_until[i] <= now] or others

    def _place_at(self, key: OffloadKey, stripe: int, placed: list[OffloadKey]) -> None:
        """`key` is being stored on `stripe` by one more job."""
        _, jobs = self._placing.get(key, (stripe, 0))
        self._placing[key] = (stripe, jobs + 1)
        placed.append(key)

    def _unplace(self, placed: Sequence[OffloadKey]) -> None:
        for key in placed:
            stripe, jobs = self._placing[key]
            if jobs > 1:
                self._placing[key] = (stripe, jobs - 1)
            else:
                del self._placing[key]

    # -- faults -------------------------------------------------------------------
    def _fault_of(self, outcome: JobResult | Exception | None) -> str | None:
        """Why a stripe itself failed its part of a store, or None (it did not, or
        only for reasons every stripe would share)."""
        if outcome is None:  # cancelled at the deadline of a second try
            return _LATE.format(self.config.job_timeout)
        if isinstance(outcome, Exception):
            return str(outcome) or type(outcome).__name__
        error = outcome.error
        if outcome.failed_keys and error and any(mark in error for mark in _FAULTS):
            return error
        return None

    def _mark_failing(self, i: int, why: str) -> None:
        was = self._failing_until[i] > time.monotonic()
        self._failing_until[i] = time.monotonic() + float(self.config.recovery_after)
        self._failing_why[i] = why
        if not was:
            logger.warning(
                "nvme tier: directory %s failed stores (%s); new blocks go to the other "
                "directories for %gs, then it is tried again",
                self.stripes[i].config.path,
                why,
                float(self.config.recovery_after),
            )

    def _mark_writable(self, i: int) -> None:
        self._failing_until[i] = 0.0
        self._failing_why[i] = None
        logger.info("nvme tier: directory %s stores again", self.stripes[i].config.path)

    # -- helpers ------------------------------------------------------------------
    async def _holders(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[int | None]:
        """The stripe holding each key, or None. A stripe that cannot answer (its
        directory vanished and cannot be made again) holds nothing; when none can,
        the first one's TierUnavailable is raised."""
        self._check_open()
        holders: list[int | None] = [None] * len(keys)
        errors: list[TierUnavailable] = []
        for i, stripe in enumerate(self.stripes):
            try:
                held = await stripe.lookup(keys, ctx)
            except TierUnavailable as exc:
                errors.append(exc)
                self._mark_failing(i, str(exc))
                continue
            for at, there in enumerate(held):
                if there and holders[at] is None:
                    holders[at] = i
        if len(errors) == len(self.stripes):
            raise errors[0]
        return holders

    async def _run(
        self,
        plan: dict[int, list[tuple[OffloadKey, int]]],
        job: JobMetadata,
        verb: str,
        results: dict[int, JobResult | Exception],
    ) -> None:
        """Each stripe's part of `job` (`plan`), at once; each outcome into `results`
        as it comes (a part cancelled before it ends has none)."""

        async def part(i: int, pairs: list[tuple[OffloadKey, int]]) -> None:
            sub = JobMetadata(
                job.job_id, tuple(k for k, _ in pairs), tuple(s for _, s in pairs), job.ctx
            )
            stripe = self.stripes[i]
            try:
                if verb == "store":
                    results[i] = await stripe.store(sub)
                else:
                    results[i] = await stripe.load(sub)
            except TierUnavailable as exc:
                results[i] = exc
            except Exception as exc:  # a bug must fail its keys, not the whole job
                logger.exception("nvme tier: %s on %s failed", verb, stripe.config.path)
                results[i] = exc

        if len(plan) == 1:
            [(i, pairs)] = plan.items()
            await part(i, pairs)
            return
        async with anyio.create_task_group() as tg:
            for i, pairs in plan.items():
                tg.start_soon(part, i, pairs)

    def _failures(
        self,
        pairs: Sequence[tuple[OffloadKey, int]],
        outcome: JobResult | Exception | None,
    ) -> dict[OffloadKey, str]:
        """The keys of one stripe's part that failed, with the stripe's reason."""
        if outcome is None:
            return {key: _LATE.format(self.config.job_timeout) for key, _ in pairs}
        if isinstance(outcome, Exception):
            why = str(outcome) or type(outcome).__name__
            return {key: why for key, _ in pairs}
        why = outcome.error or "failed"
        return {key: why for key in outcome.failed_keys}

    def _removed(self, keys: tuple[OffloadKey, ...]) -> None:
        """A stripe's report of blocks gone: no longer stamped, reported by this tier."""
        stamps = self._stamps
        for key in keys:
            stamps.pop(key, None)
        self.report_removed(keys)
