"""`TieredCache`: the asyncio component an inference server embeds.

    async with TieredCache.from_yaml("tiers.yaml") as cache:
        hit = await cache.lookup(keys_per_group, ctx)
        await cache.store(keys, source_blocks)
        result = await cache.load(hit.keys_to_load, destination_blocks, ctx)

Down the chain (cascade): a store lands in the primary slab and returns; copies to the
secondary tiers run in the background per each tier's write policy, with the source
slots protected until every tier answered. Up the chain (promotion): a load of blocks
only a secondary holds reserves primary slots, reads each block from the first tier
that has it (one job per tier), then copies the slots to the caller. Concurrent loads
of one key share one promotion. Nothing a tier does raises into the caller: failures,
timeouts and open circuit breakers become misses and failed keys, which the server
recomputes. Every background job belongs to the cache's task group, so `close()`
leaves nothing running.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Any, Literal

import anyio
from anyio.abc import TaskGroup

from tierkv.blocks import as_destination, as_source
from tierkv.config import CacheConfig, load_config
from tierkv.errors import TierUnavailable
from tierkv.events import OffloadingEvent
from tierkv.health import CircuitBreaker
from tierkv.hits import GroupHit, combine_group_hits
from tierkv.jobs import JobMetadata, JobResult, ReqContext
from tierkv.keys import OffloadKey
from tierkv.primary import MEDIUM as PRIMARY_MEDIUM
from tierkv.primary import PrimaryTier
from tierkv.registry import create_tier
from tierkv.stats import TierStats
from tierkv.tier import SecondaryTierManager, TierConfig

logger = logging.getLogger(__name__)

_DEFAULT_CTX = ReqContext()
_DEMOTE_BATCH = 64
_DEMOTE_ATTEMPTS = 3  # failed demotions of a block to one tier before it is given up
_MAX_EVENTS = 65536  # events kept for take_events(); older ones are dropped and counted


# -- results ---------------------------------------------------------------------------
@dataclass(frozen=True)
class LookupResult:
    """What a lookup found.

    `hit_tokens` is the longest prefix every group can serve. `group_keys[g]` are the
    keys group `g` needs to serve it (every block before the hit for a full-attention
    group; only the window's blocks for a sliding-window group), and `group_ranges[g]`
    their block indices. `locations` says where each needed key lives now: `"cpu"`
    (the primary) or a secondary tier's name.
    """

    hit_tokens: int
    group_keys: tuple[tuple[OffloadKey, ...], ...]
    group_ranges: tuple[GroupHit, ...]
    locations: Mapping[OffloadKey, str]

    @property
    def keys_to_load(self) -> tuple[OffloadKey, ...]:
        """All needed keys, group by group: what to pass to `load`."""
        return tuple(k for keys in self.group_keys for k in keys)

    def count_in(self, medium: str) -> int:
        """How many needed blocks live in `medium` now."""
        return sum(1 for m in self.locations.values() if m == medium)


@dataclass(frozen=True)
class StoreResult:
    """`stored` landed in the primary (and cascade per write policy); `already_present`
    were there before; `rejected` found no room in the primary (nothing changed for
    them; the server may simply not cache them)."""

    stored: tuple[OffloadKey, ...] = ()
    already_present: tuple[OffloadKey, ...] = ()
    rejected: tuple[OffloadKey, ...] = ()
    error: str | None = None

    @property
    def ok(self) -> bool:
        return not self.rejected and self.error is None


@dataclass(frozen=True)
class LoadResult:
    """`ok_keys` are in the destination; `failed_keys` are not (recompute them), with a
    reason each in `errors`. `sources` says which medium served each ok key."""

    ok_keys: tuple[OffloadKey, ...] = ()
    failed_keys: tuple[OffloadKey, ...] = ()
    errors: Mapping[OffloadKey, str] = field(default_factory=lambda: MappingProxyType({}))
    sources: Mapping[OffloadKey, str] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def ok(self) -> bool:
        return not self.failed_keys


@dataclass(frozen=True)
class CacheStats:
    """Counters per medium: `primary` and each secondary tier by name, in chain order."""

    primary: dict[str, Any]
    tiers: dict[str, dict[str, Any]]

    def as_dict(self) -> dict[str, Any]:
        return {"primary": self.primary, "tiers": self.tiers}


# -- internals -------------------------------------------------------------------------
class _BoundedSet:
    """A set that forgets its oldest members past `limit`."""

    def __init__(self, limit: int) -> None:
        self._items: OrderedDict[OffloadKey, None] = OrderedDict()
        self._limit = limit

    def add(self, key: OffloadKey) -> None:
        self._items[key] = None
        self._items.move_to_end(key)
        while len(self._items) > self._limit:
            self._items.popitem(last=False)

    def discard(self, key: OffloadKey) -> None:
        self._items.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._items


@dataclass
class _TierState:
    index: int
    name: str
    tier: SecondaryTierManager
    config: TierConfig
    breaker: CircuitBreaker
    stats: TierStats
    bad_claims: _BoundedSet
    opened: bool = False


@dataclass
class _Flight:
    """One promotion that several loads may wait on (single flight)."""

    done: anyio.Event = field(default_factory=anyio.Event)
    waiters: dict[OffloadKey, int] = field(default_factory=dict)
    outcome: dict[OffloadKey, tuple[str | None, str | None]] = field(default_factory=dict)
    granted: dict[OffloadKey, int] = field(default_factory=dict)  # readers taken for waiters


def _check_keys(keys: Sequence[OffloadKey], what: str) -> None:
    for i, key in enumerate(keys):
        if not isinstance(key, bytes):
            raise ValueError(f"{what}[{i}] must be bytes (an OffloadKey), got {type(key).__name__}")
        if len(key) <= 4:
            raise ValueError(
                f"{what}[{i}] is {len(key)} bytes; an offload key is a block hash plus 4 "
                "group bytes (use make_offload_key)"
            )


class TieredCache(AbstractAsyncContextManager["TieredCache"]):
    """The primary tier plus a chain of secondary tiers, driven from one event loop.

    Use `async with` (or `open()` and `close()` from the same task): the cache owns a
    task group for its background jobs.
    """

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.primary = PrimaryTier.from_config(config.primary, config.layout, config.namespace)
        self.block_bytes = self.primary.view.block_bytes
        self._tiers: list[_TierState] = []
        limit = max(4096, 16 * self.primary.num_blocks)
        for i, (name, tier_config) in enumerate(zip(config.tier_names(), config.tiers)):
            tier = create_tier(tier_config, self.primary.view)
            self._tiers.append(
                _TierState(
                    index=i,
                    name=name,
                    tier=tier,
                    config=tier_config,
                    breaker=CircuitBreaker(
                        name, tier_config.failure_threshold, tier_config.recovery_after
                    ),
                    stats=TierStats(),
                    bad_claims=_BoundedSet(limit),
                )
            )
        self._primary_stats = TierStats()
        self._reserve_slots = max(1, int(config.promotion_reserve * self.primary.num_blocks))
        self._headroom_slots = int(config.write_back_headroom * self.primary.num_blocks)
        self._promoting = 0
        self._flights: dict[OffloadKey, _Flight] = {}
        self._located: OrderedDict[OffloadKey, int] = OrderedDict()
        self._located_limit = limit
        self._hit_counts: OrderedDict[OffloadKey, int] = OrderedDict()
        # write-back: key -> {tier index: failed demotion attempts}, pinned until empty
        self._dirty: OrderedDict[OffloadKey, dict[int, int]] = OrderedDict()
        self._demoting: set[OffloadKey] = set()
        self._events: deque[OffloadingEvent] = deque(maxlen=_MAX_EVENTS)
        self._events_dropped = 0
        self._job_ids = itertools.count(1)
        self._tg: TaskGroup | None = None
        self._background = 0
        self._idle = anyio.Event()
        self._idle.set()
        self._demote_wakeup = anyio.Event()
        self._closing = False
        self._stop = anyio.Event()
        self._supervisor: asyncio.Task[None] | None = None

    @classmethod
    def from_yaml(cls, path: str | Path) -> TieredCache:
        """A cache for the YAML chain at `path` (not yet open)."""
        return cls(load_config(path))

    # -- life cycle ---------------------------------------------------------------------
    @property
    def tier_names(self) -> list[str]:
        return [ts.name for ts in self._tiers]

    def tier(self, name: str) -> SecondaryTierManager:
        """The secondary tier called `name` (its type, or `type-i` when repeated)."""
        for ts in self._tiers:
            if ts.name == name:
                return ts.tier
        raise KeyError(f"no tier named {name!r}; tiers: {', '.join(self.tier_names) or 'none'}")

    async def open(self) -> None:
        """Open every tier (in chain order) and start background work.

        Background jobs run in a task group owned by a supervisor task, so `open()`
        and `close()` may be called from different tasks (a server's startup and
        shutdown hooks)."""
        if self._tg is not None:
            raise RuntimeError("the cache is already open")
        try:
            for ts in self._tiers:
                try:
                    await ts.tier.open()
                except Exception as exc:
                    message = f"tier {ts.name!r} failed to open: {type(exc).__name__}: {exc}"
                    if ts.config.required:
                        raise TierUnavailable(message) from exc
                    logger.error(
                        "%s; running without it and retrying every %gs",
                        message,
                        ts.config.recovery_after,
                    )
                    continue
                ts.opened = True
        except BaseException:
            with anyio.CancelScope(shield=True):
                for ts in reversed(self._tiers):
                    await self._close_tier(ts)
            raise
        started = anyio.Event()
        self._stop = anyio.Event()

        async def supervise() -> None:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                started.set()
                await self._stop.wait()
                tg.cancel_scope.cancel()

        self._supervisor = asyncio.get_running_loop().create_task(supervise())
        await started.wait()
        self._closing = False
        assert self._tg is not None
        if any(ts.config.write_policy == "write_back" for ts in self._tiers):
            self._tg.start_soon(self._demoter)
        for ts in self._tiers:
            if not ts.opened:
                self._tg.start_soon(self._reopen, ts)

    async def _reopen(self, ts: _TierState) -> None:
        """Retry opening an optional tier until it works; until then it is skipped."""
        while not ts.opened:
            await anyio.sleep(max(ts.config.recovery_after, 0.01))
            try:
                await ts.tier.open()
            except Exception as exc:
                logger.debug("tier %s still fails to open: %s", ts.name, exc)
                continue
            ts.opened = True
            logger.warning("tier %s opened; the cache uses it from now on", ts.name)

    async def close(self) -> None:
        """Let background jobs finish (up to `close_timeout`, flushing write-back
        blocks), cancel what is left, and close every tier."""
        if self._tg is None or self._closing:
            return
        self._closing = True
        try:
            with anyio.move_on_after(self.config.close_timeout, shield=True):
                await self.flush()
        finally:
            with anyio.CancelScope(shield=True):
                self._stop.set()
                if self._supervisor is not None:
                    await self._supervisor
                self._tg = None
                for ts in self._tiers:
                    await self._close_tier(ts)

    async def _close_tier(self, ts: _TierState) -> None:
        if not ts.opened:
            return
        ts.opened = False
        try:
            await ts.tier.close()
        except Exception:
            logger.exception("tier %s failed to close", ts.name)

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

    def _check_open(self) -> TaskGroup:
        if self._tg is None or self._closing:
            raise TierUnavailable("the cache is not open (use `async with TieredCache(...)`)")
        return self._tg

    def _spawn(self, fn: Any, *args: Any) -> None:
        tg = self._check_open()
        if self._background == 0:
            self._idle = anyio.Event()
        self._background += 1

        async def run() -> None:
            try:
                await fn(*args)
            except Exception:  # a bug in our own bookkeeping: log, never kill the group
                logger.exception("background job %s failed", getattr(fn, "__name__", fn))
            finally:
                self._background -= 1
                if self._background == 0:
                    self._idle.set()

        tg.start_soon(run)

    async def flush(self) -> None:
        """Wait until every background cascade has finished, and offer every pending
        write-back block to its tiers once more (blocks whose demotion fails stay
        pinned in the primary for the demoter to retry)."""
        for batch in _batches([k for k in self._dirty if k not in self._demoting]):
            await self._demote(batch)
        while self._background or self._demoting:
            if self._background:
                await self._idle.wait()
            else:
                await anyio.sleep(0.001)  # the demoter is finishing a batch

    # -- events and stats ---------------------------------------------------------------
    def _emit(self, events: Sequence[OffloadingEvent]) -> None:
        overflow = len(self._events) + len(events) - _MAX_EVENTS
        if overflow > 0:
            self._events_dropped += overflow
        self._events.extend(events)

    def _drain_primary_events(self) -> None:
        self._emit(self.primary.take_events())

    def take_events(self) -> list[OffloadingEvent]:
        """Stored/removed events of every medium since the last call, in order. The
        newest 65,536 are kept; `stats().primary["events_dropped"]` counts the rest."""
        self._drain_primary_events()
        events = list(self._events)
        self._events.clear()
        return events

    def stats(self) -> CacheStats:
        primary = self._primary_stats.snapshot()
        primary.update(
            blocks=self.primary.num_blocks,
            resident=len(self.primary),
            free=self.primary.num_free,
            evictable=self.primary.num_evictable,
            promoting=self._promoting,
            write_back_pending=len(self._dirty),
            events_dropped=self._events_dropped,
            background_jobs=self._background,
        )
        tiers = {}
        for ts in self._tiers:
            ts.stats.breaker = ts.breaker.state.value if ts.opened else "not_open"
            tiers[ts.name] = ts.stats.snapshot()
        return CacheStats(primary, tiers)

    # -- running tier calls safely --------------------------------------------------------
    async def _run_job(
        self, ts: _TierState, kind: Literal["store", "load"], job: JobMetadata
    ) -> JobResult:
        """Run one tier job with its deadline; never raises (except cancellation)."""
        started = anyio.current_time()
        ts.stats.inflight_jobs += 1
        healthy = True
        try:
            with anyio.fail_after(ts.config.job_timeout):
                op = ts.tier.store if kind == "store" else ts.tier.load
                result = await op(job)
            result = self._sanitize(ts, job, result)
        except TimeoutError:
            healthy = False
            result = JobResult.failure(
                job, f"tier {ts.name}: {kind} timed out after {ts.config.job_timeout:g}s"
            )
        except anyio.get_cancelled_exc_class():
            ts.breaker.abandon()
            raise
        except Exception as exc:
            healthy = False
            result = JobResult.failure(
                job, f"tier {ts.name}: {kind} failed: {type(exc).__name__}: {exc}"
            )
        finally:
            ts.stats.inflight_jobs -= 1
        if kind == "store" and job.keys and not result.ok_keys and result.error:
            healthy = False  # a tier that can store nothing is down, raised or not
        if healthy:
            ts.breaker.record_success()
        else:
            ts.stats.errors += 1
            ts.breaker.record_failure()
        ts.stats.job_latency.add(anyio.current_time() - started)
        moved = len(result.ok_keys) * self.block_bytes
        if kind == "store":
            ts.stats.store_jobs += 1
            ts.stats.blocks_stored += len(result.ok_keys)
            ts.stats.bytes_in += moved
        else:
            ts.stats.load_jobs += 1
            ts.stats.blocks_loaded += len(result.ok_keys)
            ts.stats.bytes_out += moved
        ts.stats.failed_keys += len(result.failed_keys)
        if result.failed_keys and result.error:
            logger.debug("tier %s %s job: %s", ts.name, kind, result.error)
        return result

    def _sanitize(self, ts: _TierState, job: JobMetadata, result: JobResult) -> JobResult:
        """Hold a tier to 'every key exactly once'; anything it forgot failed."""
        if not isinstance(result, JobResult) or result.job_id != job.job_id:
            return JobResult.failure(job, f"tier {ts.name} returned a result for another job")
        keys = set(job.keys)
        ok = [k for k in result.ok_keys if k in keys]
        if len(ok) == len(job.keys) and not result.failed_keys:
            return result
        ok_set = set(ok)
        failed = [k for k in job.keys if k not in ok_set]
        error = result.error or (f"tier {ts.name} did not report every key" if failed else None)
        return JobResult(
            job.job_id, tuple(k for k in job.keys if k in ok_set), tuple(failed), error
        )

    async def _tier_lookup(
        self, ts: _TierState, keys: list[OffloadKey], ctx: ReqContext
    ) -> list[bool] | None:
        """The tier's answer, or None when it is unhealthy, slow or broken."""
        if not ts.opened or not ts.breaker.allow():
            ts.stats.skipped_unhealthy += 1
            return None
        started = anyio.current_time()
        ts.stats.lookups += 1
        ts.stats.lookup_keys += len(keys)
        try:
            with anyio.fail_after(self.config.lookup_timeout):
                flags = list(await ts.tier.lookup(keys, ctx))
            if len(flags) != len(keys):
                raise RuntimeError(f"answered {len(flags)} flags for {len(keys)} keys")
        except TimeoutError:
            ts.stats.lookup_timeouts += 1
            ts.stats.errors += 1
            ts.breaker.record_failure()
            return None
        except anyio.get_cancelled_exc_class():
            ts.breaker.abandon()
            raise
        except Exception as exc:
            logger.warning("tier %s lookup failed: %s: %s", ts.name, type(exc).__name__, exc)
            ts.stats.errors += 1
            ts.breaker.record_failure()
            return None
        ts.breaker.record_success()
        ts.stats.lookup_latency.add(anyio.current_time() - started)
        return flags

    # -- lookup ---------------------------------------------------------------------------
    async def lookup(
        self, keys_per_group: Sequence[Sequence[OffloadKey]], ctx: ReqContext | None = None
    ) -> LookupResult:
        """The longest prefix the cache can serve, and where its blocks live.

        `keys_per_group[g]` are the request's block keys of group `g`, in order. One
        batched call per tier: the primary first, then each tier only for keys still
        missing. Blocks that promotions could not take now (promotion reserve, primary
        room) count as misses. Nothing is reserved: `load` does that.
        """
        self._check_open()
        ctx = ctx or _DEFAULT_CTX
        groups = self.config.layout.groups
        if len(keys_per_group) != len(groups):
            raise ValueError(
                f"lookup got keys for {len(keys_per_group)} groups; the layout has {len(groups)}"
            )
        for g, keys in enumerate(keys_per_group):
            _check_keys(keys, f"keys_per_group[{g}]")
        all_keys = list(dict.fromkeys(k for keys in keys_per_group for k in keys))
        where: dict[OffloadKey, str] = {}
        missing: list[OffloadKey] = []
        for key in all_keys:
            if self.primary.is_ready(key):
                where[key] = PRIMARY_MEDIUM
            else:
                missing.append(key)
        ps = self._primary_stats
        ps.lookups += 1
        ps.lookup_keys += len(all_keys)
        ps.hits += len(all_keys) - len(missing)
        ps.misses += len(missing)
        for ts in self._tiers:
            if not missing:
                break
            flags = await self._tier_lookup(ts, missing, ctx)
            if flags is None:
                continue
            still: list[OffloadKey] = []
            for key, found in zip(missing, flags):
                if found and key not in ts.bad_claims:
                    where[key] = ts.name
                    self._note_location(key, ts.index)
                else:
                    still.append(key)
            ts.stats.hits += len(missing) - len(still)
            ts.stats.misses += len(still)
            missing = still

        present = [[k in where for k in keys] for keys in keys_per_group]
        tokens, ranges = combine_group_hits(groups, present)
        budget = min(
            self._reserve_slots - self._promoting,
            self.primary.num_free + self.primary.num_evictable,
        )
        needed = self._needed_in_token_order(keys_per_group, ranges)
        to_promote = [k for k in dict.fromkeys(needed) if where[k] != PRIMARY_MEDIUM]
        if len(to_promote) > budget:
            allowed = set(to_promote[: max(budget, 0)])
            present = [
                [k in where and (where[k] == PRIMARY_MEDIUM or k in allowed) for k in keys]
                for keys in keys_per_group
            ]
            tokens, ranges = combine_group_hits(groups, present)

        group_keys = tuple(tuple(keys[r.first : r.end]) for keys, r in zip(keys_per_group, ranges))
        needed_keys = [k for keys in group_keys for k in keys]
        self.primary.touch([k for k in needed_keys if where.get(k) == PRIMARY_MEDIUM])
        for key in all_keys:
            self._count_hit(key)
        locations = MappingProxyType({k: where[k] for k in needed_keys})
        return LookupResult(tokens, group_keys, tuple(ranges), locations)

    def _needed_in_token_order(
        self, keys_per_group: Sequence[Sequence[OffloadKey]], ranges: Sequence[GroupHit]
    ) -> list[OffloadKey]:
        groups = self.config.layout.groups
        ordered = sorted(
            (j * groups[g].block_size, g, keys_per_group[g][j])
            for g, r in enumerate(ranges)
            for j in range(r.first, r.end)
        )
        return [key for _, _, key in ordered]

    def _note_location(self, key: OffloadKey, tier_index: int) -> None:
        self._located[key] = tier_index
        self._located.move_to_end(key)
        while len(self._located) > self._located_limit:
            self._located.popitem(last=False)

    def _count_hit(self, key: OffloadKey) -> None:
        count = self._hit_counts.pop(key, 0) + 1
        self._hit_counts[key] = count
        while len(self._hit_counts) > self._located_limit:
            self._hit_counts.popitem(last=False)
        if self.primary.is_ready(key):
            for ts in self._tiers:
                if (
                    ts.config.write_policy == "write_through_selective"
                    and count == ts.config.min_hits
                ):
                    self._cascade(ts, [key])

    # -- store (down the chain) --------------------------------------------------------------
    async def store(self, keys: Sequence[OffloadKey], source: object) -> StoreResult:
        """Copy blocks into the primary and cascade them down per write policy.

        `source` holds one block per key: a `BlockSource` (e.g. the GPU worker's), a
        `[n, block_bytes]` uint8 CPU tensor, or a sequence of buffers. Keys already
        cached are skipped. Never waits on a secondary tier.
        """
        self._check_open()
        keys = list(keys)
        _check_keys(keys, "keys")
        src = as_source(source, len(keys), self.block_bytes)
        prepared = self.primary.prepare_store(keys)
        self._drain_primary_events()
        if prepared is None:
            new = [k for k in dict.fromkeys(keys) if k not in self.primary]
            self._primary_stats.drops += len(new)
            self._wake_demoter()
            return StoreResult(
                already_present=tuple(k for k in keys if k in self.primary),
                rejected=tuple(new),
                error="the primary tier has no evictable room (blocks are being read, "
                "written or demoted)",
            )
        position = {k: i for i, k in enumerate(keys)}
        new_keys = prepared.keys_to_store
        success = False
        try:
            await src.copy_to_slots(
                self.primary.view, [position[k] for k in new_keys], prepared.slots
            )
            success = True
        finally:
            self.primary.complete_store(new_keys, success=success)
            self._drain_primary_events()
        self._primary_stats.store_jobs += 1
        self._primary_stats.blocks_stored += len(new_keys)
        self._primary_stats.bytes_in += len(new_keys) * self.block_bytes
        self._after_store(new_keys)
        fresh = set(new_keys)
        return StoreResult(
            stored=tuple(new_keys),
            already_present=tuple(k for k in dict.fromkeys(keys) if k not in fresh),
        )

    def _after_store(self, keys: list[OffloadKey]) -> None:
        if not keys:
            return
        write_back: set[int] = set()
        for ts in self._tiers:
            policy = ts.config.write_policy
            if policy == "write_through":
                self._cascade(ts, keys)
            elif policy == "write_through_selective":
                chosen = [k for k in keys if self._hit_counts.get(k, 0) >= ts.config.min_hits]
                if chosen:
                    self._cascade(ts, chosen)
            else:
                write_back.add(ts.index)
        if write_back:
            self.primary.prepare_load(keys)  # pinned until demoted
            for key in keys:
                self._dirty[key] = dict.fromkeys(write_back, 0)
            self._wake_demoter()

    def _cascade(self, ts: _TierState, keys: list[OffloadKey]) -> None:
        """Send `keys` (ready in the primary) to `ts` in the background, or drop them."""
        if self._tg is None or self._closing:
            return
        if not ts.opened or not ts.breaker.allow():
            ts.stats.skipped_unhealthy += len(keys)
            return
        nbytes = len(keys) * self.block_bytes
        if (
            ts.stats.inflight_bytes
            and ts.stats.inflight_bytes + nbytes > ts.config.max_inflight_bytes
        ):
            ts.breaker.abandon()
            ts.stats.drops += len(keys)
            logger.debug("tier %s is behind: dropped a cascade of %d blocks", ts.name, len(keys))
            return
        slots = self.primary.prepare_load(keys)  # protected until the tier answers
        ts.stats.inflight_bytes += nbytes
        job = JobMetadata(next(self._job_ids), tuple(keys), tuple(slots))
        self._spawn(self._cascade_job, ts, job, nbytes)

    async def _cascade_job(self, ts: _TierState, job: JobMetadata, nbytes: int) -> None:
        try:
            result = await self._run_job(ts, "store", job)
        finally:
            ts.stats.inflight_bytes -= nbytes
            self.primary.complete_load(job.keys)
        self._record_stored(ts, result.ok_keys)

    def _record_stored(self, ts: _TierState, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            ts.bad_claims.discard(key)
        if keys:
            self._drain_primary_events()
            self._emit([OffloadingEvent(tuple(keys), ts.name, removed=False)])

    # -- write-back ---------------------------------------------------------------------------
    def _wake_demoter(self) -> None:
        self._demote_wakeup.set()

    def _headroom(self) -> int:
        return self.primary.num_free + self.primary.num_evictable

    async def _demoter(self) -> None:
        """Demote write-back blocks when the primary runs short of evictable room, so a
        block is written to its write-back tiers before its slot can be freed."""
        while True:
            await self._demote_wakeup.wait()
            self._demote_wakeup = anyio.Event()
            try:
                while self._dirty and self._headroom() <= self._headroom_slots:
                    want = max(1, min(self._headroom_slots - self._headroom() + 1, _DEMOTE_BATCH))
                    batch = list(
                        itertools.islice((k for k in self._dirty if k not in self._demoting), want)
                    )
                    if not batch or not await self._demote(batch):
                        break  # no progress now (tier down): retry at the next wake-up
            except Exception:  # our own bug: log it and keep demoting later
                logger.exception("write-back demoter failed")

    async def _demote(self, keys: list[OffloadKey]) -> int:
        """Write `keys` to the write-back tiers still missing them; unpin the keys every
        tier now has. Returns how many were unpinned."""
        self._demoting.update(keys)
        released: list[OffloadKey] = []
        try:
            async with anyio.create_task_group() as tg:
                for ts in self._tiers:
                    mine = [k for k in keys if ts.index in self._dirty.get(k, {})]
                    if mine:
                        tg.start_soon(self._demote_to, ts, mine)
        finally:
            self._demoting.difference_update(keys)
            released = [k for k in keys if k in self._dirty and not self._dirty[k]]
            for key in released:
                del self._dirty[key]
            if released:
                self.primary.complete_load(released)  # unpinned: evictable now
        return len(released)

    async def _demote_to(self, ts: _TierState, keys: list[OffloadKey]) -> None:
        """One demotion job. A key the tier fails stays pending; after
        `_DEMOTE_ATTEMPTS` failures it is given up for that tier (counted in drops).
        A tier that is down (not open, breaker open) costs no attempt."""
        if not ts.opened or not ts.breaker.allow():
            ts.stats.skipped_unhealthy += len(keys)
            return
        slots = [self.primary.slot_of(k) for k in keys]
        job = JobMetadata(
            next(self._job_ids), tuple(keys), tuple(s for s in slots if s is not None)
        )
        result = await self._run_job(ts, "store", job)
        self._record_stored(ts, result.ok_keys)
        ok = set(result.ok_keys)
        for key in keys:
            pending = self._dirty.get(key)
            if pending is None or ts.index not in pending:
                continue
            if key in ok:
                del pending[ts.index]
                continue
            pending[ts.index] += 1
            if pending[ts.index] >= _DEMOTE_ATTEMPTS:
                del pending[ts.index]
                ts.stats.drops += 1
                logger.warning(
                    "gave up writing a block back to tier %s after %d failures: %s",
                    ts.name,
                    _DEMOTE_ATTEMPTS,
                    result.error,
                )

    # -- load (up the chain) ------------------------------------------------------------------
    async def load(
        self, keys: Sequence[OffloadKey], destination: object, ctx: ReqContext | None = None
    ) -> LoadResult:
        """Copy the blocks of `keys` into `destination`, promoting from lower tiers.

        `destination` holds one writable block per key: a `BlockDestination` (e.g. the
        GPU worker's), a `[n, block_bytes]` uint8 CPU tensor or a sequence of writable
        buffers. Keys that cannot be served are reported failed with a reason;
        nothing raises for a tier's failure.
        """
        self._check_open()
        ctx = ctx or _DEFAULT_CTX
        keys = list(keys)
        _check_keys(keys, "keys")
        dest = as_destination(destination, len(keys), self.block_bytes)

        held: set[OffloadKey] = set()  # keys this call holds one primary reader on
        sources: dict[OffloadKey, str] = {}
        errors: dict[OffloadKey, str] = {}
        waiting: dict[OffloadKey, _Flight] = {}
        collected: set[OffloadKey] = set()
        to_promote: list[OffloadKey] = []
        for key in dict.fromkeys(keys):
            if self.primary.is_ready(key):
                self.primary.prepare_load([key])
                held.add(key)
                sources[key] = PRIMARY_MEDIUM
            elif key in self._flights:
                flight = self._flights[key]
                flight.waiters[key] += 1
                waiting[key] = flight
            else:
                to_promote.append(key)
        if to_promote:
            flight = _Flight(waiters={k: 1 for k in to_promote})
            for key in to_promote:
                self._flights[key] = flight
                waiting[key] = flight
            self._spawn(self._promote, flight, to_promote, ctx)
        try:
            for flight in {id(f): f for f in waiting.values()}.values():
                await flight.done.wait()
            for key, flight in waiting.items():
                collected.add(key)
                medium, error = flight.outcome[key]
                if medium is not None and flight.granted.get(key, 0) > 0:
                    flight.granted[key] -= 1
                    held.add(key)
                    sources[key] = medium
                else:
                    errors[key] = error or "promotion failed"
            order = [(i, k) for i, k in enumerate(keys) if k in held]
            slots = [self.primary.slot_of(k) for _, k in order]
            assert all(s is not None for s in slots)
            await dest.copy_from_slots(
                self.primary.view, [i for i, _ in order], [s for s in slots if s is not None]
            )
        finally:
            if held:
                self.primary.complete_load(list(held))
            for key, flight in waiting.items():
                if key in collected:
                    continue
                if not flight.done.is_set():
                    flight.waiters[key] -= 1
                elif flight.granted.get(key, 0) > 0:
                    flight.granted[key] -= 1
                    self.primary.complete_load([key])
        self._primary_stats.load_jobs += 1
        self._primary_stats.blocks_loaded += len(held)
        self._primary_stats.bytes_out += len(held) * self.block_bytes
        ok = tuple(k for k in dict.fromkeys(keys) if k in held)
        failed = tuple(k for k in dict.fromkeys(keys) if k not in held)
        return LoadResult(
            ok_keys=ok,
            failed_keys=failed,
            errors=MappingProxyType({k: errors.get(k, "not loaded") for k in failed}),
            sources=MappingProxyType({k: sources[k] for k in ok}),
        )

    async def _promote(self, flight: _Flight, keys: list[OffloadKey], ctx: ReqContext) -> None:
        """Stage 1: read `keys` from the first tier that has them into primary slots."""
        outcome = flight.outcome
        try:
            room = max(0, self._reserve_slots - self._promoting)
            admitted, shed = keys[:room], keys[room:]
            for key in shed:
                outcome[key] = (None, "promotion reserve is full (load shed); recompute")
            if admitted:
                await self._promote_admitted(admitted, outcome, ctx)
        finally:
            for key in keys:
                outcome.setdefault(key, (None, "promotion cancelled"))
                if self._flights.get(key) is flight:
                    del self._flights[key]
            for key, count in flight.waiters.items():
                if count > 0 and outcome[key][0] is not None and self.primary.is_ready(key):
                    self.primary.prepare_load([key] * count)
                    flight.granted[key] = count
            flight.done.set()

    async def _promote_admitted(
        self,
        keys: list[OffloadKey],
        outcome: dict[OffloadKey, tuple[str | None, str | None]],
        ctx: ReqContext,
    ) -> None:
        prepared = self.primary.prepare_store(keys)
        self._drain_primary_events()
        if prepared is None:
            for key in keys:
                outcome[key] = (None, "the primary tier has no room for a promotion; recompute")
            return
        reserved = set(prepared.keys_to_store)
        for key in keys:
            if key not in reserved:  # appeared meanwhile
                if self.primary.is_ready(key):
                    outcome[key] = (PRIMARY_MEDIUM, None)
                else:
                    outcome[key] = (None, "the block is being stored right now")
        slot_of = dict(zip(prepared.keys_to_store, prepared.slots))
        remaining = list(prepared.keys_to_store)
        last_error: dict[OffloadKey, str] = {}
        self._promoting += len(remaining)
        try:
            for ts in self._tiers:
                if not remaining:
                    break
                if not ts.opened or not ts.breaker.allow():
                    ts.stats.skipped_unhealthy += 1
                    continue
                job = JobMetadata(
                    next(self._job_ids), tuple(remaining), tuple(slot_of[k] for k in remaining), ctx
                )
                result = await self._run_job(ts, "load", job)
                for key in result.ok_keys:
                    outcome[key] = (ts.name, None)
                for key in result.failed_keys:
                    last_error[key] = result.error or f"tier {ts.name} could not load it"
                    if self._located.get(key) == ts.index:
                        ts.bad_claims.add(key)  # never re-promote from a claim that failed
                        self._located.pop(key, None)
                loaded = set(result.ok_keys)
                remaining = [k for k in remaining if k not in loaded]
            for key in remaining:
                outcome[key] = (None, last_error.get(key, "not found in any tier"))
        finally:
            self._promoting -= len(prepared.keys_to_store)
            ok = [k for k in prepared.keys_to_store if outcome.get(k, (None, None))[0] is not None]
            ok_set = set(ok)
            bad = [k for k in prepared.keys_to_store if k not in ok_set]
            self.primary.complete_store(ok, success=True)
            self.primary.complete_store(bad, success=False)
            self._drain_primary_events()


def _batches(keys: list[OffloadKey], size: int = _DEMOTE_BATCH) -> list[list[OffloadKey]]:
    return [keys[i : i + size] for i in range(0, len(keys), size)]
