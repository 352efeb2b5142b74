"""Up the chain: `load`, with streaming, pipelined promotion.

Keys the primary holds are copied to the destination directly. Keys only a lower tier
holds are promoted in windows: stage 1 reads a window from the tier lookup located
it in (the tiers holding parts of one window are read concurrently; a tier that fails
a key hands it to the next tier down the chain believed to hold it) into primary
slots; stage 2 copies the window to the destination. Stage 1 of window i+1 runs while
stage 2 of window i copies. Windows are bounded by the promotion reserve (half of it
each when a request needs more than the reserve, so two windows fit): the reserve
bounds staging, not the hit. Under contention (the reserve held by other loads) the
rest of a request is shed as misses rather than waiting.

Concurrent loads of one key share one promotion (single flight): a window is a
`Flight` the index points to; a later load waits on it and takes a reader on the
promoted block when it lands. Every promotion runs in the cache's task group, so a
cancelled load never strands a reservation.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from types import MappingProxyType

import anyio

from tierkv.blocks import BlockDestination
from tierkv.cache.core import CacheCore
from tierkv.cache.index import Flight
from tierkv.cache.lookup import Lookup
from tierkv.cache.results import LoadResult
from tierkv.cache.validate import check_keys, checked_destination
from tierkv.jobs import JobMetadata, JobResult, ReqContext
from tierkv.keys import OffloadKey
from tierkv.primary import MEDIUM as PRIMARY_MEDIUM

_SHED = "promotion reserve is full (load shed); recompute"
_CLOSING = "the cache is closing; recompute"
_NO_ROOM = "no room in the primary tier for a promotion (load shed); recompute"


class _LoadState:
    """The bookkeeping of one `load` call, so its `finally` can give back exactly what
    it took."""

    def __init__(self, keys: list[OffloadKey]) -> None:
        # where each key goes in the destination: its first index, and any repeats
        self.first: dict[OffloadKey, int] = {}
        self.repeats: dict[OffloadKey, list[int]] = {}
        first = self.first
        for i, key in enumerate(keys):
            if first.setdefault(key, i) != i:
                self.repeats.setdefault(key, []).append(i)
        self.holding: set[OffloadKey] = set()  # keys this call holds one reader on
        self.loaded: set[OffloadKey] = set()
        self.sources: dict[OffloadKey, str] = {}
        self.errors: dict[OffloadKey, str] = {}
        self.waiting: dict[OffloadKey, Flight] = {}
        self.collected: set[OffloadKey] = set()


class Promoter:
    stage1_windows = 2  # windows read from the tiers at once by one load

    def __init__(self, core: CacheCore, lookup: Lookup) -> None:
        self.core = core
        self.lookup = lookup

    async def load(
        self, keys: Sequence[OffloadKey], destination: object, ctx: ReqContext
    ) -> LoadResult:
        core = self.core
        core.check_open()
        keys = list(keys)
        check_keys(keys, "keys")
        dest = checked_destination(destination, len(keys), core.block_bytes, core.primary.view)
        primary, index = core.primary, core.index
        s = _LoadState(keys)
        resident: list[OffloadKey] = []
        to_promote: list[OffloadKey] = []
        blocks = primary._blocks  # the hot path reads the block table directly
        for key in s.first:
            block = blocks.get(key)
            if block is not None and block.ready:
                resident.append(key)
            elif (flight := index.flight(key)) is not None:
                flight.waiters[key] = flight.waiters.get(key, 0) + 1
                s.waiting[key] = flight
            else:
                to_promote.append(key)
        if resident:
            primary.prepare_load(resident)
            s.holding.update(resident)
            s.sources.update(dict.fromkeys(resident, PRIMARY_MEDIUM))
        try:
            unknown = [k for k in to_promote if index.location(k) is None]
            if unknown:
                await self.lookup.locate(unknown, ctx)
                for key in unknown:
                    if index.location(key) is None:
                        s.errors[key] = "not found in any tier"
                to_promote = [k for k in to_promote if k not in s.errors]
            await self._pipeline(s, dest, resident, to_promote, ctx)
            followers: dict[int, tuple[Flight, list[OffloadKey]]] = {}
            for key, flight in s.waiting.items():
                if key not in s.collected:
                    followers.setdefault(id(flight), (flight, []))[1].append(key)
            late: list[OffloadKey] = []
            for flight, ks in followers.values():
                await flight.done.wait()
                late.extend(self._collect(s, flight, ks))
            await self._copy_out(s, dest, late)
        finally:
            if s.holding:
                primary.complete_load(list(s.holding))
                s.holding.clear()
                core.released.notify()
            for key, flight in s.waiting.items():
                if key in s.collected:
                    continue
                if not flight.done.is_set():
                    flight.waiters[key] -= 1
                elif flight.granted.get(key, 0) > 0:
                    flight.granted[key] -= 1
                    primary.complete_load([key])
        stats = core.primary_stats
        stats.load_jobs += 1
        stats.blocks_loaded += len(s.loaded)
        stats.bytes_out += len(s.loaded) * core.block_bytes
        loaded = s.loaded
        ok: tuple[OffloadKey, ...]
        failed: tuple[OffloadKey, ...]
        if len(loaded) == len(s.first):
            ok, failed = tuple(s.first), ()
        else:
            ok = tuple(k for k in s.first if k in loaded)
            failed = tuple(k for k in s.first if k not in loaded)
        return LoadResult(
            ok_keys=ok,
            failed_keys=failed,
            errors=MappingProxyType({k: s.errors.get(k, "not loaded") for k in failed}),
            sources=MappingProxyType({k: s.sources[k] for k in ok}),
        )

    async def _copy_out(
        self, s: _LoadState, dest: BlockDestination, keys: Sequence[OffloadKey]
    ) -> None:
        """Stage 2: copy `keys` (held) to the destination, then let go of them."""
        if not keys:
            return
        primary = self.core.primary
        blocks, first = primary._blocks, s.first
        indices = [first[k] for k in keys]
        slots = [blocks[k].slot for k in keys]
        if s.repeats:
            for key in keys:
                for i in s.repeats.get(key, ()):
                    indices.append(i)
                    slots.append(blocks[key].slot)
        await dest.copy_from_slots(primary.view, indices, slots)
        s.loaded.update(keys)
        primary.complete_load(list(keys))
        s.holding.difference_update(keys)
        self.core.released.notify()

    async def _pipeline(
        self,
        s: _LoadState,
        dest: BlockDestination,
        resident: list[OffloadKey],
        to_promote: list[OffloadKey],
        ctx: ReqContext,
    ) -> None:
        core = self.core
        primary = core.primary
        reserve = core.reserve_slots
        window = reserve if len(to_promote) <= reserve else max(1, reserve // 2)
        inflight: deque[Flight] = deque()
        pos = 0

        def fill() -> None:
            """Keep stage 1 busy: a second window reads while the first does, when the
            reserve and the primary have room for it; the first one always starts (or
            the rest is shed)."""
            nonlocal pos
            while pos < len(to_promote) and len(inflight) < self.stage1_windows:
                size = min(window, len(to_promote) - pos)
                if inflight and (
                    core.reserve_slots - core.promoting < size
                    or primary.num_free + primary.num_evictable < size + window
                ):
                    return  # wait for this load's own window instead
                started = self._start(s, to_promote, pos, window, ctx)
                if started is None:  # shed under contention
                    pos = len(to_promote)
                    return
                flight, pos = started
                inflight.append(flight)

        first = min(window, len(to_promote))
        if primary.num_free + primary.num_evictable >= first:
            fill()
            await self._copy_out(s, dest, resident)  # overlaps stage 1 of the first windows
        else:  # the room is held by this load's own resident blocks: copy them out first
            await self._copy_out(s, dest, resident)
            fill()
        while inflight or pos < len(to_promote):
            if not inflight:
                fill()
                continue
            flight = inflight.popleft()
            await flight.done.wait()
            got = self._collect(s, flight, flight.keys)
            fill()
            await self._copy_out(s, dest, got)  # overlaps stage 1 of the next windows

    def _start(
        self,
        s: _LoadState,
        to_promote: list[OffloadKey],
        pos: int,
        window: int,
        ctx: ReqContext,
    ) -> tuple[Flight, int] | None:
        """Start stage 1 for the next window, or shed the rest under contention."""
        core = self.core
        if not core.is_open:  # close() began: no new background work; the rest misses
            for key in to_promote[pos:]:
                s.errors[key] = _CLOSING
            return None
        room = core.reserve_slots - core.promoting
        if room <= 0:
            for key in to_promote[pos:]:
                s.errors[key] = _SHED
            core.counters["promotions_shed"] += len(to_promote) - pos
            return None
        end = min(len(to_promote), pos + min(window, room))
        mine: list[OffloadKey] = []
        index = core.index
        for key in to_promote[pos:end]:
            other = index.flight(key)
            if other is not None:  # another load started it meanwhile: follow it
                other.waiters[key] = other.waiters.get(key, 0) + 1
                s.waiting[key] = other
            else:
                mine.append(key)
        flight = Flight(keys=mine, waiters=dict.fromkeys(mine, 1))
        for key in mine:
            index.set_flight(key, flight)
            s.waiting[key] = flight
        core.promoting += len(mine)
        core.spawn(self._run_flight, flight, ctx)
        return flight, end

    def _collect(
        self, s: _LoadState, flight: Flight, keys: Sequence[OffloadKey]
    ) -> list[OffloadKey]:
        """Take this load's share of a finished flight: keys now held, or errors."""
        got: list[OffloadKey] = []
        for key in keys:
            if key not in s.collected:
                got.extend(self._collect_one(s, flight, key))
        return got

    def _collect_one(self, s: _LoadState, flight: Flight, key: OffloadKey) -> list[OffloadKey]:
        s.collected.add(key)
        medium, error = flight.outcome.get(key, (None, "promotion failed"))
        if medium is not None and flight.granted.get(key, 0) > 0:
            flight.granted[key] -= 1
            s.holding.add(key)
            s.sources[key] = medium
            return [key]
        s.errors[key] = error or "promotion failed"
        return []

    # -- stage 1 (a background job) ----------------------------------------------------
    def _next_tier(self, key: OffloadKey, after: int) -> int | None:
        """The next tier below `after` believed to hold `key` and healthy enough."""
        mask = self.core.index.held(key) >> (after + 1)
        i = after + 1
        while mask:
            if mask & 1:
                handle = self.core.tiers[i]
                if handle.usable():
                    return i
                handle.stats.skipped_unhealthy += 1
            mask >>= 1
            i += 1
        return None

    async def _run_flight(self, flight: Flight, ctx: ReqContext) -> None:
        core = self.core
        primary, index = core.primary, core.index
        outcome = flight.outcome
        keys = flight.keys
        reserved: list[OffloadKey] = []
        try:
            prepared = primary.prepare_store_prefix(keys, may_evict=index.is_clean)
            core.events.drain_primary()
            reserved = prepared.keys_to_store
            core.staging += len(reserved)
            rset = set(reserved)
            for key in keys:
                if key not in rset:
                    if primary.is_ready(key):
                        outcome[key] = (PRIMARY_MEDIUM, None)
                    elif key in primary:
                        outcome[key] = (None, "the block is being stored right now")
                    else:
                        outcome[key] = (None, _NO_ROOM)
            slot_of = dict(zip(reserved, prepared.slots))
            await self._read(reserved, slot_of, outcome, ctx)
        finally:
            core.promoting -= len(keys)
            core.staging -= len(reserved)
            ok = [k for k in reserved if outcome.get(k, (None, None))[0] is not None]
            ok_set = set(ok)
            primary.complete_store(ok, success=True)
            primary.complete_store([k for k in reserved if k not in ok_set], success=False)
            core.events.drain_primary()
            for key in keys:
                outcome.setdefault(key, (None, "promotion cancelled"))
                index.end_flight(key, flight)
            for key, count in flight.waiters.items():
                if count > 0 and outcome[key][0] is not None and primary.is_ready(key):
                    primary.prepare_load([key] * count)
                    flight.granted[key] = count
            flight.done.set()
            core.released.notify()

    async def _read(
        self,
        keys: list[OffloadKey],
        slot_of: dict[OffloadKey, int],
        outcome: dict[OffloadKey, tuple[str | None, str | None]],
        ctx: ReqContext,
    ) -> None:
        """Read `keys` into their slots: each from its located tier, the tiers of one
        round concurrently; a failed key moves on down the chain."""
        core = self.core
        tried: dict[OffloadKey, int] = {}
        last_error: dict[OffloadKey, str] = {}
        remaining = keys
        while remaining:
            by_tier: dict[int, list[OffloadKey]] = {}
            for key in remaining:
                t = self._next_tier(key, tried.get(key, -1))
                if t is None:
                    outcome[key] = (None, last_error.get(key, "not found in any tier"))
                else:
                    by_tier.setdefault(t, []).append(key)
            if not by_tier:
                return
            results: dict[int, JobResult] = {}
            if len(by_tier) == 1:
                ((t, ks),) = by_tier.items()
                await self._read_from(t, ks, slot_of, ctx, results)
            else:
                async with anyio.create_task_group() as tg:
                    for t, ks in by_tier.items():
                        tg.start_soon(self._read_from, t, ks, slot_of, ctx, results)
            remaining = []
            for t, result in results.items():
                name = core.tiers[t].name
                for key in result.ok_keys:
                    outcome[key] = (name, None)
                for key in result.failed_keys:
                    core.index.note_failed(key, t)
                    last_error[key] = result.error or f"tier {name} could not load it"
                    tried[key] = t
                    remaining.append(key)

    async def _read_from(
        self,
        t: int,
        keys: list[OffloadKey],
        slot_of: dict[OffloadKey, int],
        ctx: ReqContext,
        results: dict[int, JobResult],
    ) -> None:
        core = self.core
        job = JobMetadata(core.next_job_id(), tuple(keys), tuple(slot_of[k] for k in keys), ctx)
        results[t] = await core.tiers[t].run_job("load", job, core.block_bytes)
