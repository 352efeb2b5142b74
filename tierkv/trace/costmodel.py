"""A stated cost model for time to first token, so a replay's hits and misses become
seconds: prefill at a fixed rate, loads at each medium's bandwidth, one prefill at a
time (requests queue by arrival), and optional prefetch during the queue wait.

Every figure is an input. The defaults describe Llama-3.1-8B in bf16 on one H100 and
are assumptions, not measurements of this project (it has no GPU): 128KiB of KV per
token (32 layers x 8 KV heads x 128 x 2 x 2 bytes), 12,000 prefill tokens/s at the
trace's long prompts, 25 GB/s host-to-GPU. Tier bandwidths come from the replay's own
loads, or from `--bandwidth`. Replace them with your own measurements.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

PRIMARY = "cpu"


@dataclass(frozen=True)
class RequestCost:
    """What one replayed request needed: when it arrived, how many prompt tokens it
    had to prefill, and the bytes of KV (at the model's real size) each medium served."""

    arrival_s: float
    prefill_tokens: int
    bytes_by_medium: Mapping[str, float]


@dataclass(frozen=True)
class CostModel:
    model: str = "Llama-3.1-8B bf16 on one H100 (assumed)"
    prefill_tokens_per_s: float = 12_000.0
    kv_bytes_per_token: int = 131_072
    bandwidth: Mapping[str, float] = field(default_factory=lambda: {PRIMARY: 25e9})
    prefetch_budget_bytes: float = float("inf")

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

    def ttft(
        self,
        requests: Sequence[RequestCost],
        *,
        prefetch: bool = False,
        arrival_scale: float = 1.0,
    ) -> list[float]:
        """Each request's estimated time to first token: queue wait + loads + prefill.

        One prefill at a time, in arrival order. With `prefetch`, a request that has to
        wait has its tier bytes promoted into the primary during the wait, one prefetch
        at a time at the tier's bandwidth, at most `prefetch_budget_bytes` held by
        queued requests at once; what arrived by the time it starts is served at the
        primary's bandwidth instead. Arrival times are multiplied by `arrival_scale`
        (below 1: requests come faster)."""
        out: list[float] = []
        server_free = 0.0
        prefetch_free = 0.0
        held: list[tuple[float, float]] = []  # (start of the request, bytes held)
        for r in requests:
            arrival = r.arrival_s * arrival_scale
            start = max(arrival, server_free)
            tier_bytes = {m: b for m, b in r.bytes_by_medium.items() if m != PRIMARY and b}
            primary_bytes = r.bytes_by_medium.get(PRIMARY, 0)
            load = self.load_seconds(r.bytes_by_medium)
            if prefetch and start > arrival and tier_bytes:
                held = [(s, b) for s, b in held if s > arrival]
                room = self.prefetch_budget_bytes - sum(b for _, b in held)
                want = sum(tier_bytes.values())
                take = max(0.0, min(float(want), room))
                if take > 0:
                    share = take / want
                    duration = self.load_seconds({m: b * share for m, b in tier_bytes.items()})
                    begin = max(arrival, prefetch_free)
                    done = min(1.0, max(0.0, (start - begin) / duration)) if duration else 1.0
                    prefetch_free = begin + duration * done
                    moved = {m: b * share * done for m, b in tier_bytes.items()}
                    held.append((start, sum(moved.values())))
                    rest = {m: b - moved[m] for m, b in tier_bytes.items()}
                    load = self.load_seconds({**rest, PRIMARY: primary_bytes + sum(moved.values())})
            service = load + r.prefill_tokens / self.prefill_tokens_per_s
            server_free = start + service
            out.append(server_free - arrival)
        return out


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
