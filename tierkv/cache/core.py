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

from tierkv.cache.guard import TierHandle
from tierkv.cache.index import KeyIndex
from tierkv.config import CacheConfig
from tierkv.contract.errors import TierUnavailable
from tierkv.contract.events import OffloadingEvent
from tierkv.primary import PrimaryTier
from tierkv.stats import TierStats

logger = logging.getLogger(__name__)

MAX_EVENTS = 65536  # events kept for take_events(); older ones are dropped and counted


class Signal:
    """Wakes every task waiting for 'something was released' (slots, flights)."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = anyio.Event()

    async def wait(self) -> None:
        await self._event.wait()


class EventLog:
    """Stored/removed events of every medium, bounded, oldest first."""

    def __init__(self, primary: PrimaryTier, limit: int = MAX_EVENTS) -> None:
        self._primary = primary
        self._events: deque[OffloadingEvent] = deque(maxlen=limit)
        self.dropped = 0

    def emit(self, events: Sequence[OffloadingEvent]) -> None:
        maxlen = self._events.maxlen or 0
        overflow = len(self._events) + len(events) - maxlen
        if overflow > 0:
            self.dropped += overflow
        self._events.extend(events)

    def drain_primary(self) -> None:
        """Move the primary's pending events into the log (always before a tier's)."""
        events = self._primary.take_events()
        if events:
            self.emit(events)

    def take(self) -> list[OffloadingEvent]:
        self.drain_primary()
        events = list(self._events)
        self._events.clear()
        return events


class CacheCore:
    """Shared state of one `TieredCache`."""

    def __init__(self, config: CacheConfig, primary: PrimaryTier, tiers: list[TierHandle]):
        self.config = config
        self.primary = primary
        self.block_bytes = primary.view.block_bytes
        self.tiers = tiers
        self.index = KeyIndex(max(65536, 16 * primary.num_blocks))
        self.events = EventLog(primary)
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
        self.counters: dict[str, int] = {
            "store_rejected": 0,
            "store_waits": 0,
            "write_back_dropped": 0,
            "promotions_shed": 0,
            "promotion_waits": 0,
            "load_fallbacks": 0,
            "store_skipped": 0,
        }

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

    def next_job_id(self) -> int:
        return next(self.job_ids)

    def emit_tier(self, handle: TierHandle, keys: Sequence[Any], removed: bool) -> None:
        if keys:
            self.events.drain_primary()
            self.events.emit([OffloadingEvent(tuple(keys), handle.name, removed=removed)])
