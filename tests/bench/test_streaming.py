"""The streaming phase: it runs through the chain's nvme tier only when that tier is
among the media asked for, and its raw baselines (a file per block, one big file)
clean up."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def test_streaming_baselines_leave_no_file_behind(
    tmp_path: Path,
    bench_json: Callable[..., dict[str, Any]],
    chain_file: Callable[..., str],
) -> None:
    disk = tmp_path / "nvme"
    disk.mkdir()
    chain = chain_file(
        f"[{{type: nvme, path: {disk}, capacity: 64MiB, fsync: always}}]", primary="64KiB"
    )
    report = bench_json("--config", chain, "--tiers", "nvme", "--keys", "0", "--repeat", "1")
    assert "fdatasync" in report["streaming"]["baseline"]
    assert list(disk.iterdir()) == []  # nor the tier's namespace directory (nor the C's)


def test_streaming_prints_the_native_reference_beside_the_tier(
    tmp_path: Path,
    bench_json: Callable[..., dict[str, Any]],
    chain_file: Callable[..., str],
) -> None:
    """The same number of block files written and read by plain C in the same run
    (the nvme core's reference loop): its rates, CPU per block and the tier's ratio
    to it, or why it is missing (issue 51)."""
    from tierkv_nvme import native

    disk = tmp_path / "nvme"
    disk.mkdir()
    chain = chain_file(
        f"[{{type: nvme, path: {disk}, capacity: 64MiB, fsync: never}}]", primary="64KiB"
    )
    report = bench_json("--config", chain, "--tiers", "nvme", "--keys", "0", "--repeat", "1")
    stream = report["streaming"]
    assert "plain C" in stream["native_baseline"]
    if not native.AVAILABLE:
        assert stream["native_missing"] == native.reason
        return
    assert stream["native_store_MBps"] > 0 and stream["native_load_MBps"] > 0
    assert stream["native_load_ratio"] > 0 and stream["native_store_cpu_us_per_block"] > 0
    assert list(disk.iterdir()) == []


def test_streaming_runs_only_when_its_nvme_tier_is_measured(
    bench_json: Callable[..., dict[str, Any]],
) -> None:
    """`--tiers cpu` (or redis) on a chain with an nvme tier measures no nvme: no
    streaming phase either (issue 53)."""
    report = bench_json("--tiers", "cpu", "--keys", "0", "--repeat", "1")
    assert [m["medium"] for m in report["media"]] == ["cpu"]
    assert report["streaming"] is None
