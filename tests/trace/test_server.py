"""The queued replay (tierkv.trace.server): a modelled server that calls the real
`TieredCache.prefetch` for queued requests, over real tiers (nvme in a temporary
directory, the in-tree memory tier)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tierkv.contract.keys import OffloadKey
from tierkv.trace.costmodel import CostModel, arrival_scale_for
from tierkv.trace.format import TraceRequest, request_keys
from tierkv.trace.replay import ReplayOptions, primary_and_tier_blocks, replay
from tierkv.trace.server import QueuedReport, ServerOptions, replay_queued

pytestmark = pytest.mark.anyio

BLOCK = 4096
# tier reads at 3 GB/s: a 64MiB block (512 tokens x 128KiB) in 22 ms instead of 43 ms
# of prefill, and 3 ms from the primary: what a prefetch saves is visible
MODEL = CostModel(bandwidth={"cpu": 25e9, "nvme": 3e9, "memory": 3e9})


def synthetic(n: int, seed: int = 5) -> list[tuple[TraceRequest, list[OffloadKey]]]:
    """Shared documents read again and again behind fresh questions, and one-shot
    prompts: what a queue of requests can prefetch for."""
    rng = random.Random(seed)
    docs = [[1000 * d + i for i in range(rng.randint(3, 8))] for d in range(10)]
    fresh = 10**6
    out = []
    for i in range(n):
        if rng.random() < 0.7:
            ids = [*rng.choice(docs), fresh]
            fresh += 1
        else:
            ids = list(range(fresh, fresh + rng.randint(1, 6)))
            fresh += 10
        r = TraceRequest(100.0 * i, 512 * len(ids), 4, tuple(ids))
        out.append((r, request_keys(r)))
    return out


def chain(tier: str, tmp_path: Path | None = None, n: int = 160) -> dict[str, Any]:
    trace = synthetic(n)
    distinct = len({k for _, ks in trace for k in ks})
    primary, blocks = primary_and_tier_blocks(distinct, "10%", "60%")
    options = ReplayOptions(
        block_bytes=BLOCK,
        primary_blocks=max(primary, 24),
        tiers=(tier,),
        tier_blocks=blocks,
        directory=tmp_path,
    )
    return {"trace": trace, "options": options}


async def backlog(trace: Any, options: ReplayOptions) -> float:
    """The arrival scale that keeps the server 1.5x busier than it can be."""
    plain = await replay(trace, options)
    return arrival_scale_for(plain.costs, MODEL, 1.5)


def comparable(report: QueuedReport) -> dict[str, Any]:
    """The report without what depends on this machine's speed."""
    out = report.as_dict()
    for key in (
        "seconds",
        "cpu_seconds",
        "trace_blocks_per_second",
        "trace_blocks_per_cpu_second",
        "load_bandwidth",
    ):
        out.pop(key)
    out["costs"] = report.costs
    return out


async def test_prefetch_promotes_for_queued_requests_and_their_loads_use_it(
    tmp_path: Path,
) -> None:
    c = chain("nvme", tmp_path)
    trace, options = c["trace"], c["options"]
    scale = await backlog(trace, options)
    without = await replay_queued(trace, options, ServerOptions(scale, prefetch=None), MODEL)
    with_ = await replay_queued(trace, options, ServerOptions(scale, depth=6), MODEL)
    counters = with_.prefetch
    assert with_.prefetches > 0 and counters["prefetched_blocks"] > 0
    # every promoted block was taken over by a load (single flight: no second read)
    assert 0 < counters["prefetch_used"] <= counters["prefetched_blocks"]
    assert with_.prefetched_in_time > 0
    assert any(cost.prefetched for cost in with_.costs)
    assert counters["prefetch_cancelled"] == 0 and with_.dropped == 0
    # the cache served what it served without prefetch, only sooner
    assert with_.blocks_served == pytest.approx(without.blocks_served, rel=0.02)
    assert with_.served_by["cpu"] > without.served_by["cpu"]
    # single flight: a prefetched block is read from the disk once, not again by its load
    assert with_.bytes_read["nvme"] <= 1.02 * without.bytes_read["nvme"]
    mean = sum(with_.ttft) / len(with_.ttft)
    assert mean < sum(without.ttft) / len(without.ttft)
    assert without.prefetches == 0 and without.prefetch["prefetched_blocks"] == 0
    assert list(tmp_path.iterdir()) == []


