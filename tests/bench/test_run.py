"""`run_bench`: every medium of the chain (or those asked for) in one report, with the
streaming phase, the orchestrator's cost and the targets."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tierkv.bench import TARGETS, check_targets
from tierkv.cache import TieredCache
from tierkv.cli import main
from tierkv.config import parse_config

pytestmark = pytest.mark.anyio


def test_default_chain_measures_primary_and_nvme_against_raw_media(
    bench_json: Callable[..., dict[str, Any]], check_medium: Callable[..., None]
) -> None:
    report = bench_json()
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
    admission = orch["admission_us_per_block"]
    assert list(admission) == ["reuse", "tinylfu", "adaptive", "adaptive, 200-block tier"]
    for cost in admission.values():
        assert list(cost) == ["32", "1024"] and min(cost.values()) > 0
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
    # the project's targets are not in a user's report; check_targets reads them from it
    assert "targets" not in report
    targets = check_targets(report)
    assert list(targets) == [t.name for t in TARGETS]
    assert targets["streaming_load_ratio"]["value"] == stream["load_ratio"]
    assert targets["lookup_us_per_key"]["value"] == pytest.approx(
        1e6 / orch["lookup_hit_keys_per_s"]
    )
    for entry in targets.values():
        assert entry["met"] == (
            entry["value"] >= entry["min"] if "min" in entry else entry["value"] <= entry["max"]
        )


def test_unknown_medium_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], tiny: list[str]
) -> None:
    assert main(["bench", *tiny, "--tiers", "cpu,floppy"]) == 2
    assert "no medium named floppy in the chain; media: cpu, nvme" in capsys.readouterr().err


def test_tier_names_follow_the_cache() -> None:
    config = parse_config(
        "namespace: t\nlayout: {block_bytes: 4KiB, groups: [{block_size: 16}]}\n"
        "primary: {capacity: 32KiB, pin_memory: false}\n"
        "tiers: [{type: memory}, {type: memory}]\n"
    )
    assert TieredCache(config).tier_names == config.tier_names() == ["memory-0", "memory-1"]
