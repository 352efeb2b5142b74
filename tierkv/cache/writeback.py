"""Write-back: blocks reach write-back tiers only when they must leave the primary.

A stored block becomes *dirty* for every write-back tier. Dirty blocks stay in the
eviction policy's order like any other block, but nothing frees them: when the
policy's next victims are dirty (a store or promotion needs their room, or clean
room falls below `write_back_headroom`), they are written back, then become clean
victims. The dirty set is bounded (`write_back_max_dirty`): past the bound the oldest
dirty blocks are written back even without pressure; while a write-back tier is down
(breaker open or half-open, not open yet) blocks past the bound are dropped for it and counted, so
the cache keeps caching; whenever room is needed (a store finds only dirty victims, or
clean room falls below the headroom) the victims' write-backs to a down tier are dropped
and counted, at any bound. A block a tier keeps failing is given up after
`DEMOTE_ATTEMPTS` and counted too. The background loop takes its batches from the
oldest dirty keys without copying the dirty set (O(batch) per batch).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import anyio

from tierkv.cache.core import CacheCore
from tierkv.contract.jobs import JobMetadata
from tierkv.contract.keys import OffloadKey
from tierkv.driver import GuardedTier
from tierkv.driver.guarded import AbandonedJob

logger = logging.getLogger(__name__)

DEMOTE_BATCH = 64
DEMOTE_ATTEMPTS = 3  # failed write-backs of a block to one tier before it is given up


class WriteBack:
    def __init__(self, core: CacheCore) -> None:
        self.core = core
        self.handles = [h for h in core.tiers if h.policy == "write_back"]
        self.mask = sum(h.bit for h in self.handles)
        n = core.primary.num_blocks
        self.bound = max(1, int(core.config.write_back_max_dirty * n))
        self.headroom = int(core.config.write_back_headroom * n)
        self.demoting: set[OffloadKey] = set()
        self._wakeup = anyio.Event()

    @property
    def enabled(self) -> bool:
        return bool(self.handles)

    def wake(self) -> None:
        self._wakeup.set()

    def _drop(self, key: OffloadKey, handle: GuardedTier, why: str) -> None:
        self.core.index.clean(key, handle.index)
        handle.stats.drops += 1
        self.core.counters.write_back_dropped += 1
        logger.debug("dropped a write-back block for tier %s: %s", handle.name, why)

    def admit(self, keys: Sequence[OffloadKey]) -> None:
        """Newly stored `keys` become dirty for the write-back tiers (past the bound,
        not for a tier that is down)."""
        if not self.handles:
            return
        index = self.core.index
        down = [h for h in self.handles if not h.healthy("store")]
        for key in keys:
            tiers = self.mask
            if down and index.dirty_count >= self.bound:
                for handle in down:
                    tiers &= ~handle.bit
                    handle.stats.drops += 1
                    self.core.counters.write_back_dropped += 1
            if tiers:
                index.mark_dirty(key, tiers)
        self.wake()

    def _clean_room(self) -> int:
        p = self.core.primary
        return p.num_free + p.num_evictable - self.core.index.dirty_count

    def _dirty_victim(self, key: OffloadKey) -> bool:
        return self.core.index.is_dirty(key) and key not in self.demoting

    async def make_room(self, wanted: int) -> bool:
        """Write back the dirty blocks among the next `wanted` victims, and drop what
        they still owe a tier that is down (their room is needed now, whatever
        `write_back_max_dirty` says); True when at least one became clean so a retry
        may find room. Blocks owed to a healthy tier are never dropped here."""
        victims = self.core.primary.candidates(min(wanted, DEMOTE_BATCH), self._dirty_victim)
        if not victims:
            return False
        before = self.core.index.dirty_count
        await self.demote(victims)
        self._drop_for_down_tiers(victims, force=True)
        return self.core.index.dirty_count < before

    def _drop_for_down_tiers(self, keys: Sequence[OffloadKey], *, force: bool) -> int:
        """Drop pending write-backs of `keys` to tiers that are down: all of them with
        `force` (their room is needed now), else only past the bound."""
        index = self.core.index
        dropped = 0
        for key in keys:
            if not force and index.dirty_count <= self.bound:
                break
            for handle in self.handles:
                if index.pending_for(key, handle.index) and not handle.healthy("store"):
                    self._drop(key, handle, "tier down and the dirty set is full")
                    dropped += 1
        return dropped

    async def run(self) -> None:
        """Background loop: keep the dirty set within its bound and clean room above
        the headroom, in the eviction policy's order."""
        index = self.core.index
        while True:
            await self._wakeup.wait()
            self._wakeup = anyio.Event()
            try:
                while True:
                    excess = index.dirty_count - self.bound
                    if excess > 0:  # the oldest first, walking only one batch far
                        batch = index.oldest_dirty(min(excess, DEMOTE_BATCH), self.demoting)
                        cleaned = await self.demote(batch) if batch else 0
                        dropped = self._drop_for_down_tiers(batch, force=False)
                        if not cleaned and not dropped:
                            break
                    elif index.dirty_count and self._clean_room() <= self.headroom:
                        want = max(1, min(self.headroom - self._clean_room() + 1, DEMOTE_BATCH))
                        victims = self.core.primary.candidates(want, self._dirty_victim)
                        if not victims:
                            break
                        cleaned = await self.demote(victims)
                        # clean room is needed: what a down tier is owed is dropped
                        if not cleaned and not self._drop_for_down_tiers(victims, force=True):
                            break
                    else:
                        break
            except Exception:  # our own bug: log it and keep demoting later
                logger.exception("write-back demoter failed")

    async def demote(self, keys: Sequence[OffloadKey]) -> int:
        """Write `keys` to the write-back tiers still missing them (pinned meanwhile).
        Returns how many became clean."""
        core = self.core
        index, primary = core.index, core.primary
        keys = [
            k
            for k in dict.fromkeys(keys)
            if index.is_dirty(k) and k not in self.demoting and primary.is_ready(k)
        ]
        if not keys:
            return 0
        self.demoting.update(keys)
        primary.prepare_load(keys)
        stuck: list[tuple[AbandonedJob, list[OffloadKey]]] = []  # jobs left running
        try:
            async with anyio.create_task_group() as tg:
                for handle in self.handles:
                    mine = [k for k in keys if index.pending_for(k, handle.index)]
                    if mine:
                        tg.start_soon(self._demote_to, handle, mine, stuck)
        finally:
            self.demoting.difference_update(keys)
            self._release(keys, stuck)
            core.released.notify()
        return sum(1 for k in keys if index.is_clean(k))

    def _release(
        self, keys: list[OffloadKey], stuck: list[tuple[AbandonedJob, list[OffloadKey]]]
    ) -> None:
        """Drop the readers `demote` took: at once, but for the keys of jobs left
        running in their tier (`stuck`), whose readers stay until every such job of
        theirs has ended (the tier may still read the slots)."""
        primary = self.core.primary
        held = {k for _job, ks in stuck for k in ks}
        primary.complete_load([k for k in keys if k not in held])
        if not held:
            return
        waiting = [len(stuck)]
        later = [k for k in keys if k in held]

        def one_ended() -> None:
            waiting[0] -= 1
            if waiting[0] == 0:
                primary.complete_load(later)
                self.core.released.notify()

        for job, _ks in stuck:
            self.core.hold_until_ended(job, one_ended)

    async def _demote_to(
        self,
        handle: GuardedTier,
        keys: list[OffloadKey],
        stuck: list[tuple[AbandonedJob, list[OffloadKey]]],
    ) -> None:
        """One write-back job. A tier that is down costs no attempt. A job left
        running at its deadline goes to `stuck`; its keys stay dirty."""
        core = self.core
        if not handle.usable("store"):
            handle.stats.skipped_unhealthy += len(keys)
            return
        slots = [core.primary.slot_of(k) for k in keys]
        job = JobMetadata(core.next_job_id(), tuple(keys), tuple(s for s in slots if s is not None))
        # takes the permit (the probe) itself
        outcome = await handle.run("store", job, abandon=True)
        if outcome.abandoned is not None:
            stuck.append((outcome.abandoned, list(job.keys)))
        if outcome.failure == "refused":  # another call took the probe first: no attempt
            return
        result = outcome.result
        index = core.index
        index.note_held(result.ok_keys, handle.index)
        core.emit_tier(handle, result.ok_keys, removed=False)
        ok = set(result.ok_keys)
        for key in keys:
            if key in ok:
                index.clean(key, handle.index)
                continue
            if index.failed_write_back(key, handle.index) >= DEMOTE_ATTEMPTS:
                self._drop(key, handle, f"{DEMOTE_ATTEMPTS} failed write-backs")
                logger.warning(
                    "gave up writing a block back to tier %s after %d failures: %s",
                    handle.name,
                    DEMOTE_ATTEMPTS,
                    result.error,
                )

    def drop_unwritten(self) -> int:
        """At close: dirty blocks still unwritten (their tier down or too slow) are no
        longer owed to it; count them as dropped and warn, rather than lose them
        silently. Returns how many blocks were dropped."""
        index = self.core.index
        keys = index.dirty_keys()
        for key in keys:
            for handle in self.handles:
                if index.pending_for(key, handle.index):
                    self._drop(key, handle, "the cache closed before it was written back")
        if keys:
            logger.warning(
                "closed with %d block(s) not written back to their write_back tier "
                "(counted in write_back_dropped)",
                len(keys),
            )
        return len(keys)

    async def flush(self) -> None:
        """Offer every dirty block to its tiers once more."""
        index = self.core.index
        pending = [k for k in index.dirty_keys() if k not in self.demoting]
        for i in range(0, len(pending), DEMOTE_BATCH):
            await self.demote(pending[i : i + DEMOTE_BATCH])
        self._drop_for_down_tiers(index.dirty_keys(), force=False)
        while self.demoting:
            await self.core.released.wait()
