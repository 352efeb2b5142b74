"""Stage 1 of a promotion: one window of keys read from the tiers into the primary.

Loads (`tierkv.cache.promotion`) and prefetches (`tierkv.cache.prefetch`) both promote
through a `FlightRunner`: `start` reserves slots from the primary's promotion share
for the keys of a window that nobody holds or promotes yet, points the index at the
window's `Flight`, and reads the window in the cache's task group (a cancelled load
never strands a reservation). Each key is read from the tier lookup located it in; the
tiers holding parts of one window are read concurrently; a tier that fails a key hands
it to the next tier down the chain believed to hold it, and when none is left the
tiers nobody asked are asked once (`Lookup.ask_below`). When the window lands, its
blocks become ready with one reader for each waiter, and waiting prefetches are told
room may have been released.
"""

from __future__ import annotations

import anyio

from tierkv.cache.core import CacheCore
from tierkv.cache.index import Flight
from tierkv.cache.lookup import Lookup
from tierkv.contract.jobs import JobMetadata, ReqContext
from tierkv.contract.keys import OffloadKey
from tierkv.driver import JobOutcome
from tierkv.driver.guarded import AbandonedJob


class FlightRunner:
    """Starts and reads promotion windows for every load and prefetch of one cache."""

    def __init__(self, core: CacheCore, lookup: Lookup) -> None:
        self.core = core
        self.lookup = lookup

    def start(
        self, chunk: list[OffloadKey], ctx: ReqContext
    ) -> tuple[Flight | None, OffloadKey | None]:
        """Reserve slots for the longest prefix of `chunk`'s keys nobody holds or
        promotes that the promotion room takes (evicting only clean blocks), and start
        reading them. Returns the window's flight (None when it took no slot) and the
        first key refused for lack of room (None when none was)."""
        core = self.core
        primary, index = core.primary, core.index
        mine = [k for k in chunk if index.flight(k) is None and k not in primary]
        if not mine:
            return None, None
        prepared = primary.prepare_promotion(mine, may_evict=index.is_clean, tenant=ctx.tenant)
        got = prepared.keys_to_store
        refused = mine[len(got)] if len(got) < len(mine) else None
        if not got:
            return None, refused
        flight = Flight(got)
        for key in got:
            index.set_flight(key, flight)
        core.spawn(self.run, flight, prepared.slots, ctx)
        return flight, refused

    async def run(self, flight: Flight, slots: list[int], ctx: ReqContext) -> None:
        """Stage 1 of one window: read its keys into the slots reserved for them, then
        make them ready and give every load waiting on them a reader."""
        core = self.core
        primary, index = core.primary, core.index
        keys = flight.keys
        stuck: dict[OffloadKey, AbandonedJob] = {}  # keys of tier jobs left running
        try:
            await self._read(flight, dict(zip(keys, slots)), ctx, stuck)
        finally:
            ok, failed = flight.read_keys()
            # the loads waiting on the window get their readers as the blocks land, so
            # the slots never count as room someone else could be woken for
            waiting = flight.waiting()
            primary.complete_store(ok, success=True, readers=waiting)
            core.tenants.placed(ctx.tenant, ok)  # promoted for this load's tenant
            if stuck:  # their slots stay the tier's until its job ends
                self._quarantine([k for k in failed if k in stuck], stuck)
                failed = [k for k in failed if k not in stuck]
            if failed:
                primary.complete_store(failed, success=False)
            for key in keys:
                index.end_flight(key, flight)
            flight.finish(waiting)
            core.room_changed.notify()

    def _next_tier(self, key: OffloadKey, after: int) -> int | None:
        """The next tier below `after` believed to hold `key` and healthy enough."""
        mask = self.core.index.held(key) >> (after + 1)
        i = after + 1
        while mask:
            if mask & 1:
                handle = self.core.tiers[i]
                if handle.usable("load"):
                    return i
                handle.stats.skipped_unhealthy += 1
            mask >>= 1
            i += 1
        return None

    def _quarantine(self, keys: list[OffloadKey], stuck: dict[OffloadKey, AbandonedJob]) -> None:
        """Hold the slots of `keys`, whose tier job was left running at its deadline,
        until that job ends (`PrimaryTier.quarantine`): it may still write them."""
        primary = self.core.primary
        by_job: dict[AbandonedJob, list[OffloadKey]] = {}
        for key in keys:
            by_job.setdefault(stuck[key], []).append(key)
        for job, held in by_job.items():
            slots = primary.quarantine(held)

            def release(slots: list[int] = slots) -> None:
                primary.release(slots)
                self.core.room_changed.notify()

            self.core.hold_until_ended(job, release)

    async def _read(
        self,
        flight: Flight,
        slot_of: dict[OffloadKey, int],
        ctx: ReqContext,
        stuck: dict[OffloadKey, AbandonedJob],
    ) -> None:
        """Read the window's keys into their slots: each from its located tier, the
        tiers of one round concurrently; a failed key moves on down the chain, unless
        its job was left running (`stuck`): its slot is the tier's still."""
        core = self.core
        tried: dict[OffloadKey, int] = {}
        last_error: dict[OffloadKey, str] = {}
        asked_below: set[OffloadKey] = set()
        remaining = flight.keys
        while remaining:
            by_tier = await self._route(flight, remaining, tried, last_error, asked_below, ctx)
            if not by_tier:
                return
            results: dict[int, JobOutcome] = {}
            if len(by_tier) == 1:
                ((t, ks),) = by_tier.items()
                await self._read_from(t, ks, slot_of, ctx, results)
            else:
                async with anyio.create_task_group() as tg:
                    for t, ks in by_tier.items():
                        tg.start_soon(self._read_from, t, ks, slot_of, ctx, results)
            remaining = []
            for t, outcome in results.items():
                name = core.tiers[t].name
                result = outcome.result
                for key in result.ok_keys:
                    flight.served(key, name)
                refused = outcome.failure == "refused"  # never asked: its claim stands
                if outcome.abandoned is not None:  # may still write: no other tier may
                    for key in result.failed_keys:
                        core.index.note_failed(key, t)
                        stuck[key] = outcome.abandoned
                        flight.failed(key, result.error or f"tier {name} timed out")
                    continue
                for key in result.failed_keys:
                    if not refused:
                        core.index.note_failed(key, t)
                    last_error[key] = result.error or f"tier {name} could not load it"
                    tried[key] = t
                    remaining.append(key)

    async def _route(
        self,
        flight: Flight,
        remaining: list[OffloadKey],
        tried: dict[OffloadKey, int],
        last_error: dict[OffloadKey, str],
        asked_below: set[OffloadKey],
        ctx: ReqContext,
    ) -> dict[int, list[OffloadKey]]:
        """The tier to read each of `remaining` from next: the next one believed to
        hold it, else (once per key) one the tiers below answer for; a key with
        neither fails."""
        core = self.core
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
                flight.failed(key, last_error.get(key, "not found in any tier"))
        if floors:
            found = await self.lookup.ask_below(floors, ctx)
            if found:
                core.counters.load_fallbacks += len(found)
            for key in floors:
                if key in found:
                    by_tier.setdefault(found[key], []).append(key)
                else:
                    flight.failed(key, last_error.get(key, "not found in any tier"))
        return by_tier

    async def _read_from(
        self,
        t: int,
        keys: list[OffloadKey],
        slot_of: dict[OffloadKey, int],
        ctx: ReqContext,
        results: dict[int, JobOutcome],
    ) -> None:
        core = self.core
        job = JobMetadata(core.next_job_id(), tuple(keys), tuple(slot_of[k] for k in keys), ctx)
        results[t] = await core.tiers[t].run("load", job, abandon=True)
