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

The store itself runs as a `StoreRun` (`tierkv.cache.store_run`), one state object per
call; this module keeps the cascades every store, hit count and sighting starts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from itertools import islice

from tierkv.cache.core import CacheCore
from tierkv.cache.results import StoreResult
from tierkv.cache.store_run import StoreRun, StoreWatch
from tierkv.cache.validate import check_keys, checked_source, run_validate_hook
from tierkv.cache.writeback import WriteBack
from tierkv.contract.jobs import JobMetadata, ReqContext
from tierkv.contract.keys import OffloadKey
from tierkv.driver import GuardedTier
from tierkv.driver.guarded import AbandonedJob
from tierkv.policies.adaptive import AdaptiveAdmission
from tierkv.policies.admission import AGING_PER_BLOCK, ReuseAdmission
from tierkv.retention import kept_blocks

logger = logging.getLogger(__name__)

_NO_CTX = ReqContext()


class Cascader:
    def __init__(self, core: CacheCore, writeback: WriteBack) -> None:
        self.core = core
        self.writeback = writeback
        self.selective = [h for h in core.tiers if h.policy == "write_through_selective"]
        # write-through tiers that take only blocks likely to be read again: by the
        # reuse rule, or (tinylfu) weighed against the block the tier would evict for
        # them, or (adaptive) tinylfu or every block as the shadows' duel says; a tier
        # that cannot name that block gets the reuse rule (adaptive: or every block)
        self.reuse = [h for h in core.tiers if h.config.admission != "all"]
        self.relative = [
            h
            for h in self.reuse
            if h.config.admission in ("tinylfu", "adaptive") and h.tier.names_eviction_candidates
        ]
        self.adaptive = {h.index for h in self.reuse if h.config.admission == "adaptive"}
        self.admission: ReuseAdmission | None = None
        if self.adaptive:
            self.admission = AdaptiveAdmission()
        elif self.reuse:
            self.admission = ReuseAdmission()
        self._aged_for_tiers = False
        # a block admission declines may be evicted by its own streaming store only
        # when no write-through tier takes every block (those decide its safety)
        self._declines_free = all(
            h.config.admission != "all" for h in core.tiers if h.policy == "write_through"
        )

    # -- cascades ----------------------------------------------------------------------
    def after_store(
        self,
        keys: Sequence[OffloadKey],
        watch: StoreWatch | None = None,
        ctx: ReqContext | None = None,
    ) -> None:
        """Send freshly stored `keys` on, per each tier's write policy (the tier jobs
        carry the store's `ctx`)."""
        if not keys:
            return
        index = self.core.index
        verdicts: dict[int, list[bool]] = {}  # per admitting tier: write each key?
        reuse_verdicts: list[bool] | None = None
        for handle in self.reuse:
            if handle in self.relative:
                try:
                    verdicts[handle.index] = self._weighed(
                        handle, keys, None if ctx is None else ctx.tenant
                    )
                    continue
                except Exception:  # a plugin's room() or candidates failed: reuse rule
                    logger.warning(
                        "tier %s could not name its eviction candidates; its tinylfu "
                        "admission uses the reuse rule from now on",
                        handle.name,
                        exc_info=True,
                    )
                    self.relative.remove(handle)
            if handle.index in self.adaptive:
                assert isinstance(self.admission, AdaptiveAdmission)
                verdicts[handle.index] = self.admission.admits_adaptive_blind(keys)
                continue
            if reuse_verdicts is None:
                assert self.admission is not None
                reuse_verdicts = self.admission.admits(keys)
            verdicts[handle.index] = reuse_verdicts
        if verdicts and watch is not None and self._declines_free:
            # kept out of every admitting tier on purpose: held only to make the store
            # reject would be worse (they were judged not worth keeping)
            taken = [any(v) for v in zip(*verdicts.values())]
            if not all(taken):
                watch.declined(k for k, ok in zip(keys, taken) if not ok)
        for handle in self.core.tiers:
            if handle.policy == "write_through":
                mine = verdicts.get(handle.index)
                if mine is not None:
                    admitted = [k for k, ok in zip(keys, mine) if ok]
                    handle.stats.declined += len(keys) - len(admitted)
                    if admitted:
                        self.cascade(handle, admitted, watch, ctx)
                    continue
                self.cascade(handle, keys, watch, ctx)
            elif handle.policy == "write_through_selective":
                need = handle.config.min_hits
                chosen = index.with_hits(keys, need)
                if chosen:
                    self.cascade(handle, chosen, watch, ctx)
        self.writeback.admit(keys)

    def _weighed(
        self, handle: GuardedTier, keys: Sequence[OffloadKey], tenant: str | None = None
    ) -> list[bool]:
        """The tinylfu verdicts of `handle`'s tier on `keys`: its room less the blocks
        already on their way to it, then each key against the candidate it would
        displace (candidates the writes in flight will displace are skipped). On a
        tier with tenant quotas, the room and the candidates are the store's tenant's
        (`tierkv.quotas.tiers`): each key is weighed against the block the quota would
        give way for it, and keys the quota would decline are declined here."""
        admission, core = self.admission, self.core
        assert admission is not None
        tier = handle.tier
        if not self._aged_for_tiers:  # rooms are known once the tiers are open
            self._aged_for_tiers = True
            sizes: dict[int, int] = {}
            for other in self.relative:
                try:
                    sizes[other.index] = other.tier.room().capacity_blocks
                except Exception:  # its own decision, next, says so and falls back
                    continue
            if sizes:
                admission.age_every(AGING_PER_BLOCK * max(sizes.values()))
            adaptive = [size for i, size in sizes.items() if i in self.adaptive]
            if adaptive:  # the shadows model the largest adaptive tier
                assert isinstance(admission, AdaptiveAdmission)
                admission.size_for(max(adaptive), core.primary.num_blocks)
        room = tier.room()
        pending = -(-handle.stats.inflight_bytes // core.block_bytes)
        candidates: Iterator[OffloadKey]
        if handle.quotas is not None and handle.quotas.enforced:
            plan = handle.quotas.plan(keys, tenant, pending, reserve=False)
            free = len(keys) - len(plan.victims) - len(plan.declined)
            candidates = iter(plan.victims)
        else:
            candidates = islice(
                tier.eviction_candidates(), max(0, pending - room.free_blocks), None
            )
            free = room.free_blocks - pending
        if handle.index in self.adaptive:
            assert isinstance(admission, AdaptiveAdmission)
            return admission.admits_adaptive(keys, free, candidates, core.primary.is_ready)
        return admission.admits_against(keys, free, candidates, core.primary.is_ready)

    def cascade(
        self,
        handle: GuardedTier,
        keys: Sequence[OffloadKey],
        watch: StoreWatch | None = None,
        ctx: ReqContext | None = None,
    ) -> None:
        """Send `keys` (ready in the primary) to `handle` in the background, or drop
        them (tier down, or too far behind). The job carries `ctx`: the store's, or
        none (a batch of several requests' blocks)."""
        core = self.core
        if not core.is_open:
            return
        nbytes = len(keys) * core.block_bytes
        refused = handle.admit("store", len(keys), nbytes)
        if refused is not None:
            if refused == "max_inflight":
                logger.debug(
                    "tier %s is behind: dropped a cascade of %d blocks", handle.name, len(keys)
                )
            return
        try:
            slots = core.primary.prepare_load(keys)  # protected until the tier answers
        except BaseException:
            handle.withdraw("store", nbytes)
            raise
        core.index.add_cascading(keys, 1)
        if watch is not None:
            watch.sent(keys)
        job = JobMetadata(core.next_job_id(), tuple(keys), tuple(slots), ctx or _NO_CTX)
        core.spawn(self._cascade_job, handle, job, nbytes, watch)

    async def _cascade_job(
        self, handle: GuardedTier, job: JobMetadata, nbytes: int, watch: StoreWatch | None
    ) -> None:
        core = self.core
        ok_keys: Sequence[OffloadKey] = ()
        abandoned: AbandonedJob | None = None
        try:
            outcome = await handle.run("store", job, admitted=True, abandon=True)
            abandoned = outcome.abandoned
            ok_keys = outcome.result.ok_keys
            if outcome.declined:  # a tenant quota kept them out (tierkv.quotas.tiers)
                core.tenants.declined(job.ctx.tenant, len(outcome.declined))
                if watch is not None:  # on purpose: evictable like admission's declines
                    watch.declined(outcome.declined)
        finally:
            if abandoned is None:
                handle.release("store", nbytes)
                core.primary.complete_load(job.keys)
            else:  # the tier may still read the slots: they stay read until it ends

                def release() -> None:
                    handle.release("store", nbytes)
                    core.primary.complete_load(job.keys)

                core.hold_until_ended(abandoned, release)
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
    async def store(
        self,
        keys: Sequence[OffloadKey],
        source: object,
        positions: Sequence[int] | None = None,
        end_tokens: int | None = None,
        ctx: ReqContext | None = None,
    ) -> StoreResult:
        """Check the whole request before anything changes, then run it (`StoreRun`)."""
        core = self.core
        core.check_open()
        keys = list(keys)
        check_keys(keys, "keys")
        src = checked_source(source, len(keys), core.block_bytes)
        position, skipped = self._positions(keys, positions, end_tokens)
        run = StoreRun(core, self.writeback, self, position, skipped, ctx)
        if hasattr(src, "validate"):  # e.g. KVCacheBlocks: GPU block ids, coverage
            run_validate_hook(src, "store", [position[k] for k in run.new], core.primary.view)
        return await run.run(src)

    def _positions(
        self, keys: list[OffloadKey], positions: Sequence[int] | None, end_tokens: int | None
    ) -> tuple[dict[OffloadKey, int], list[OffloadKey]]:
        """Each key to store -> its index in the source (a key given twice: its first),
        and the keys left out because no hit at a checkpoint can use them."""
        skipped: list[OffloadKey] = []
        if positions is None:
            position = {key: i for i, key in enumerate(keys)}
        else:  # blocks no hit at a checkpoint can use are not stored (tierkv.retention)
            keep = kept_blocks(self.core.config.layout, keys, positions, end_tokens)
            position = {key: i for i, (key, ok) in enumerate(zip(keys, keep)) if ok}
            skipped = [key for key, ok in zip(keys, keep) if not ok]
        if len(position) + len(skipped) != len(keys):  # rare: a key twice; its first place counts
            position, left_out = {}, set(skipped)
            for i, key in enumerate(keys):
                if key not in left_out:
                    position.setdefault(key, i)
        return position, skipped
