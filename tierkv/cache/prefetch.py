"""Prefetch for queued requests: stage 1 of their promotion, ahead of their turn.

A server that knows its queue calls `TieredCache.prefetch(keys_per_group, ctx)` for a
request it has queued. The call checks its arguments and returns a `Prefetch` handle
at once; one background task (in the cache's task group) then finds which of the
request's hit blocks are in a lower tier but not in the primary (asking the tiers
only about keys the index cannot place, and keeping only the prefix every group can
serve, as `lookup` does), and promotes them into the primary in windows, exactly as a
load's stage 1 does (same `Flight`s, same reads down the chain), with no copy out.

Each promoted block keeps one reader for the prefetch, so it cannot be evicted before
the request runs. The request's own `load` (same `ctx.request_id`) ends the prefetch:
blocks that landed are primary hits, windows still reading are joined (single flight,
one tier read per key), and the prefetch lets go of every reader it holds, so the
blocks become ordinary evictable primary blocks once the load is done with them.
`cancel_prefetch(request_id)` (an aborted request) does the same without a load;
`close()` cancels what is left. A window already reading when its prefetch ends
finishes: its blocks land as ordinary evictable blocks (a tier job is never cut off
half-written, and a load may be waiting on it).

Running requests always win. Prefetches together hold at most `prefetch_share` of
the promotion reserve (slots being read plus blocks held), so loads keep the rest;
a prefetch starts no window while a load waits for promotion room, and never waits
in the room's queue itself (a load arriving later would queue behind it). With no
room, `best_effort` stops at once and sheds the rest (`prefetch_shed`); `wait`
looks again whenever a promotion lands or a load or prefetch lets go of blocks (and
every `_POLL` seconds, for room a cascade releases) up to its `timeout` in all.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

import anyio

from tierkv.cache.core import CacheCore
from tierkv.cache.flights import FlightRunner
from tierkv.cache.index import Flight
from tierkv.cache.lookup import Lookup
from tierkv.cache.results import LookupResult
from tierkv.cache.validate import check_keys
from tierkv.contract.jobs import ReqContext
from tierkv.contract.keys import OffloadKey
from tierkv.hits import combine_group_hits
from tierkv.room import Kind

logger = logging.getLogger(__name__)

PrefetchPolicy = Literal["best_effort", "wait"]

_POLL = 0.01  # a waiting prefetch also looks for room this often (cascades release it)


class Prefetch:
    """One prefetch, as `TieredCache.prefetch` hands it back.

    `promoted`: keys it brought into the primary; `held`: those it still holds a
    reader on (until its request loads, `cancel()`, or close); `shed`: keys it did not
    promote for lack of budget or room; `failed`: keys whose read failed, with the
    reason. `done` once its promotions are over (landed, shed, failed or cancelled);
    `await wait()` waits for that.
    """

    def __init__(
        self,
        owner: Prefetcher,
        source: Sequence[Sequence[OffloadKey]] | LookupResult,
        ctx: ReqContext,
        policy: PrefetchPolicy,
        timeout: float,
    ) -> None:
        self._owner = owner
        self._source = source
        self.ctx = ctx
        self.request_id = ctx.request_id
        self.policy: PrefetchPolicy = policy
        self.timeout = timeout
        self.promoted: list[OffloadKey] = []
        self.held: set[OffloadKey] = set()
        self.used: set[OffloadKey] = set()  # promoted keys a load has read
        self.shed: list[OffloadKey] = []
        self.failed: dict[OffloadKey, str] = {}
        self.ended = False  # released: starts no window, holds nothing once its window lands
        self.window: Flight | None = None  # the window reading now
        self._done = anyio.Event()
        self._released = anyio.Event()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    async def wait(self) -> None:
        """Wait until this prefetch's promotions are over."""
        await self._done.wait()

    def cancel(self) -> None:
        """Let go of everything this prefetch holds (see `TieredCache.cancel_prefetch`)."""
        self._owner.release(self, cancelled=True)

    def __repr__(self) -> str:
        state = "done" if self.done else "running"
        return (
            f"Prefetch(request_id={self.request_id!r}, {state}, promoted={len(self.promoted)}, "
            f"held={len(self.held)}, shed={len(self.shed)}, failed={len(self.failed)})"
        )


