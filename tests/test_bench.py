"""`tierkv bench` on tiny sizes: every medium of a chain measured against its raw
client (nvme, redis, s3) or without a ratio (any other tier), the orchestrator's own
rate, and failures reported. Numbers are only checked to exist, never timed."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tierkv.bench import BenchOptions, empty_primary, run_bench
from tierkv.cache import TieredCache
from tierkv.cli import main
from tierkv.config import parse_config
from tierkv.keys import make_offload_key

pytestmark = pytest.mark.anyio

TINY = [
    "--block-size", "128KiB", "--total", "1MiB", "--batch", "2", "--concurrency", "2",
    "--repeat", "2", "--keys", "512", "--lookup-batch", "64", "--json",
]  # fmt: skip


def bench_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["bench", *TINY, *args]) == 0, capsys.readouterr().err
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return report


def check_medium(entry: dict[str, Any], with_ratio: bool) -> None:
    for phase in ("store", "load"):
        side = entry[phase]
        assert side["tierkv"]["MBps"] > 0
        low, high = side["tierkv"]["spread"]
        assert low <= side["tierkv"]["MBps"] <= high
        assert side["tierkv"]["p99_ms"] >= side["tierkv"]["p50_ms"] > 0
        if with_ratio:
            assert side["raw"]["MBps"] > 0 and side["ratio"] == pytest.approx(
                side["tierkv"]["MBps"] / side["raw"]["MBps"]
            )
        else:
            assert side["raw"] is None and side["ratio"] is None


def test_default_chain_measures_primary_and_nvme_against_raw_media(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = bench_json(capsys)
    assert [m["medium"] for m in report["media"]] == ["cpu", "nvme"]
    cpu, nvme = report["media"]
    assert cpu["baseline"] == "torch copy_" and nvme["baseline"].startswith("os.pwrite/os.pread")
    check_medium(cpu, with_ratio=True)
    check_medium(nvme, with_ratio=True)
    assert report["blocks"] == 8 and report["total_bytes"] == 1 << 20
    orch = report["orchestrator"]
    assert orch["resident_keys"] == 512 and orch["keys_per_call"] == 64
    for op in ("store", "lookup_hit", "lookup_miss", "load"):
        assert orch[f"{op}_keys_per_s"] == pytest.approx(64 * orch[f"{op}_calls_per_s"])
    assert orch["load_1024_us_per_block"] > 0 and orch["host_copy_us_per_key"] > 0
    # streaming: 4 x the total (4 MiB) through a primary of total / 4 (4 blocks here)
    stream = report["streaming"]
    assert stream["request_bytes"] == 4 << 20 and stream["primary_bytes"] == 4 * (128 << 10)
    assert stream["blocks"] == 32 and stream["windows"] == 32  # reserve 2 slots: windows of 1
    assert stream["baseline"].startswith("one file per block")
    assert stream["one_file_baseline"].startswith("os.pwrite/os.pread")
    for phase in ("store", "load"):
        assert stream[f"{phase}_ratio"] == pytest.approx(
            stream[f"{phase}_MBps"] / stream[f"raw_{phase}_MBps"]
        )
        assert stream[f"one_file_{phase}_ratio"] == pytest.approx(
            stream[f"{phase}_MBps"] / stream[f"one_file_{phase}_MBps"]
        )
        for side in (phase, f"raw_{phase}", f"one_file_{phase}"):
            low, high = stream[f"{side}_spread_seconds"]
            assert 0 < low <= stream[f"{side}_seconds"] <= high
            assert stream[f"{side}_cpu_us_per_block"] >= 0
    assert stream["promotion_vs_slower_stage"] == pytest.approx(
        stream["load_seconds"] / max(stream["stage1_seconds"], stream["stage2_seconds"])
    )


def test_a_tier_without_a_raw_baseline_gets_numbers_but_no_ratio(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], chain_file: Callable[..., str]
) -> None:
    chain = chain_file("[{type: memory, capacity: 8MiB}]", primary="64KiB")
    report = bench_json(capsys, "--config", chain, "--tiers", "memory", "--keys", "0")
    [memory] = report["media"]
    assert memory["medium"] == "memory" and memory["baseline"] is None
    check_medium(memory, with_ratio=False)
    assert report["orchestrator"] is None


def test_streaming_baselines_leave_no_file_behind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], chain_file: Callable[..., str]
) -> None:
    disk = tmp_path / "nvme"
    chain = chain_file(
        f"[{{type: nvme, path: {disk}, capacity: 64MiB, fsync: always}}]", primary="64KiB"
    )
    report = bench_json(capsys, "--config", chain, "--tiers", "cpu", "--keys", "0")
    assert "fdatasync" in report["streaming"]["baseline"]
    assert not [p for p in disk.iterdir() if p.name.startswith(".tierkv-bench-raw")]


def test_text_summary_names_every_medium(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *TINY[:-1], "--tiers", "nvme"]) == 0
    out = capsys.readouterr().out
    assert "nvme" in out and "ratio" in out and "os.pwrite/os.pread" in out
    assert "orchestrator bookkeeping, 512 resident keys" in out
    assert "streaming: one 4MiB request through a 512KiB primary" in out
    assert "raw = one file per block" in out and "one-file = os.pwrite/os.pread" in out
    assert "x the slower stage" in out and "us/block on 1,024-block loads" in out


def test_a_tier_that_loses_blocks_fails_the_bench(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], chain_file: Callable[..., str]
) -> None:
    # the tier keeps 256 KiB of the 1 MiB stored: the loads must come back failed
    chain = chain_file("[{type: memory, capacity: 300KiB}]", primary="64KiB")
    assert main(["bench", *TINY, "--config", chain, "--tiers", "memory"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    err = [line for line in err if not line.startswith("[tierkv bench ")]  # progress lines
    assert len(err) == 1 and "memory: " in err[0] and "failed to load" in err[0]


def test_unknown_medium_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *TINY, "--tiers", "cpu,floppy"]) == 2
    assert "no medium named floppy in the chain; media: cpu, nvme" in capsys.readouterr().err
    assert main(["bench", "--total", "1KiB", "--block-size", "4KiB"]) == 2
    assert "less than one block" in capsys.readouterr().err
    assert main(["bench", "--block-size", "lots"]) == 2
    assert "'lots' is not a size" in capsys.readouterr().err


async def test_empty_primary_evicts_every_idle_block() -> None:
    config = parse_config(
        "namespace: t\nlayout: {block_bytes: 4KiB, groups: [{block_size: 16}]}\n"
        "primary: {capacity: 32KiB, pin_memory: false}\n"
    )
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(6)]
    async with TieredCache(config) as cache:
        await cache.store(keys, torch.zeros(6, 4096, dtype=torch.uint8))
        assert empty_primary(cache) == 6
        assert len(cache.primary) == 0 and cache.primary.num_free == 8


def test_tier_names_follow_the_cache() -> None:
    config = parse_config(
        "namespace: t\nlayout: {block_bytes: 4KiB, groups: [{block_size: 16}]}\n"
        "primary: {capacity: 32KiB, pin_memory: false}\n"
        "tiers: [{type: memory}, {type: memory}]\n"
    )
    assert TieredCache(config).tier_names == config.tier_names() == ["memory-0", "memory-1"]


# -- real servers ------------------------------------------------------------------------
@pytest.fixture
def s3_endpoint(moto_server: Any) -> str:
    moto_server.create_bucket("bench")
    return str(moto_server.endpoint_url)


async def test_redis_tier_against_plain_redis_py(redis_url: str) -> None:
    import redis.asyncio as aioredis

    chain = parse_config(
        {
            "namespace": "t",
            "layout": {"block_bytes": "4KiB", "groups": [{"block_size": 16}]},
            "primary": {"capacity": "64KiB", "pin_memory": False},
            "tiers": [{"type": "redis", "url": redis_url, "max_connections": 4}],
        }
    )
    options = BenchOptions(
        block_bytes=64 << 10, total_bytes=512 << 10, batch=2, concurrency=2, repeat=1,
        orchestrator_keys=0,
    )  # fmt: skip
    report = await run_bench(chain, options)
    _, redis = report["media"]
    assert redis["medium"] == "redis" and redis["baseline"] == "redis-py SET/GET, 4 in flight"
    check_medium(redis, with_ratio=True)
    client = aioredis.Redis.from_url(redis_url)
    try:
        assert await client.dbsize() == 0  # both sides removed what they wrote
    finally:
        await client.aclose()


async def test_s3_tier_against_plain_s3fs(s3_endpoint: str) -> None:
    chain = parse_config(
        {
            "namespace": "t",
            "layout": {"block_bytes": "4KiB", "groups": [{"block_size": 16}]},
            "primary": {"capacity": "64KiB", "pin_memory": False},
            "tiers": [
                {
                    "type": "s3",
                    "url": "s3://bench/kv",
                    "endpoint_url": s3_endpoint,
                    "access_key_id": "testing",
                    "secret_access_key": "testing",
                    "region": "us-east-1",
                    "max_concurrency": 4,
                }
            ],
        }
    )
    options = BenchOptions(
        block_bytes=64 << 10, total_bytes=256 << 10, batch=2, concurrency=2, repeat=1,
        orchestrator_keys=0, media=("s3",),
    )  # fmt: skip
    report = await run_bench(chain, options)
    [s3] = report["media"]
    assert s3["baseline"] == "s3fs put/get, 4 in flight"
    check_medium(s3, with_ratio=True)
