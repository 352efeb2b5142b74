"""Replays through a real TieredCache (tierkv.trace.replay, tierkv.trace.bench)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tierkv.trace.bench import TraceBenchOptions, run_trace_bench, summary_lines
from tierkv.trace.format import TraceRequest, request_keys
from tierkv.trace.reference import infinite_cache_hits, lru_hits
from tierkv.trace.replay import ReplayOptions, primary_and_tier_blocks, replay

pytestmark = pytest.mark.anyio

BLOCK = 4096


def synthetic(n: int = 120, seed: int = 3) -> list[TraceRequest]:
    """Conversations that continue, shared documents, and one-shot prompts."""
    rng = random.Random(seed)
    convs: list[list[int]] = [[] for _ in range(6)]
    docs = [[1000 * d + i for i in range(rng.randint(2, 6))] for d in range(4)]
    fresh = 10**6
    out = []
    for i in range(n):
        kind = rng.random()
        if kind < 0.4:
            conv = rng.choice(convs)
            conv.extend(range(fresh, fresh + rng.randint(1, 3)))
            fresh += 10
            ids = list(conv)
        elif kind < 0.7:
            ids = [*rng.choice(docs), fresh]
            fresh += 1
        else:
            ids = list(range(fresh, fresh + rng.randint(1, 5)))
            fresh += 10
        out.append(TraceRequest(100.0 * i, 512 * len(ids), 4, tuple(ids)))
    return out


def keyed(requests: list[TraceRequest]) -> list[tuple[TraceRequest, list[bytes]]]:
    return [(r, request_keys(r)) for r in requests]


async def test_a_chain_that_holds_everything_serves_what_an_infinite_cache_does(
    tmp_path: Path,
) -> None:
    trace = keyed(synthetic())
    only = [k for _, k in trace]
    distinct = len({k for ks in only for k in ks})
    options = ReplayOptions(
        block_bytes=BLOCK,
        primary_blocks=8,
        tiers=("nvme",),
        tier_blocks=distinct + 1,
        directory=tmp_path,
    )
    report = await replay(trace, options)
    assert report.blocks_served == infinite_cache_hits(only) > 0
    assert report.blocks_asked == sum(len(k) for k in only)
    assert report.served_by["nvme"] > 0 and report.failed_loads == 0
    # every distinct block was written once, at the tier's framed size
    assert report.bytes_written["nvme"] == distinct * BLOCK
    assert len(report.costs) == len(trace)
    assert list(tmp_path.iterdir()) == []  # the tier's directory is gone


async def test_reuse_admission_writes_less_and_serves_no_less_when_the_tier_is_small() -> None:
    trace = keyed(synthetic(200))
    only = [k for _, k in trace]
    distinct = len({k for ks in only for k in ks})
    primary, tier = primary_and_tier_blocks(distinct, "2%", "25%")
    runs = {}
    for admission in ("all", "reuse"):
        opts = ReplayOptions(
            block_bytes=BLOCK, primary_blocks=primary, tiers=("memory",),
            tier_blocks=tier, admission=admission,
        )  # fmt: skip
        runs[admission] = await replay(trace, opts)
    everything, reuse = runs["all"], runs["reuse"]
    assert reuse.bytes_written["memory"] < everything.bytes_written["memory"]
    assert reuse.declined["memory"] > 0 and everything.declined["memory"] == 0
    assert reuse.blocks_served >= 0.9 * everything.blocks_served
    # a write-everything chain serves at least what one LRU of the tier's size does
    assert everything.blocks_served >= 0.95 * lru_hits(only, tier)


def test_capacities_parse_as_blocks_or_shares() -> None:
    assert primary_and_tier_blocks(1000, "2%", "300") == (20, 300)
    with pytest.raises(ValueError, match="not a block count or a percentage"):
        primary_and_tier_blocks(1000, "lots", "1")


async def test_the_bench_reports_every_run_with_references(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {"timestamp": r.timestamp_ms, "input_length": r.input_length,
                 "output_length": r.output_length, "hash_ids": list(r.hash_ids)}
            ) + "\n"
            for r in synthetic(60)
        )
    )  # fmt: skip
    said: list[str] = []
    report = await run_trace_bench(
        TraceBenchOptions(path, block_bytes=BLOCK, tiers=("memory",), tier_capacities=("25%",)),
        said.append,
    )
    assert [r["admission"] for r in report["runs"]] == ["all", "reuse", "tinylfu"]
    run = report["runs"][0]
    assert 0 < run["hit_rate"] <= report["infinite_cache_hit_rate"]
    backlog = run["backlog"]
    assert list(backlog) == ["off", "best_effort"]
    assert backlog["off"]["ttft"]["mean"] >= run["estimates"]["ttft"]["mean"]
    queued = backlog["best_effort"]
    assert queued["server"]["prefetch"] == "best_effort" and queued["prefetch_calls"] > 0
    assert queued["prefetch_counters"]["prefetched_blocks"] >= 0
    assert queued["requests"] == 60 and set(queued["ttft"]) == {"mean", "p50", "p99"}
    lines = summary_lines(report)
    assert "60 requests" in lines[0] and any(" reuse " in line for line in lines)
    assert any(line.startswith("under a backlog") for line in lines)
    assert any("best_effort" in line for line in lines)
    assert any("replaying" in s for s in said)


async def test_the_plot_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from tierkv.trace.plot import plot_trace

    path = tmp_path / "t.jsonl"
    path.write_text(
        "".join(
            json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                        "hash_ids": list(r.hash_ids)}) + "\n"
            for r in synthetic(40)
        )
    )  # fmt: skip
    opts = TraceBenchOptions(
        path, block_bytes=BLOCK, tiers=("memory",), tier_capacities=("10%", "40%")
    )
    out = plot_trace(await run_trace_bench(opts), tmp_path / "trace.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def test_a_memory_tier_holds_as_many_blocks_as_an_nvme_tier_of_the_same_count(
    tmp_path: Path,
) -> None:
    """The memory tier counts framed bytes: sized by the block alone, it held ~2 % fewer
    blocks at 4KiB and served less than an nvme tier of the same `tier_blocks`.

    Not asserted equal: the nvme tier writes a job's blocks in concurrent threads, so
    they enter its LRU in the order the writes finish, and on a loaded machine it
    served one block more or less (339 against 340, once in CI). One block of
    capacity less costs this trace 9 blocks served (339 -> 330 at 39 blocks)."""
    trace = keyed(synthetic(200))
    served = {}
    for tier in ("memory", "nvme"):
        options = ReplayOptions(
            block_bytes=BLOCK, primary_blocks=4, tiers=(tier,), tier_blocks=40, directory=tmp_path
        )
        report = await replay(trace, options)
        served[tier] = (report.blocks_served, report.served_by[tier])
        assert sum(report.blocks_written.values()) > 40  # the tier filled and evicted
    assert abs(served["memory"][0] - served["nvme"][0]) <= 3, served
    assert abs(served["memory"][1] - served["nvme"][1]) <= 3, served
