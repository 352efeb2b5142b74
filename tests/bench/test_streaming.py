"""The streaming phase: its raw baselines (a file per block, one big file) clean up."""

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
    chain = chain_file(
        f"[{{type: nvme, path: {disk}, capacity: 64MiB, fsync: always}}]", primary="64KiB"
    )
    report = bench_json("--config", chain, "--tiers", "cpu", "--keys", "0")
    assert "fdatasync" in report["streaming"]["baseline"]
    assert not [p for p in disk.iterdir() if p.name.startswith(".tierkv-bench-raw")]
