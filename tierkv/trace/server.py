"""A queued replay: the trace served by a modelled server that prefetches for the
requests waiting in its queue, through the real `TieredCache.prefetch`.

The server (`ServerClock`, in server time: trace seconds times the arrival scale)
runs one prefill at a time in arrival order; a request's service is its loads plus
its prefill from the cost model. While a request waits, the replay calls
`cache.prefetch` for it once it is among the next `depth` queued requests (at its
arrival, or when the queue ahead of it moves up). When its turn comes, its `load`
(same request id) takes over what the prefetch promoted (single flight, counted by the
cache as `prefetch_used`). A request its client abandons (`abandon`, the same requests
in every run) leaves the queue at its turn without being served, and the replay calls
`cancel_prefetch` for it.

Events run in server-time order against the real cache: arrivals during a request's
service are queued (and prefetched for) after its load and before its store, as they
would be while its prefill runs. Real tier reads of a prefetch take real time, which
has nothing to do with server time; so after every event the replay lets the cache
settle (`ReplayChain` flushes, and `_settle` waits until every prefetch is done or
waiting for room there is none of), and puts each prefetch's reads on the clock's
prefetch channel at the tier's modelled bandwidth. A block read by the request's
start counts as a primary hit in its TTFT, the rest at the tier's speed. So the
result depends on the trace and the chain only, not on this machine's speed.

The `wait` policy's timeout is real seconds; a waiting prefetch ends anyway at its
request's turn, so a long timeout (the default) means "wait as long as it is queued".
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from tierkv.cache import TieredCache
from tierkv.cache.prefetch import Prefetch, PrefetchPolicy
from tierkv.contract.keys import OffloadKey
from tierkv.trace.costmodel import CostModel, PrefetchedBytes, ServerClock, ttft_summary
from tierkv.trace.format import TraceRequest
from tierkv.trace.replay import ReplayChain, ReplayOptions, ReplayReport, request_context

_STALL = 0.05  # real seconds a settle waits for prefetches that change nothing
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerOptions:
    """The modelled server: arrivals times `arrival_scale` (below 1: faster), and what
    it prefetches for (`prefetch` None: nothing, the baseline)."""

    arrival_scale: float = 1.0
    prefetch: PrefetchPolicy | None = "best_effort"
    depth: int = 8
    timeout: float = 60.0
    abandon: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {self.depth}")
        if not 0 <= self.abandon < 1:
            raise ValueError(f"abandon must be a share in [0, 1), got {self.abandon}")


@dataclass
class QueuedReport(ReplayReport):
    """A replay's report plus the server's view: each served request's TTFT (server
    seconds, in service order) and the requests dropped unserved."""

    server: ServerOptions = field(default_factory=ServerOptions)
    ttft: list[float] = field(default_factory=list, repr=False)
    dropped: int = 0
    prefetches: int = 0  # prefetch calls the replay made
    prefetched_in_time: int = 0  # used blocks whose read ended by their request's start

    def as_dict(self) -> dict[str, Any]:
        out = super().as_dict()
        s = self.server
        out["server"] = {
            "arrival_scale": s.arrival_scale,
            "prefetch": s.prefetch or "off",
            "depth": s.depth,
            "timeout": s.timeout if s.prefetch == "wait" else None,
            "abandon": s.abandon,
        }
        out["ttft"] = ttft_summary(self.ttft)
        out["dropped"] = self.dropped
        out["prefetch_calls"] = self.prefetches
        out["prefetched_in_time"] = self.prefetched_in_time
        return out


@dataclass
class _Issued:
    """One prefetch the replay started, and how much of it is on the channel."""

    handle: Prefetch
    counted: int = 0  # promoted keys already put on the channel


class _Queue:
    """The server's queue over one open chain: arrivals, the prefetch window,
    service and drops, in server-time order."""

    def __init__(
        self,
        chain: ReplayChain,
        requests: Sequence[tuple[TraceRequest, Sequence[OffloadKey]]],
        server: ServerOptions,
        clock: ServerClock,
        report: QueuedReport,
    ) -> None:
        self.chain = chain
        self.cache: TieredCache = chain.cache
        self.requests = requests
        self.server = server
        self.clock = clock
        self.report = report
        first = requests[0][0].timestamp_ms
        self.first = first
        self.arrivals = [clock.arrival((r.timestamp_ms - first) / 1000.0) for r, _ in requests]
        rng = random.Random(server.seed)
        self.abandoned = [rng.random() < server.abandon for _ in requests]
        # request id and tenant: a request's prefetch, load and store carry the same
        self.ctx = [request_context(j, r) for j, (r, _) in enumerate(requests)]
        self.queue: deque[int] = deque()
        self.arrived = 0  # requests that have arrived (the next one's index)
        self.issued: dict[int, _Issued] = {}
        # keys prefetches brought in, with where from and when the channel read them
        self.promoted: dict[OffloadKey, PrefetchedBytes] = {}
        self.promoted_for: dict[int, list[OffloadKey]] = {}

    # -- events -------------------------------------------------------------------
    async def arrive(self, until: float) -> None:
        """Queue every request that has arrived by server time `until`; prefetch for
        those that land inside the window."""
        while self.arrived < len(self.requests) and self.arrivals[self.arrived] <= until:
            j = self.arrived
            self.arrived += 1
            self.queue.append(j)
            if len(self.queue) <= self.server.depth:
                await self.issue(j, self.arrivals[j])

    async def top_up(self, now: float) -> None:
        """The queue moved up at `now`: prefetch for requests now inside the window."""
        for j in list(self.queue)[: self.server.depth]:
            if j not in self.issued:
                await self.issue(j, now)

    async def issue(self, j: int, now: float) -> None:
        if self.server.prefetch is None:
            return
        policy = self.server.prefetch
        timeout = self.server.timeout if policy == "wait" else None
        handle = self.cache.prefetch(
            [self.requests[j][1]], self.ctx[j], policy=policy, timeout=timeout
        )
        self.issued[j] = _Issued(handle)
        self.report.prefetches += 1
        await self.settle(now)

    async def settle(self, now: float) -> None:
        """Let the cache finish what the last event started, then put what prefetches
        promoted meanwhile on the clock's prefetch channel, from server time `now`."""
        await _settle(self.cache, [i.handle for i in self.issued.values()])
        location = self.cache.index.location
        names = self.cache.tier_names
        real = self.chain.real_block
        for j, issued in self.issued.items():
            promoted = issued.handle.promoted
            fresh = promoted[issued.counted :]
            if not fresh:
                continue
            issued.counted = len(promoted)
            mediums: dict[OffloadKey, str] = {}
            for key in fresh:  # the tier the index places it in: where it was read from
                tier = location(key)
                mediums[key] = names[tier] if tier is not None else names[0]
            by: dict[str, float] = {}
            for medium in mediums.values():
                by[medium] = by.get(medium, 0.0) + real
            begin, end = self.clock.read_prefetch(now, by)
            for key, medium in mediums.items():
                self.promoted[key] = PrefetchedBytes(medium, real, begin, end)
            self.promoted_for.setdefault(j, []).extend(fresh)

    def forget(self, j: int) -> None:
        """Request `j` ended: its prefetched blocks are ordinary primary blocks now."""
        self.issued.pop(j, None)
        for key in self.promoted_for.pop(j, []):
            self.promoted.pop(key, None)

    async def serve(self, j: int, start: float) -> None:
        """Request `j`'s turn at server time `start`: load, then its prefill while
        others arrive, then store the blocks it computed."""
        chain, report = self.chain, self.report
        request, keys = self.requests[j]
        served = await chain.load_hit(keys, self.ctx[j])  # a load ends j's prefetch
        # no hit, no load: the request runs without loading, its prefetch must let go
        # (one still waiting for room would hold budget until its timeout)
        self.cache.cancel_prefetch(self.ctx[j])
        prefetched, mediums = [], {}
        for key in served.keys:
            p = self.promoted.get(key)
            if p is not None:
                prefetched.append(p)
                mediums[key] = p.medium
                if p.end_s <= start:
                    report.prefetched_in_time += 1
        cost = chain.cost(request, self.first, served, mediums, tuple(prefetched))
        report.costs.append(cost)
        report.ttft.append(self.clock.serve(cost))
        self.forget(j)
        await self.settle(start)  # the load let go of the prefetch's budget
        await self.top_up(start)
        await self.arrive(self.clock.server_free)
        await chain.store_rest(keys, len(served.keys), self.ctx[j])
        await self.settle(self.clock.server_free)

    async def drop(self, j: int, now: float) -> None:
        """Request `j`'s client gave up waiting: nothing served, its prefetch let go."""
        self.cache.cancel_prefetch(self.ctx[j])
        self.forget(j)
        self.report.dropped += 1
        await self.settle(now)
        await self.top_up(now)

    async def run(self, progress: Callable[[int, int], None] | None) -> None:
        total = len(self.requests)
        done = 0
        while done < total:
            if not self.queue:  # idle: the next arrival starts at once
                await self.arrive(self.arrivals[self.arrived])
            await self.arrive(self.clock.server_free)
            j = self.queue.popleft()
            start = max(self.arrivals[j], self.clock.server_free)
            if self.abandoned[j]:
                await self.drop(j, start)
            else:
                await self.serve(j, start)
            done += 1
            if progress is not None:
                progress(done, total)


