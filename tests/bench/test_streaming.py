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
    assert list(disk.iterdir()) == []  # nor the tier's namespace directory


def test_streaming_runs_only_when_its_nvme_tier_is_measured(
    bench_json: Callable[..., dict[str, Any]],
) -> None:
    """`--tiers cpu` (or redis) on a chain with an nvme tier measures no nvme: no
    streaming phase either (issue 53)."""
    report = bench_json("--tiers", "cpu", "--keys", "0", "--repeat", "1")
    assert [m["medium"] for m in report["media"]] == ["cpu"]
    assert report["streaming"] is None
