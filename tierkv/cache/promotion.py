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
promoted block when it lands. Stage 1 is the `FlightRunner`'s (`tierkv.cache.flights`):
every window runs in the cache's task group, so a cancelled load never strands a
reservation.

Prefetches (`tierkv.cache.prefetch`) run the same stage 1 for queued requests; a load
joins their windows like any other, and ends the prefetch of its own request. The
blocks a load has still to promote are owed to it (`Prefetcher.owe`): no prefetch
takes that room first. When the load ends, however it ends, the claims its request's
lookup took in the tiers on its keys end too (`tierkv.driver.claims`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from types import MappingProxyType

import anyio

from tierkv.blocks import BlockDestination
from tierkv.cache.core import CacheCore
from tierkv.cache.flights import FlightRunner
from tierkv.cache.index import Flight
from tierkv.cache.lookup import Lookup
from tierkv.cache.prefetch import Prefetcher
from tierkv.cache.results import LoadResult
from tierkv.cache.validate import check_keys, checked_destination
from tierkv.contract.jobs import ReqContext
from tierkv.contract.keys import OffloadKey
from tierkv.primary import MEDIUM as PRIMARY_MEDIUM
from tierkv.room import Kind

_SHED = "no room in the primary tier for a promotion within promotion_wait (load shed); recompute"
_CLOSING = "the cache is closing; recompute"


class _LoadState:
    """The bookkeeping of one `load` call, so its `finally` can give back exactly what
    it took."""

    def __init__(self, keys: list[OffloadKey], ctx: ReqContext) -> None:
        self.ctx = ctx
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
        self.owed = 0  # blocks still to promote, owed to this load by the prefetches
        # the promotion pipeline: keys to promote, how far windows have taken them,
        # the windows reading now, the window size, and the wait left for room
        self.to_promote: list[OffloadKey] = []
        self.pos = 0
        self.inflight: deque[Flight] = deque()
        self.window = 1
        self.budget = 0.0
        self.woken = False

    def wait_on(self, key: OffloadKey, flight: Flight) -> None:
        """Join `flight` for `key`: its block comes to this load when the window lands."""
        flight.join(key)
        self.waiting[key] = flight

    def hold(self, keys: Sequence[OffloadKey], slots: Sequence[int], medium: str) -> None:
        """This load took a reader on each of `keys` (in `slots`), served by `medium`."""
        self.slots.update(zip(keys, slots))
        self.holding.update(keys)
        self.sources.update(dict.fromkeys(keys, medium))

    def shed(self, keys: Sequence[OffloadKey], why: str) -> None:
        for key in keys:
            self.errors[key] = why

    def result(self) -> LoadResult:
        loaded, first = self.loaded, self.first
        ok: tuple[OffloadKey, ...]
        failed: tuple[OffloadKey, ...]
        if len(loaded) == len(first):
            ok, failed = tuple(first), ()
        else:
            ok = tuple(k for k in first if k in loaded)
            failed = tuple(k for k in first if k not in loaded)
        return LoadResult(
            ok_keys=ok,
            failed_keys=failed,
            errors=MappingProxyType({k: self.errors.get(k, "not loaded") for k in failed}),
            sources=MappingProxyType({k: self.sources[k] for k in ok}),
        )


class Promoter:
    stage1_windows = 2  # windows read from the tiers at once by one load

    def __init__(self, core: CacheCore, lookup: Lookup) -> None:
        self.core = core
        self.lookup = lookup
        self.flights = FlightRunner(core, lookup)
        self.prefetches = Prefetcher(core, lookup, self.flights)

    async def load(
        self, keys: Sequence[OffloadKey], destination: object, ctx: ReqContext
    ) -> LoadResult:
        """Take the resident keys, join the windows already reading the others,
        promote the rest in windows, and copy everything out; the `finally` gives
        back every reader and everything owed, whatever happened."""
        core = self.core
        core.check_open()
        keys = list(keys)
        check_keys(keys, "keys")
        dest = checked_destination(destination, len(keys), core.block_bytes, core.primary.view)
        s = _LoadState(keys, ctx)
        resident = self._begin(s)
        prefetches = self.prefetches
        if prefetches.active:  # after taking readers: what a prefetch lets go stays held
            prefetches.on_load(resident, ctx)
        try:
            # before the first await: a prefetch on_load woke must not take this room
            self._owe(s, len(s.to_promote))
            await self._locate(s)
            await self._pipeline(s, dest, resident)
            await self._follow(s, dest)
        finally:
            self._let_go(s)
        stats = core.primary_stats
        stats.load_jobs += 1
        stats.blocks_loaded += len(s.loaded)
        stats.bytes_out += len(s.loaded) * core.block_bytes
        result = s.result()
        core.tenants.loaded(ctx.tenant, len(result.ok_keys), len(result.failed_keys))
        return result

    def _begin(self, s: _LoadState) -> list[OffloadKey]:
        """Sort the keys: take a reader on the resident ones (returned), join the
        windows promoting others, and leave the rest (absent, or being written by a
        store: a promotion attempt reports it) in `s.to_promote`."""
        primary, index = self.core.primary, self.core.index
        resident, in_flight, absent = primary.partition(s.first)
        to_promote = absent
        if in_flight:
            being_written = set(in_flight)
            for key in in_flight:
                if (flight := index.flight(key)) is not None:
                    s.wait_on(key, flight)
                    being_written.discard(key)
            if being_written:  # written by a store: a promotion attempt reports it
                rest = being_written.union(absent)
                to_promote = [k for k in s.first if k in rest]
        if resident:
            s.hold(resident, primary.prepare_load(resident), PRIMARY_MEDIUM)
        s.to_promote = to_promote
        return resident

    async def _locate(self, s: _LoadState) -> None:
        """Ask the tiers where the keys to promote that the index cannot place are;
        those no tier has fail now."""
        index = self.core.index
        unknown = [k for k in s.to_promote if index.location(k) is None]
        if not unknown:
            return
        await self.lookup.locate(unknown, s.ctx)
        for key in unknown:
            if index.location(key) is None:
                s.errors[key] = "not found in any tier"
        s.to_promote = [k for k in s.to_promote if k not in s.errors]
        self._settle(s, s.owed - len(s.to_promote))

    async def _follow(self, s: _LoadState, dest: BlockDestination) -> None:
        """Wait for the windows others started that this load joined, and copy out
        what they brought."""
        followers: dict[int, tuple[Flight, list[OffloadKey]]] = {}
        for key, flight in s.waiting.items():
            if key not in s.collected:
                followers.setdefault(id(flight), (flight, []))[1].append(key)
        late: list[OffloadKey] = []
        for flight, ks in followers.values():
            await flight.wait()
            late.extend(self._collect(s, flight, ks))
        await self._copy_out(s, dest, late)

    def _let_go(self, s: _LoadState) -> None:
        """Give back every reader this load still holds or was granted, leave the
        windows it no longer waits for, settle what the prefetches owed it, and end
        the claims its request's lookup took on these keys (read or not: the load
        is over)."""
        primary = self.core.primary
        if s.ctx.request_id is None:  # the claims of the lookup this load serves
            self.core.claims.let_go_loaded(s.first)
        else:
            self.core.claims.let_go(s.ctx.request_id, s.first)
        if s.holding:
            primary.complete_load(list(s.holding))
            s.holding.clear()
        for key, flight in s.waiting.items():
            if key in s.collected:
                continue
            if not flight.landed:
                flight.leave(key)
            elif flight.take(key) is not None:
                primary.complete_load([key])
        self._settle(s, s.owed)
        self.core.room_changed.notify()  # room this load held may let a prefetch go on

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
        self, s: _LoadState, dest: BlockDestination, resident: list[OffloadKey]
    ) -> None:
        """Stage 1 in windows of the promotions' share (half of it when the request
        needs more, so two windows fit), overlapped with stage 2. With no room for the
        next window and nothing of this load in flight, wait for room up to
        `promotion_wait` in all; then shed the rest."""
        primary = self.core.primary
        share = max(1, primary.promotion_share)
        s.window = share if len(s.to_promote) <= share else max(1, share // 2)
        s.budget = self.core.config.promotion_wait
        if primary.promotion_room() >= min(s.window, len(s.to_promote)):
            self._fill(s, arriving=True)
            await self._copy_out(s, dest, resident)  # overlaps stage 1 of the first windows
        else:  # the room may be held by this load's own resident blocks: copy them out first
            await self._copy_out(s, dest, resident)
            self._fill(s, arriving=True)
        while s.inflight or s.pos < len(s.to_promote):
            if s.inflight:
                flight = s.inflight.popleft()
                await flight.wait()
                got = self._collect(s, flight, flight.keys)
                self._fill(s)
                await self._copy_out(s, dest, got)  # overlaps stage 1 of the next windows
                self._fill(s)
            elif not await self._wait_for_room(s, dest):
                return

    async def _wait_for_room(self, s: _LoadState, dest: BlockDestination) -> bool:
        """Nothing of this load is in flight and there is no room for its next window:
        wait for room (holding nothing), within what is left of `promotion_wait`.
        False when the rest was shed (no room in time, or the cache is closing)."""
        core = self.core
        primary = core.primary
        await self._copy_out(s, dest, ())  # hold nothing while waiting
        if not core.is_open:
            s.shed(s.to_promote[s.pos :], _CLOSING)
            return False
        need = min(s.window, len(s.to_promote) - s.pos)
        started, before = anyio.current_time(), s.pos
        woken = await primary.wait_for_room(Kind.PROMOTION, need, s.budget, again=s.woken)
        s.budget -= anyio.current_time() - started
        if woken:
            core.counters.promotion_waits += 1
        self._fill(s)
        s.woken = woken and s.pos == before  # woken but refused (a veto): keep the turn
        if not s.inflight and (not s.woken or s.budget <= 0) and s.pos < len(s.to_promote):
            rest = s.to_promote[s.pos :]
            s.shed(rest, _SHED)
            core.counters.promotions_shed += len(rest)
            return False
        return True

    def _fill(self, s: _LoadState, arriving: bool = False) -> None:
        """Keep stage 1 busy: a second window reads while the first does, when the
        share has room for it and no other load waits for room (else this load waits
        for its own window). A load `arriving` while others wait for room queues
        behind them rather than take the room first."""
        primary = self.core.primary
        if arriving and primary.waiting(Kind.PROMOTION):
            return
        while s.pos < len(s.to_promote) and len(s.inflight) < self.stage1_windows:
            if s.inflight and (
                primary.waiting(Kind.PROMOTION)  # others wait: one window each
                or primary.promotion_room() < min(s.window, len(s.to_promote) - s.pos)
            ):
                return
            flight, moved = self._start(s)
            if moved == s.pos:
                return  # no room now
            self._settle(s, moved - s.pos)
            s.pos = moved
            if flight is not None:
                s.inflight.append(flight)

    def _owe(self, s: _LoadState, blocks: int) -> None:
        """This load has `blocks` more to promote: room the prefetches leave to it."""
        s.owed += blocks
        self.prefetches.owe(blocks)

    def _settle(self, s: _LoadState, blocks: int) -> None:
        """`blocks` of what this load owed are promoted, joined or given up."""
        s.owed -= blocks
        self.prefetches.settle(blocks)

    def _start(self, s: _LoadState) -> tuple[Flight | None, int]:
        """Start the next window (`FlightRunner.start`) and take the rest of its keys
        as they stand. Returns the flight (None when every key of the window was
        resident, followed or being stored) and the position past what was taken:
        `s.pos` itself when there is no room now."""
        core = self.core
        to_promote, pos = s.to_promote, s.pos
        if not core.is_open:  # close() began: no new background work; the rest misses
            s.shed(to_promote[pos:], _CLOSING)
            return None, len(to_promote)
        primary, index = core.primary, core.index
        room = primary.promotion_room()
        if room <= 0:
            return None, pos
        chunk = to_promote[pos : pos + min(s.window, room)]
        flight, refused = self.flights.start(chunk, s.ctx)
        moved = pos
        for key in chunk:
            if key == refused:
                break  # no room for it (held or dirty blocks): a later window
            moved += 1
            if flight is not None and key in flight:
                s.waiting[key] = flight
            elif (other := index.flight(key)) is not None:  # another load promotes it
                s.wait_on(key, other)
            elif primary.is_ready(key):  # stored meanwhile: take it from the primary
                s.hold([key], primary.prepare_load([key]), PRIMARY_MEDIUM)
                s.late.append(key)
            else:
                s.errors[key] = "the block is being stored right now"
        return flight, moved

    def _collect(
        self, s: _LoadState, flight: Flight, keys: Sequence[OffloadKey]
    ) -> list[OffloadKey]:
        """Take this load's share of a finished flight: keys now held, or errors."""
        got: list[OffloadKey] = []
        for key in keys:
            if key not in s.collected:
                s.collected.add(key)
                medium = flight.take(key)
                if medium is None:
                    s.errors[key] = flight.error(key)
                    continue
                slot = self.core.primary.slot_of(key)
                assert slot is not None  # granted: this load holds a reader on it
                s.hold([key], [slot], medium)
                got.append(key)
        return got