async def test_without_prefetch_the_queued_replay_is_the_plain_replay_on_the_server() -> None:
    c = chain("memory")
    trace, options = c["trace"], c["options"]
    plain = await replay(trace, options)
    scale = arrival_scale_for(plain.costs, MODEL, 1.5)
    queued = await replay_queued(trace, options, ServerOptions(scale, prefetch=None), MODEL)
    assert queued.costs == plain.costs
    assert queued.ttft == pytest.approx(MODEL.ttft(plain.costs, arrival_scale=scale))
    # and the recorded costs give the online figures again with prefetch too
    prefetched = await replay_queued(trace, options, ServerOptions(scale), MODEL)
    assert prefetched.ttft == pytest.approx(MODEL.ttft(prefetched.costs, arrival_scale=scale))


async def test_a_queued_replay_is_deterministic() -> None:
    c = chain("memory")
    trace, options = c["trace"], c["options"]
    server = ServerOptions(0.2, depth=5)
    first = await replay_queued(trace, options, server, MODEL)
    second = await replay_queued(trace, options, server, MODEL)
    assert first.prefetch["prefetched_blocks"] > 0 and first.prefetch["prefetch_shed"] > 0
    assert comparable(first) == comparable(second)


async def test_the_wait_policy_sheds_less_and_varies_only_by_a_few_blocks() -> None:
    # A `wait` prefetch resumes whenever the cache frees room, which can fall inside a
    # load (the cache wakes waiting prefetches when the load takes over its request's
    # prefetch): a few blocks may land one window earlier or later between runs.
    c = chain("memory")
    trace, options = c["trace"], c["options"]
    best = await replay_queued(trace, options, ServerOptions(0.2, depth=5), MODEL)
    runs = [
        await replay_queued(
            trace, options, ServerOptions(0.2, prefetch="wait", depth=5, timeout=30.0), MODEL
        )
        for _ in range(2)
    ]
    for run in runs:
        assert run.prefetch["prefetch_shed"] < best.prefetch["prefetch_shed"]
        assert run.prefetch["prefetched_blocks"] > best.prefetch["prefetched_blocks"]
    a, b = (r.prefetch["prefetched_blocks"] for r in runs)
    assert abs(a - b) <= 0.1 * a
    mean = [sum(r.ttft) / len(r.ttft) for r in runs]
    assert mean[0] == pytest.approx(mean[1], rel=0.02)


async def test_abandoned_requests_are_dropped_and_their_prefetch_cancelled() -> None:
    c = chain("memory", n=200)
    trace, options = c["trace"], c["options"]
    server = ServerOptions(0.1, depth=12, abandon=0.3, seed=7)
    report = await replay_queued(trace, options, server, MODEL)
    assert report.dropped > 0
    assert len(report.ttft) == len(report.costs) == len(trace) - report.dropped
    assert report.prefetch["prefetch_cancelled"] > 0
    # the same requests drop without prefetch: the baseline serves the same ones
    off = await replay_queued(
        trace, options, ServerOptions(0.1, prefetch=None, abandon=0.3, seed=7), MODEL
    )
    assert off.dropped == report.dropped
    assert [c.arrival_s for c in off.costs] == [c.arrival_s for c in report.costs]


def test_bad_server_options_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="prefetch depth must be >= 1"):
        ServerOptions(depth=0)
    with pytest.raises(ValueError, match="abandon must be a share"):
        ServerOptions(abandon=1.0)
