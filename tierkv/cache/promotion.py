"""Up the chain: `load`, with streaming, pipelined promotion.

Keys the primary holds are copied to the destination directly. Keys only a lower tier
holds are promoted in windows: a window reserves its slots from the primary's
promotion share when it starts (`PrimaryTier.prepare_promotion`), stage 1 reads it
from the tier lookup located it in (the tiers holding parts of one window are read
concurrently; a tier that fails a key hands it to the next tier down the chain
believed to hold it) into those slots; stage 2 copies the window to the destination.
Stage 1 of window i+1 runs while stage 2 of window i copies. Windows are bounded by
the share (half of it each when a request needs more, so two windows fit): the share
bounds staging, not the hit. Under contention a load waits for room (woken only when
room it can use is released, first come first served, loads before stores) up to
`promotion_wait` in all, then sheds the rest as misses; while others wait, a load
keeps one window in flight.

Concurrent loads of one key share one promotion (single flight): a window is a
`Flight` the index points to; a later load waits on it and takes a reader on the
promoted block when it lands. Every promotion runs in the cache's task group, so a
cancelled load never strands a reservation.

Prefetches (`tierkv.cache.prefetch`) run the same stage 1 for queued requests; a load
joins their windows like any other, and ends the prefetch of its own request.
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
from tierkv.cache.prefetch import Prefetcher
from tierkv.cache.results import LoadResult
from tierkv.cache.validate import check_keys, checked_destination
from tierkv.contract.jobs import JobMetadata, JobResult, ReqContext
from tierkv.contract.keys import OffloadKey
from tierkv.primary import MEDIUM as PRIMARY_MEDIUM
from tierkv.room import Kind

_SHED = "no room in the primary tier for a promotion within promotion_wait (load shed); recompute"
_CLOSING = "the cache is closing; recompute"


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
        self.slots: dict[OffloadKey, int] = {}  # slot of each key this call holds
        self.late: list[OffloadKey] = []  # held keys found resident after the start
        self.owed = 0  # blocks still to promote, counted in the prefetches' `owed`


class Promoter:
    stage1_windows = 2  # windows read from the tiers at once by one load

    def __init__(self, core: CacheCore, lookup: Lookup) -> None:
        self.core = core
        self.lookup = lookup
        self.prefetches = Prefetcher(core, lookup, self._run_flight)

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
        resident, in_flight, absent = primary.partition(s.first)
        to_promote = absent
        if in_flight:
            being_written = set(in_flight)
            for key in in_flight:
                if (flight := index.flight(key)) is not None:
                    flight.waiters[key] = flight.waiters.get(key, 0) + 1
                    s.waiting[key] = flight
                    being_written.discard(key)
            if being_written:  # written by a store: a promotion attempt reports it
                rest = being_written.union(absent)
                to_promote = [k for k in s.first if k in rest]
        if resident:
            s.slots.update(zip(resident, primary.prepare_load(resident)))
            s.holding.update(resident)
            s.sources.update(dict.fromkeys(resident, PRIMARY_MEDIUM))
        prefetches = self.prefetches
        if prefetches.active:  # after taking readers: what a prefetch lets go stays held
            prefetches.on_load(resident, ctx)
        try:
            # before the first await: a prefetch on_load woke must not take this room
            self._owe(s, len(to_promote))
            unknown = [k for k in to_promote if index.location(k) is None]
            if unknown:
                await self.lookup.locate(unknown, ctx)
                for key in unknown:
                    if index.location(key) is None:
                        s.errors[key] = "not found in any tier"
                to_promote = [k for k in to_promote if k not in s.errors]
                self._owe(s, len(to_promote) - s.owed)
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
            for key, flight in s.waiting.items():
                if key in s.collected:
                    continue
                if not flight.done.is_set():
                    flight.waiters[key] -= 1
                elif flight.granted.get(key, 0) > 0:
                    flight.granted[key] -= 1
                    primary.complete_load([key])
            self._owe(s, -s.owed)
            prefetches.changed()  # room this load held may let a waiting prefetch go on
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
        if s.late:  # blocks found resident while starting a window: held, copy them too
            keys = [*keys, *s.late]
            s.late.clear()
        if not keys:
            return
        primary = self.core.primary
        first, slot_of = s.first, s.slots
        indices = [first[k] for k in keys]
        slots = [slot_of[k] for k in keys]
        if s.repeats:
            for key in keys:
                for i in s.repeats.get(key, ()):
                    indices.append(i)
                    slots.append(slot_of[key])
        await dest.copy_from_slots(primary.view, indices, slots)
        s.loaded.update(keys)
        primary.complete_load(list(keys))
        s.holding.difference_update(keys)

    async def _pipeline(
        self,
        s: _LoadState,
        dest: BlockDestination,
        resident: list[OffloadKey],
        to_promote: list[OffloadKey],
        ctx: ReqContext,
    ) -> None:
        """Stage 1 in windows of the promotions' share (half of it when the request
        needs more, so two windows fit), overlapped with stage 2. With no room for the
        next window and nothing of this load in flight, wait for room up to
        `promotion_wait` in all; then shed the rest."""
        core = self.core
        primary = core.primary
        share = max(1, primary.promotion_share)
        window = share if len(to_promote) <= share else max(1, share // 2)
        inflight: deque[Flight] = deque()
        pos = 0
        budget = core.config.promotion_wait
        woken = False

        def fill(arriving: bool = False) -> None:
            """Keep stage 1 busy: a second window reads while the first does, when the
            share has room for it and no other load waits for room (else this load
            waits for its own window). A load `arriving` while others wait for room
            queues behind them rather than take the room first."""
            nonlocal pos
            if arriving and primary.waiting(Kind.PROMOTION):
                return
            while pos < len(to_promote) and len(inflight) < self.stage1_windows:
                if inflight and (
                    primary.waiting(Kind.PROMOTION)  # others wait: one window each
                    or primary.promotion_room() < min(window, len(to_promote) - pos)
                ):
                    return
                flight, moved = self._start(s, to_promote, pos, window, ctx)
                if moved == pos:
                    return  # no room now
                self._owe(s, pos - moved)
                pos = moved
                if flight is not None:
                    inflight.append(flight)

        if primary.promotion_room() >= min(window, len(to_promote)):
            fill(arriving=True)
            await self._copy_out(s, dest, resident)  # overlaps stage 1 of the first windows
        else:  # the room may be held by this load's own resident blocks: copy them out first
            await self._copy_out(s, dest, resident)
            fill(arriving=True)
        while inflight or pos < len(to_promote):
            if inflight:
                flight = inflight.popleft()
                await flight.done.wait()
                got = self._collect(s, flight, flight.keys)
                fill()
                await self._copy_out(s, dest, got)  # overlaps stage 1 of the next windows
                fill()
                continue
            await self._copy_out(s, dest, ())  # hold nothing while waiting
            if not core.is_open:
                self._shed(s, to_promote[pos:], _CLOSING)
                return
            need = min(window, len(to_promote) - pos)
            started, before = anyio.current_time(), pos
            woken = await primary.wait_for_room(Kind.PROMOTION, need, budget, again=woken)
            budget -= anyio.current_time() - started
            if woken:
                core.counters["promotion_waits"] += 1
            fill()
            woken = woken and pos == before  # woken but refused (a veto): keep the turn
            if not inflight and (not woken or budget <= 0) and pos < len(to_promote):
                rest = to_promote[pos:]
                self._shed(s, rest, _SHED)
                core.counters["promotions_shed"] += len(rest)
                return

    def _owe(self, s: _LoadState, blocks: int) -> None:
        """Count `blocks` more (or fewer) that this load has still to promote: room the
        prefetches leave to it (`Prefetcher.owed`)."""
        s.owed += blocks
        self.prefetches.owed += blocks

    def _shed(self, s: _LoadState, keys: Sequence[OffloadKey], why: str) -> None:
        for key in keys:
            s.errors[key] = why

    def _start(
        self,
        s: _LoadState,
        to_promote: list[OffloadKey],
        pos: int,
        window: int,
        ctx: ReqContext,
    ) -> tuple[Flight | None, int]:
        """Reserve slots for the next window and start its stage 1. Returns the flight
        (None when every key of the window was resident, followed or being stored) and
        the position past what was taken: `pos` itself when there is no room now."""
        core = self.core
        if not core.is_open:  # close() began: no new background work; the rest misses
            self._shed(s, to_promote[pos:], _CLOSING)
            return None, len(to_promote)
        primary, index = core.primary, core.index
        room = primary.promotion_room()
        if room <= 0:
            return None, pos
        chunk = to_promote[pos : pos + min(window, room)]
        mine = [k for k in chunk if index.flight(k) is None and k not in primary]
        prepared = primary.prepare_promotion(mine, may_evict=index.is_clean) if mine else None
        core.events.drain_primary()
        got = prepared.keys_to_store if prepared is not None else []
        refused = mine[len(got)] if len(got) < len(mine) else None
        flight = Flight(keys=got, waiters=dict.fromkeys(got, 1)) if got else None
        moved = pos
        for key in chunk:
            if key == refused:
                break  # no room for it (held or dirty blocks): a later window
            moved += 1
            if flight is not None and key in flight.waiters:
                index.set_flight(key, flight)
                s.waiting[key] = flight
            elif (other := index.flight(key)) is not None:  # another load promotes it
                other.waiters[key] = other.waiters.get(key, 0) + 1
                s.waiting[key] = other
            elif primary.is_ready(key):  # stored meanwhile: take it from the primary
                (s.slots[key],) = primary.prepare_load([key])
                s.holding.add(key)
                s.sources[key] = PRIMARY_MEDIUM
                s.late.append(key)
            else:
                s.errors[key] = "the block is being stored right now"
        if flight is not None and prepared is not None:
            core.spawn(self._run_flight, flight, prepared.slots, ctx)
        return flight, moved

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
            slot = self.core.primary.slot_of(key)
            assert slot is not None  # granted: this load holds a reader on it
            s.slots[key] = slot
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

    async def _run_flight(self, flight: Flight, slots: list[int], ctx: ReqContext) -> None:
        """Stage 1 of one window: read its keys into the slots reserved for them, then
        make them ready and give every load waiting on them a reader."""
        core = self.core
        primary, index = core.primary, core.index
        outcome = flight.outcome
        keys = flight.keys
        try:
            await self._read(keys, dict(zip(keys, slots)), outcome, ctx)
        finally:
            ok = [k for k in keys if outcome.get(k, (None, None))[0] is not None]
            failed = [k for k in keys if outcome.get(k, (None, None))[0] is None]
            # the loads waiting on the window get their readers as the blocks land, so
            # the slots never count as room someone else could be woken for
            waiting = {k: n for k, n in flight.waiters.items() if n > 0}
            primary.complete_store(ok, success=True, readers=waiting)
            if failed:
                primary.complete_store(failed, success=False)
            core.events.drain_primary()
            for key in keys:
                outcome.setdefault(key, (None, "promotion cancelled"))
                index.end_flight(key, flight)
            for key in ok:
                if key in waiting:
                    flight.granted[key] = waiting[key]
            flight.done.set()
            self.prefetches.changed()

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
        asked_below: set[OffloadKey] = set()
        remaining = keys
        while remaining:
            by_tier: dict[int, list[OffloadKey]] = {}
            floors: dict[OffloadKey, int] = {}
            for key in remaining:
                t = self._next_tier(key, tried.get(key, -1))
                if t is not None:
                    by_tier.setdefault(t, []).append(key)
                elif key not in asked_below:  # once: the tiers below nobody asked
                    asked_below.add(key)
                    # below the tier that failed it, or (none tried: the tier it was
                    # located in is unusable now) below that one
                    floor = tried.get(key)
                    if floor is None:
                        floor = core.index.location(key)
                    floors[key] = -1 if floor is None else floor
                else:
                    outcome[key] = (None, last_error.get(key, "not found in any tier"))
            if floors:
                found = await self.lookup.ask_below(floors, ctx)
                if found:
                    core.counters["load_fallbacks"] += len(found)
                for key in floors:
                    if key in found:
                        by_tier.setdefault(found[key], []).append(key)
                    else:
                        outcome[key] = (None, last_error.get(key, "not found in any tier"))
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