class Prefetcher:
    """Every prefetch of one cache, and the budget they share."""

    def __init__(self, core: CacheCore, lookup: Lookup, flights: FlightRunner) -> None:
        self.core = core
        self.lookup = lookup
        self.flights = flights  # stage 1, shared with the loads
        self._by_request: dict[str, list[Prefetch]] = {}
        self._holder: dict[OffloadKey, Prefetch] = {}  # landed keys a prefetch holds
        self.holding = 0  # slots prefetches hold now: windows reading plus blocks held
        # blocks the running loads have still to promote: the promotion room they will
        # take, which no prefetch may take first (loads `owe` and `settle` it)
        self._owed = 0

    @property
    def budget(self) -> int:
        """Slots all prefetches together may hold: `prefetch_share` of the reserve."""
        return int(self.core.config.prefetch_share * self.core.primary.promotion_share)

    @property
    def active(self) -> bool:
        return bool(self._by_request or self._holder)

    @property
    def waiting_for_room(self) -> int:
        """Prefetches now waiting for room (policy `wait`, none free): each resumes when
        blocks are let go or room is released, or gives up at its deadline."""
        return self.core.room_changed.waiting

    @property
    def owed(self) -> int:
        """Blocks the running loads have still to promote."""
        return self._owed

    def owe(self, blocks: int) -> None:
        """A load has `blocks` more to promote: room no prefetch may take first."""
        self._owed += blocks

    def settle(self, blocks: int) -> None:
        """A load promoted, joined or gave up `blocks` of what it was owed."""
        self._owed -= blocks

    # -- the calls --------------------------------------------------------------------
    def start(
        self,
        source: Sequence[Sequence[OffloadKey]] | LookupResult,
        ctx: ReqContext,
        policy: PrefetchPolicy,
        timeout: float | None,
    ) -> Prefetch:
        """Check the arguments, register the prefetch and start its task."""
        core = self.core
        tg = core.check_open()
        if ctx.request_id is None:
            raise ValueError(
                "prefetch needs ctx.request_id: the request's load or "
                "cancel_prefetch(request_id) is what releases the blocks it holds"
            )
        if policy == "best_effort":
            if timeout is not None:
                raise ValueError("timeout applies to policy='wait', not 'best_effort'")
            wait = 0.0
        elif policy == "wait":
            if (
                isinstance(timeout, bool)
                or not isinstance(timeout, int | float)
                or not 0 < timeout < float("inf")
            ):
                raise ValueError(
                    f"policy='wait' needs a timeout in seconds > 0, got timeout={timeout!r}"
                )
            wait = float(timeout)
        else:
            raise ValueError(f"policy must be 'best_effort' or 'wait', got {policy!r}")
        if not isinstance(source, LookupResult):
            groups = core.config.layout.groups
            if isinstance(source, bytes | str) or len(source) != len(groups):
                raise ValueError(
                    "prefetch takes one sequence of keys per KV-cache group (or a "
                    f"LookupResult); the layout has {len(groups)} groups"
                )
            source = [list(keys) for keys in source]
            for g, keys in enumerate(source):
                check_keys(keys, f"keys_per_group[{g}]")
        p = Prefetch(self, source, ctx, policy, wait)
        self._by_request.setdefault(ctx.request_id, []).append(p)
        tg.start_soon(self._drive, p)
        return p

    def cancel(self, request_id: str) -> int:
        """Release every prefetch of `request_id`; how many there were."""
        prefetches = self._by_request.get(request_id, [])
        n = len(prefetches)
        for p in list(prefetches):
            self.release(p, cancelled=True)
        return n

    def on_load(self, resident: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """A load began and holds its own readers on `resident`: count the prefetched
        blocks among them as used, and end the prefetches of its request."""
        holder = self._holder
        if holder:
            counters = self.core.counters
            for key in resident:
                p = holder.get(key)
                if p is not None and key not in p.used:
                    p.used.add(key)
                    counters.prefetch_used += 1
        rid = ctx.request_id
        if rid is not None and rid in self._by_request:
            for p in list(self._by_request[rid]):
                self.release(p, cancelled=False)

    def release(self, p: Prefetch, *, cancelled: bool) -> None:
        """End `p`: no new window; its held blocks become ordinary evictable blocks
        (the window reading now lets go of its blocks when it lands). Idempotent."""
        if p.ended:
            return
        p.ended = True
        core = self.core
        if cancelled:
            unused = sum(1 for k in p.held if k not in p.used)
            reading = len(p.window.keys) if p.window is not None else 0
            core.counters.prefetch_cancelled += unused + reading
        if p.held:
            held = list(p.held)
            p.held.clear()
            for key in held:
                if self._holder.get(key) is p:
                    del self._holder[key]
            self.holding -= len(held)
            core.primary.complete_load(held)
        mine = self._by_request.get(p.request_id or "")
        if mine is not None and p in mine:
            mine.remove(p)
            if not mine:
                del self._by_request[p.request_id or ""]
        p._released.set()
        core.room_changed.notify()

    # -- the background task -----------------------------------------------------------
    async def _drive(self, p: Prefetch) -> None:
        """Find the targets, promote them, then hold them until released. Runs in the
        cache's task group outside its background count (`flush` waits for the windows,
        each a background job, not for a prefetch holding blocks); close() cancels it."""
        try:
            try:
                targets = await self._targets(p)
                await self._promote(p, targets)
            finally:
                p._done.set()
            if p.held and not p.ended:
                await p._released.wait()
        except Exception:  # a bug in our own bookkeeping: log, never kill the group
            logger.exception("prefetch for request %s failed", p.request_id)
        finally:
            self.release(p, cancelled=False)

    async def _targets(self, p: Prefetch) -> list[OffloadKey]:
        """The keys of the request's hit that only a lower tier holds, in order."""
        core = self.core
        primary, index = core.primary, core.index
        source = p._source
        if isinstance(source, LookupResult):
            keys = list(dict.fromkeys(source.keys_to_load))
            unknown = [k for k in keys if k not in primary and index.location(k) is None]
            if unknown and core.is_open:
                await self.lookup.locate(unknown, p.ctx)
        else:
            missing = list(
                dict.fromkeys(
                    k for ks in source for k in ks if k not in primary and index.location(k) is None
                )
            )
            if missing and core.is_open:
                await self.lookup.locate(missing, p.ctx)
            present = [[k in primary or index.location(k) is not None for k in ks] for ks in source]
            _, ranges = combine_group_hits(core.config.layout.groups, present)
            keys = list(
                dict.fromkeys(k for ks, r in zip(source, ranges) for k in ks[r.first : r.end])
            )
        return [
            k
            for k in keys
            if k not in primary and index.flight(k) is None and index.location(k) is not None
        ]

    def room(self) -> int:
        """Slots the next prefetch window may take: none while a load waits for room, and never
        the room running loads have still to take (`owed`)."""
        primary = self.core.primary
        if primary.waiting(Kind.PROMOTION):
            return 0
        return max(0, min(self.budget - self.holding, primary.promotion_room() - self._owed))

    async def _promote(self, p: Prefetch, targets: list[OffloadKey]) -> None:
        """Stage 1 of `targets` in windows within the budget, one window at a time."""
        core = self.core
        deadline = anyio.current_time() + p.timeout
        pos = 0
        while pos < len(targets) and not p.ended and core.is_open:
            room = self.room()
            if room > 0:
                moved, flight = self._start_window(p, targets, pos, room)
                if moved > pos:
                    pos = moved
                    if flight is not None:
                        await self._await_window(p, flight)
                    continue
            # no room now: best_effort stops; wait looks again until its deadline,
            # unless it alone holds the whole budget (waiting cannot help then)
            left = deadline - anyio.current_time()
            if left <= 0 or (self.holding >= self.budget and self.holding == len(p.held)):
                break
            with anyio.move_on_after(min(left, _POLL)):
                await core.room_changed.wait()
        if pos < len(targets) and not p.ended and core.is_open:
            p.shed.extend(targets[pos:])
            core.counters.prefetch_shed += len(targets) - pos

    def _start_window(
        self, p: Prefetch, targets: list[OffloadKey], pos: int, room: int
    ) -> tuple[int, Flight | None]:
        """Start the next window (keys resident or promoted by someone else meanwhile
        are skipped). Returns the position past what was taken (`pos` when nothing
        could be) and the window's flight (None when it took no slot)."""
        chunk = targets[pos : pos + room]
        flight, refused = self.flights.start(chunk, p.ctx)
        # a refused key has no room: it and the rest wait for a later window, or shed
        moved = pos + (chunk.index(refused) if refused is not None else len(chunk))
        if flight is not None:
            self.holding += len(flight.keys)
            p.window = flight
        return moved, flight

    async def _await_window(self, p: Prefetch, flight: Flight) -> None:
        """Wait for the window to land, then take (or, once ended, let go of) the reader
        it gives this prefetch on each block."""
        core = self.core
        primary, counters = core.primary, core.counters
        try:
            await flight.wait()
        finally:
            p.window = None
            landed = flight.landed
            for key in flight.keys:
                if not landed:  # cancelled (close): no reader for a prefetch that is gone
                    flight.leave(key)
                    p.failed[key] = "prefetch cancelled"
                    self.holding -= 1
                    continue
                if flight.take(key) is None:
                    p.failed[key] = flight.error(key)
                    self.holding -= 1
                    continue
                p.promoted.append(key)
                counters.prefetched_blocks += 1
                if flight.waiters(key) > 1:  # a load joined the window
                    p.used.add(key)
                    counters.prefetch_used += 1
                if p.ended:
                    primary.complete_load([key])
                    self.holding -= 1
                else:
                    p.held.add(key)
                    self._holder[key] = p
            core.room_changed.notify()
