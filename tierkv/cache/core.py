"""The state every part of the cache shares: the primary, the tier handles, the
per-key index, the event log, and the task group that owns background jobs.

The parts (lookup, store and cascade, promotion, write-back) are small classes that
each hold this `CacheCore`; `TieredCache` is the facade over them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
from anyio.abc import TaskGroup

from tierkv.cache.counters import CacheCounters
from tierkv.cache.index import KeyIndex
from tierkv.cache.tenants import TenantLedger
from tierkv.config import CacheConfig
from tierkv.contract.errors import TierUnavailable
from tierkv.contract.events import OffloadingEvent
from tierkv.contract.tenants import OTHER_TENANTS
from tierkv.driver import GuardedTier
from tierkv.driver.claims import ClaimLedger
from tierkv.driver.guarded import AbandonedJob
from tierkv.primary import PrimaryTier
from tierkv.quotas.book import QuotaBook, tenant_name
from tierkv.quotas.config import PRIMARY_KEY
from tierkv.stats import TierStats

logger = logging.getLogger(__name__)

MAX_EVENTS = 65536  # events kept for take_events(); older ones are dropped and counted


class Signal:
    """Wakes every task waiting for 'something was released' (slots, flights).

    Counts its waiters, so a notice nobody waits for costs nothing (no new event)."""

    def __init__(self) -> None:
        self._event = anyio.Event()
        self._waiting = 0

    @property
    def waiting(self) -> int:
        """Tasks waiting now."""
        return self._waiting

    def notify(self) -> None:
        if self._waiting:
            self._event.set()
            self._event = anyio.Event()

    async def wait(self) -> None:
        self._waiting += 1
        try:
            await self._event.wait()
        finally:
            self._waiting -= 1


class EventLog:
    """Stored/removed events of every medium, bounded, oldest first.

    The log is the primary's event sink: the primary hands over each event as it
    changes its block table, so its events are always ahead of a tier's that follow
    (a tier's store is reported after the primary made the block ready), and no code
    that changes the primary has to remember to collect them."""

    def __init__(
        self,
        primary: PrimaryTier,
        limit: int = MAX_EVENTS,
        on_evicted: Callable[[Sequence[Any]], None] | None = None,
    ) -> None:
        self._events: deque[OffloadingEvent] = deque(maxlen=limit)
        self.dropped = 0
        self._on_evicted = on_evicted  # told the keys of the primary's removed events
        primary.set_event_sink(self.append)

    def append(self, event: OffloadingEvent) -> None:
        if event.removed and self._on_evicted is not None:
            self._on_evicted(event.keys)
        if len(self._events) == self._events.maxlen:
            self.dropped += 1
        self._events.append(event)

    def emit(self, events: Sequence[OffloadingEvent]) -> None:
        maxlen = self._events.maxlen or 0
        overflow = len(self._events) + len(events) - maxlen
        if overflow > 0:
            self.dropped += overflow
        self._events.extend(events)

    def take(self) -> list[OffloadingEvent]:
        events = list(self._events)
        self._events.clear()
        return events


class CacheCore:
    """Shared state of one `TieredCache`."""

    def __init__(self, config: CacheConfig, primary: PrimaryTier, tiers: list[GuardedTier]):
        self.config = config
        self.primary = primary
        self.block_bytes = primary.view.block_bytes
        self.tiers = tiers
        self.index = KeyIndex(max(65536, 16 * primary.num_blocks))
        self.claims = ClaimLedger(tiers)  # blocks lookups claimed in tiers, per request
        # per-tenant counts; the primary's evictions end its blocks' ownership
        self.tenants = TenantLedger(self.block_bytes, config.tenants.report_top)
        self.events = EventLog(primary, on_evicted=self.tenants.evicted)
        quotas = config.tenants.quotas
        for handle in tiers:  # each tenant held to its share of the tiers with quotas
            if handle.name in quotas:
                handle.set_quotas(quotas[handle.name])
        if PRIMARY_KEY in quotas:
            primary.set_quotas(
                QuotaBook(
                    quotas[PRIMARY_KEY], primary.num_blocks, self.block_bytes, tier=PRIMARY_KEY
                )
            )
        self.primary_stats = TierStats()
        # promotions hold at most this share of the primary; stores leave its unheld
        # part alone (none when no tier can be promoted from)
        primary.set_promotion_share(
            max(1, int(config.promotion_reserve * primary.num_blocks)) if tiers else 0
        )
        self.released = Signal()  # write-back batches finished (flush waits on it)
        self.job_ids = itertools.count(1)
        self.tg: TaskGroup | None = None
        self.closing = False
        self.background = 0
        self.idle = anyio.Event()
        self.idle.set()
        self._stop = anyio.Event()
        self._supervisor: asyncio.Task[None] | None = None
        self.counters = CacheCounters()
        self.abandoned: set[AbandonedJob] = set()  # tier jobs left running, holding slots
        # promotion room may have been released (a window landed, a load or prefetch let
        # go of blocks): prefetches waiting for room look again
        self.room_changed = Signal()

    # -- background jobs ---------------------------------------------------------------
    async def start(self) -> None:
        started = anyio.Event()
        self._stop = anyio.Event()

        async def supervise() -> None:
            async with anyio.create_task_group() as tg:
                self.tg = tg
                started.set()
                await self._stop.wait()
                tg.cancel_scope.cancel()

        self._supervisor = asyncio.get_running_loop().create_task(supervise())
        await started.wait()
        self.closing = False

    async def stop(self) -> None:
        self._stop.set()
        if self._supervisor is not None:
            await self._supervisor
        self.tg = None

    def check_open(self) -> TaskGroup:
        if self.tg is None or self.closing:
            raise TierUnavailable("the cache is not open (use `async with TieredCache(...)`)")
        return self.tg

    @property
    def is_open(self) -> bool:
        return self.tg is not None and not self.closing

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Run `fn(*args)` in the cache's task group; `idle` is set when none run."""
        tg = self.check_open()
        if self.background == 0:
            self.idle = anyio.Event()
        self.background += 1

        async def run() -> None:
            try:
                await fn(*args)
            except Exception:  # a bug in our own bookkeeping: log, never kill the group
                logger.exception("background job %s failed", getattr(fn, "__name__", fn))
            finally:
                self.background -= 1
                if self.background == 0:
                    self.idle.set()

        tg.start_soon(run)

    def hold_until_ended(self, job: AbandonedJob, release: Callable[[], None]) -> None:
        """A tier job left running at its deadline holds slots until it ends: call
        `release` (giving them back) then. `flush` does not wait for it (a stuck tier
        would hold it for ever); `close` waits up to `close_timeout`."""
        self.abandoned.add(job)

        def ended() -> None:
            self.abandoned.discard(job)
            release()

        job.on_end(ended)

    async def abandoned_ended(self) -> None:
        """Wait until every tier job left running at its deadline has ended."""
        for job in list(self.abandoned):
            await job.wait()

    def next_job_id(self) -> int:
        return next(self.job_ids)

    def quota_declined(self, tenant: str | None, n: int) -> None:
        """The primary's quota declined `n` blocks of `tenant`'s: counted per tenant
        and in the primary's book (a tier's guard counts its own declines)."""
        self.tenants.declined(tenant, n)
        if self.primary.quotas is not None:
            self.primary.quotas.note_declined(tenant_name(tenant), n)

    def tenant_report(self) -> dict[str, dict[str, Any]]:
        """`stats().tenants`: the ledger's rows, each with `quotas`: per tier with
        quotas, the bytes the tenant holds there, its quota (None: no cap) and the
        blocks a quota declined. Tenants past the rows named are summed in `other`."""
        report = self.tenants.report(len(self.primary))
        books = [(PRIMARY_KEY, self.primary.quotas)]
        books += [(h.name, h.quotas.opened_book) for h in self.tiers if h.quotas is not None]
        b = self.block_bytes
        for tier, book in books:
            if book is None:
                continue
            for name, row in book.report().items():
                target = report.get(name)
                if target is None:
                    if not (row["held_blocks"] or row["declined_blocks"]):
                        continue
                    target = report.setdefault(OTHER_TENANTS, self.tenants.empty_row())
                    row = {**row, "quota_blocks": None}  # summed: no one quota
                slot = target.setdefault("quotas", {}).setdefault(
                    tier, {"held_bytes": 0, "quota_bytes": None, "declined_blocks": 0}
                )
                slot["held_bytes"] += (row["held_blocks"] or 0) * b
                slot["declined_blocks"] += row["declined_blocks"] or 0
                if row["quota_blocks"] is not None:
                    slot["quota_bytes"] = row["quota_blocks"] * b
        return report

    def emit_tier(self, handle: GuardedTier, keys: Sequence[Any], removed: bool) -> None:
        if keys:
            self.events.emit([OffloadingEvent(tuple(keys), handle.name, removed=removed)])
