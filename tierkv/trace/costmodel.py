"""A stated cost model for time to first token, so a replay's hits and misses become
seconds: prefill at a fixed rate, loads at each medium's bandwidth, one prefill at a
time (requests queue by arrival), and a prefetch channel reading queued requests'
blocks during their wait (`ServerClock`, which a queued replay drives online).

Every figure is an input. The defaults describe Llama-3.1-8B in bf16 on one H100 and
are assumptions, not measurements of this project (it has no GPU): 128KiB of KV per
token (32 layers x 8 KV heads x 128 x 2 x 2 bytes), 12,000 prefill tokens/s at the
trace's long prompts, 25 GB/s host-to-GPU. Tier bandwidths come from the replay's own
loads, or from `--bandwidth`. Replace them with your own measurements.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tierkv.stats import percentile

PRIMARY = "cpu"


@dataclass(frozen=True)
class PrefetchedBytes:
    """KV bytes a prefetch read into the primary for a queued request: from which
    medium, and when the reads ran on the server's prefetch channel (server time)."""

    medium: str
    nbytes: float
    begin_s: float
    end_s: float

    def done_by(self, t: float) -> float:
        """The share of these bytes read by time `t` (reads progress evenly)."""
        if t >= self.end_s:
            return 1.0
        if t <= self.begin_s:
            return 0.0
        return (t - self.begin_s) / (self.end_s - self.begin_s)


@dataclass(frozen=True)
class RequestCost:
    """What one replayed request needed: when it arrived, how many prompt tokens it
    had to prefill, and the bytes of KV (at the model's real size) each medium served.
    Blocks a prefetch brought into the primary are counted under the medium it read
    them from, and listed in `prefetched`: what was read by the request's start is
    served at the primary's bandwidth, the rest at the medium's (its load joins the
    read still under way)."""

    arrival_s: float
    prefill_tokens: int
    bytes_by_medium: Mapping[str, float]
    prefetched: tuple[PrefetchedBytes, ...] = ()


@dataclass(frozen=True)
class CostModel:
    model: str = "Llama-3.1-8B bf16 on one H100 (assumed)"
    prefill_tokens_per_s: float = 12_000.0
    kv_bytes_per_token: int = 131_072
    bandwidth: Mapping[str, float] = field(default_factory=lambda: {PRIMARY: 25e9})

    def load_seconds(self, bytes_by_medium: Mapping[str, float]) -> float:
        """Seconds to bring these bytes to the GPU, one medium after another; a medium
        slower than recomputing its blocks is not read (a server would recompute)."""
        total = 0.0
        for medium, nbytes in bytes_by_medium.items():
            if nbytes:
                bw = self.bandwidth.get(medium)
                if not bw:
                    raise ValueError(f"no bandwidth for medium {medium!r} in the cost model")
                recompute = nbytes / self.kv_bytes_per_token / self.prefill_tokens_per_s
                total += min(nbytes / bw, recompute)
        return total

    def ttft(self, requests: Sequence[RequestCost], *, arrival_scale: float = 1.0) -> list[float]:
        """Each request's estimated time to first token (queue wait + loads + prefill),
        one prefill at a time in arrival order; arrival times are multiplied by
        `arrival_scale` (below 1: requests come faster). The same `ServerClock` a
        queued replay runs online, so both give the same figures for the same costs."""
        clock = ServerClock(self, arrival_scale)
        return [clock.serve(r) for r in requests]


class ServerClock:
    """The server a queued replay models, in server time (seconds from the first
    arrival, scaled): one prefill at a time in arrival order, and one prefetch channel
    that reads queued requests' blocks one prefetch after another at each medium's
    bandwidth (a tier serves one reader at full speed; a load running meanwhile is not
    slowed, a simplification that favours neither side much at one prefetch a time)."""

    def __init__(self, model: CostModel, arrival_scale: float = 1.0) -> None:
        if arrival_scale <= 0:
            raise ValueError(f"arrival_scale must be > 0, got {arrival_scale}")
        self.model = model
        self.arrival_scale = arrival_scale
        self.server_free = 0.0
        self.channel_free = 0.0

    def arrival(self, arrival_s: float) -> float:
        """A request's arrival in server time."""
        return arrival_s * self.arrival_scale

    def next_start(self, arrival_s: float) -> float:
        """When a request arriving at `arrival_s` (trace time) starts if it is next."""
        return max(self.arrival(arrival_s), self.server_free)

    def read_prefetch(self, at: float, bytes_by_medium: Mapping[str, float]) -> tuple[float, float]:
        """Put a prefetch's reads, issued at server time `at`, on the channel; return
        when they begin and end."""
        begin = max(at, self.channel_free)
        self.channel_free = begin + self.model.load_seconds(bytes_by_medium)
        return begin, self.channel_free

    def serve(self, r: RequestCost) -> float:
        """Run `r` next; its time to first token. It starts when it has arrived and
        the server is free; its service is its loads plus its prefill."""
        arrival = self.arrival(r.arrival_s)
        start = max(arrival, self.server_free)
        by = dict(r.bytes_by_medium)
        for p in r.prefetched:  # what the prefetch read by now comes from the primary
            moved = p.nbytes * p.done_by(start)
            by[p.medium] = by.get(p.medium, 0.0) - moved
            by[PRIMARY] = by.get(PRIMARY, 0.0) + moved
        load = self.model.load_seconds({m: b for m, b in by.items() if b > 1e-9})
        self.server_free = start + load + r.prefill_tokens / self.model.prefill_tokens_per_s
        return self.server_free - arrival


def ttft_summary(times: Sequence[float]) -> dict[str, float]:
    """Mean, median and 99th percentile (nearest rank) of TTFTs; zeros when none."""
    if not times:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    ordered = sorted(times)
    return {
        "mean": statistics.fmean(ordered),
        "p50": percentile(ordered, 0.5),
        "p99": percentile(ordered, 0.99),
    }


def arrival_scale_for(requests: Sequence[RequestCost], model: CostModel, load: float) -> float:
    """The arrival-time factor at which prefilling every prompt whole (no cache) would
    keep the server busy `load` of the time: 0.7 leaves slack, above 1 a backlog."""
    if load <= 0:
        raise ValueError(f"load must be > 0, got {load}")
    if len(requests) < 2:
        return 1.0
    work = (
        sum(
            r.prefill_tokens + sum(r.bytes_by_medium.values()) / model.kv_bytes_per_token
            for r in requests
        )
        / model.prefill_tokens_per_s
    )
    span = requests[-1].arrival_s - requests[0].arrival_s
    return work / (span * load) if span > 0 else 1.0
