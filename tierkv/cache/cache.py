"""`TieredCache`: the asyncio component an inference server embeds.

    async with TieredCache.from_yaml("tiers.yaml") as cache:
        hit = await cache.lookup(keys_per_group, ctx)
        await cache.store(keys, source_blocks)
        result = await cache.load(hit.keys_to_load, destination_blocks, ctx)

The facade over the parts of `tierkv.cache`: lookup (`lookup.py`), store and cascade
(`cascade.py`), promotion (`promotion.py`), write-back (`writeback.py`), all sharing
one `CacheCore` (primary, tier handles, the per-key index, events, background task
group). Nothing a tier does raises into the caller: failures, timeouts and open
circuit breakers become misses and failed keys, which the server recomputes. Every
background job belongs to the cache's task group, so `close()` leaves nothing running.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from types import TracebackType

import anyio

from tierkv.cache.cascade import Cascader
from tierkv.cache.core import CacheCore
from tierkv.cache.isolation import Isolation, TenantCall
from tierkv.cache.lookup import Lookup
from tierkv.cache.prefetch import Prefetch, PrefetchPolicy
from tierkv.cache.promotion import Promoter
from tierkv.cache.results import (
    CacheStats,
    LoadResult,
    LookupResult,
    StoreResult,
    served_after_load,
)
from tierkv.cache.writeback import WriteBack
from tierkv.config import CacheConfig, load_config
from tierkv.contract.events import OffloadingEvent
from tierkv.contract.jobs import ReqContext
from tierkv.contract.keys import OffloadKey
from tierkv.contract.tier import SecondaryTierManager
from tierkv.driver import GuardedTier
from tierkv.primary import PrimaryTier

logger = logging.getLogger(__name__)

_DEFAULT_CTX = ReqContext()


class TieredCache(AbstractAsyncContextManager["TieredCache"]):
    """The primary tier plus a chain of secondary tiers, driven from one event loop.

    Use `async with` (or `open()` and `close()`, which may run in different tasks).
    """

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.primary = PrimaryTier.from_config(config.primary, config.layout, config.namespace)
        self.block_bytes = self.primary.view.block_bytes
        handles = [
            GuardedTier.create(
                tier_config, self.primary.view, index=i, name=name, on_removed=self._on_removed
            )
            for i, (name, tier_config) in enumerate(zip(config.tier_names(), config.tiers))
        ]
        self.core = CacheCore(config, self.primary, handles)
        self.index = self.core.index
        self.writeback = WriteBack(self.core)
        self.cascader = Cascader(self.core, self.writeback)
        self._lookup = Lookup(self.core, self.cascader.count_hits)
        self.promoter = Promoter(self.core, self._lookup)
        # isolation (tenants.isolate): tenants' keys their own; None: off, costs nothing
        self._isolation = Isolation(self.index.limit) if config.tenants.isolate else None

    @classmethod
    def from_yaml(cls, path: str | Path) -> TieredCache:
        """A cache for the YAML chain at `path` (not yet open)."""
        return cls(load_config(path))

    # -- life cycle ---------------------------------------------------------------------
    @property
    def tier_names(self) -> list[str]:
        return [h.name for h in self.core.tiers]

    def tier(self, name: str) -> SecondaryTierManager:
        """The secondary tier called `name` (its type, or `type-i` when repeated)."""
        for handle in self.core.tiers:
            if handle.name == name:
                return handle.tier
        raise KeyError(f"no tier named {name!r}; tiers: {', '.join(self.tier_names) or 'none'}")

    def _on_removed(self, handle: GuardedTier, keys: tuple[OffloadKey, ...]) -> None:
        """A tier reported blocks it no longer holds: forget them there, tell the
        event stream (after the primary's own events)."""
        for key in keys:
            self.core.index.note_missing(key, handle.index)
        self.core.emit_tier(handle, keys, removed=True)

    @property
    def is_open(self) -> bool:
        return self.core.is_open

    async def open(self) -> None:
        """Open every tier (in chain order) and start background work."""
        core = self.core
        if core.tg is not None:
            raise RuntimeError("the cache is already open")
        try:
            for handle in core.tiers:
                await handle.open()  # a required tier that fails raises TierUnavailable
        except BaseException:
            with anyio.CancelScope(shield=True):
                for handle in reversed(core.tiers):
                    await handle.close()
            raise
        await core.start()
        tg = core.check_open()
        if self.writeback.enabled:
            tg.start_soon(self.writeback.run)
        for handle in core.tiers:
            if not handle.opened:  # optional and down: skipped until it opens
                tg.start_soon(handle.keep_opening)

    async def close(self) -> None:
        """Let background jobs finish (up to `close_timeout`, flushing write-back
        blocks), cancel what is left, and close every tier."""
        core = self.core
        if core.tg is None or core.closing:
            return
        core.closing = True  # no new work; what runs may finish
        try:
            with anyio.move_on_after(self.config.close_timeout, shield=True):
                await self.flush()
                await core.abandoned_ended()  # tier jobs left running give slots back
        finally:
            with anyio.CancelScope(shield=True):
                await core.stop()
                core.claims.let_go_all()
                self.writeback.drop_unwritten()
                for handle in core.tiers:
                    await handle.close()
                self.primary.memory.close()  # unregisters the pinned slab (CUDA)

    async def __aenter__(self) -> TieredCache:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def flush(self) -> None:
        """Wait until every background cascade and promotion has finished, and offer
        every pending write-back block to its tiers once more (blocks whose write-back
        fails stay dirty in the primary for the next attempt)."""
        core = self.core
        await self.writeback.flush()
        while core.background:
            await core.idle.wait()

    # -- events and stats ---------------------------------------------------------------
    def take_events(self) -> list[OffloadingEvent]:
        """Stored/removed events of every medium since the last call, in order (the
        primary's first). The newest 65,536 are kept; `stats().primary["events_dropped"]`
        counts the rest. Under `tenants.isolate` they name the callers' keys
        (`tierkv.cache.isolation`)."""
        events = self.core.events.take()
        return events if self._isolation is None else self._isolation.events(events)  # isolation

    def stats(self) -> CacheStats:
        core = self.core
        core.claims.sweep()  # claims whose lease ran out count as lease_expired now
        primary = core.primary_stats.snapshot()
        primary.update(
            blocks=self.primary.num_blocks,
            pinned_bytes=self.primary.memory.pinned_bytes,
            resident=len(self.primary),
            free=self.primary.num_free,
            evictable=self.primary.num_evictable,
            promoting=self.primary.num_staged,
            write_back_pending=core.index.dirty_count,
            events_dropped=core.events.dropped,
            room_wakeups=self.primary.wakeups,
            background_jobs=core.background,
            indexed_keys=len(core.index),
            **core.counters.as_dict(),
        )
        tiers = {}
        for handle in core.tiers:
            handle.refresh_stats()
            handle.stats.foreign_blocks = getattr(handle.tier, "foreign_blocks", 0)
            tiers[handle.name] = handle.stats.snapshot()
        return CacheStats(primary, tiers, core.tenant_report())

    # -- the three calls ----------------------------------------------------------------
    def _tenant_call(self, ctx: ReqContext | None) -> TenantCall | None:
        """Isolation hook: the call of an isolated tenant (its keys in, the caller's
        out); None, and keys as given, without `tenants.isolate` or for the default."""
        return None if self._isolation is None else self._isolation.call(ctx)

    async def lookup(
        self,
        keys_per_group: Sequence[Sequence[OffloadKey]],
        ctx: ReqContext | None = None,
        *,
        gpu_tokens: int = 0,
    ) -> LookupResult:
        """The longest prefix the cache can serve, and where its blocks live.

        `keys_per_group[g]` are the request's block keys of group `g`, in order;
        `gpu_tokens` is how many leading tokens the GPU already holds (their blocks
        count as present and are neither asked about nor listed to load). The primary
        answers first; the tiers are asked concurrently, once each, only about keys
        the primary lacks, under `lookup_timeout`. With `ctx.request_id`, the hit's
        blocks in tiers that protect claims are kept from those tiers' eviction until
        the request's `load` ends, `end_request`, or `claim_lease` runs out (a
        request's next lookup replaces its claims); primary slots are reserved by
        `load`, not here.
        """
        self.core.check_open()
        ctx = ctx or _DEFAULT_CTX
        if (call := self._tenant_call(ctx)) is not None:  # isolation
            hit = await self._lookup.lookup(call.groups(keys_per_group), ctx, gpu_tokens)
            return call.lookup_result(hit)
        return await self._lookup.lookup(keys_per_group, ctx, gpu_tokens)

    async def store(
        self,
        keys: Sequence[OffloadKey],
        source: object,
        *,
        positions: Sequence[int] | None = None,
        end_tokens: int | None = None,
        ctx: ReqContext | None = None,
    ) -> StoreResult:
        """Copy blocks into the chain: into the primary, streaming through it to the
        write-through tiers when it cannot keep them all.

        `source` holds one block per key: a `BlockSource` (e.g. `KVCacheBlocks`), a
        `[n, block_bytes]` uint8 CPU tensor, or a sequence of buffers. The whole
        request is checked before anything changes. Returns when every block is
        resident or accepted by a tier, or reports the rest rejected with a reason.

        `positions[i]` (optional) is the block index of `keys[i]` in its group: with
        it, sliding-window and state blocks that no hit at a checkpoint can use are
        left out (`StoreResult.skipped`; `tierkv.retention`). `end_tokens` is the
        request length this store completes (a checkpoint); None: the end of what
        `keys` hold; 0 for a store in the middle of a request.

        `ctx` says whose store it is: its tenant is counted (`stats().tenants`) and
        owns the blocks it places in the primary, and the tier jobs its cascades
        start carry it.
        """
        if (call := self._tenant_call(ctx)) is not None:  # isolation
            stored = await self.cascader.store(call.keys(keys), source, positions, end_tokens, ctx)
            return call.store_result(stored)
        return await self.cascader.store(keys, source, positions, end_tokens, ctx)

    def usable_tokens(self, hit: LookupResult, loaded: LoadResult) -> int:
        """How many tokens a request may reuse after loading `hit.keys_to_load` gave
        `loaded`: `hit.hit_tokens` when every key loaded, else the longest length
        every group can serve from the blocks that did load (and those the GPU holds).
        For a sliding-window or state group that can be far shorter than the first
        failed block: a window with a hole, or a state that did not arrive, serves
        nothing at its hit point."""
        return served_after_load(self.config.layout.groups, hit, loaded.ok_keys)

    async def load(
        self, keys: Sequence[OffloadKey], destination: object, ctx: ReqContext | None = None
    ) -> LoadResult:
        """Copy the blocks of `keys` into `destination`, promoting from lower tiers.

        `destination` holds one writable block per key: a `BlockDestination`, a
        `[n, block_bytes]` uint8 CPU tensor or a sequence of writable buffers. Keys
        that cannot be served are reported failed with a reason; nothing raises for
        a tier's failure.
        """
        ctx = ctx or _DEFAULT_CTX
        if (call := self._tenant_call(ctx)) is not None:  # isolation
            return call.load_result(await self.promoter.load(call.keys(keys), destination, ctx))
        return await self.promoter.load(keys, destination, ctx)

    def prefetch(
        self,
        keys_per_group: Sequence[Sequence[OffloadKey]] | LookupResult,
        ctx: ReqContext,
        *,
        policy: PrefetchPolicy = "best_effort",
        timeout: float | None = None,
    ) -> Prefetch:
        """Start promoting a queued request's blocks into the primary; return at once.

        `keys_per_group` as for `lookup` (the tiers are asked in the background about
        keys the cache cannot place, and only the hit every group can serve is
        prefetched), or the request's `LookupResult`. `ctx.request_id` is required:
        the request's `load` (same id) takes over what the prefetch promoted (landed
        blocks are primary hits, windows still reading are joined) and releases the
        rest, as `cancel_prefetch(request_id)` does for a request that ends without
        loading. Stage 1 only: blocks land in the primary and are held there (not
        evictable) until released. Prefetches together hold at most `prefetch_share`
        of the promotion reserve and start nothing while a load waits for room; with
        no room, `policy="best_effort"` stops (the rest is shed) and `policy="wait"`
        looks again for up to `timeout` seconds in all. Bad arguments raise
        `ValueError`; a tier's failure never raises (the load falls back as usual).
        """
        if (call := self._tenant_call(ctx)) is not None:  # isolation
            source = call.source(keys_per_group)
            return call.prefetch(self.promoter.prefetches.start(source, ctx, policy, timeout))
        return self.promoter.prefetches.start(keys_per_group, ctx, policy, timeout)

    def cancel_prefetch(self, request: ReqContext | str) -> int:
        """Release the prefetches of a request (its `ReqContext` or request id) that
        ends without loading: held blocks become ordinary evictable primary blocks; a
        window still reading finishes and its blocks land evictable. Returns how many
        prefetches it released (0 when none is running or held for the request)."""
        request_id = request.request_id if isinstance(request, ReqContext) else request
        if request_id is None:
            return 0
        return self.promoter.prefetches.cancel(request_id)

    def end_request(self, request: ReqContext | str) -> None:
        """The request (its `ReqContext` or request id) is done or abandoned: its
        prefetches are released (`cancel_prefetch`) and the claims its lookups took
        end, so the blocks they kept from the tiers' eviction are evictable again. A
        request whose load ran needs no call for its claims (the load ended them);
        one that never loads would otherwise hold them until `claim_lease` runs out."""
        request_id = request.request_id if isinstance(request, ReqContext) else request
        if request_id is None:
            return
        self.promoter.prefetches.cancel(request_id)
        self.core.claims.let_go(request_id)