async def _settle(cache: TieredCache, handles: Sequence[Prefetch]) -> None:
    """Wait until the cache is quiet: every cascade and prefetch window finished, and
    every prefetch done or waiting for room that is not there (a `wait` prefetch
    resumes only when a later event frees some). Deterministic for a given sequence
    of events: nothing is left running while the replay takes its next step."""
    prefetches = cache.promoter.prefetches
    stalled_since = time.perf_counter()
    last: tuple[int, ...] = ()
    while True:
        await cache.flush()
        live = [p for p in handles if not p.done]
        if not live:
            return
        windows = sum(1 for p in live if p.window is not None)
        if not windows and prefetches.waiting_for_room == len(live) and prefetches.room() <= 0:
            return
        # still moving, or waiting where room seems free (they poll for it): give up
        # once nothing has changed for a while (a state the cache cannot move on from)
        state = (prefetches.holding, sum(len(p.promoted) for p in live), len(live), windows)
        now = time.perf_counter()
        if state != last:
            last, stalled_since = state, now
        elif now - stalled_since > _STALL:
            logger.debug("settle gave up waiting for %d prefetches", len(live))
            return
        await anyio.sleep(0.001)


async def replay_queued(
    requests: Sequence[tuple[TraceRequest, Sequence[OffloadKey]]],
    options: ReplayOptions,
    server: ServerOptions,
    model: CostModel,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> QueuedReport:
    """Replay `requests` through a fresh cache behind the modelled server; the TTFTs
    use `model` (its bandwidths: the prefetch channel needs them while it runs)."""
    report = QueuedReport(options, server=server)
    if not requests:
        return report
    clock = ServerClock(model, server.arrival_scale)
    async with ReplayChain.open(requests, options, report, model.kv_bytes_per_token) as chain:
        await _Queue(chain, requests, server, clock, report).run(progress)
    return report
