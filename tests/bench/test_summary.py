"""`bench_summary`: the report for the terminal names every medium and phase and gives
ratios to the raw medium, never the project's own targets (from a report built by
hand: one figure above its target and several below)."""

from __future__ import annotations

import io
from typing import Any

import pytest

from tierkv.bench import bench_summary
from tierkv.cli import main
from tierkv.demo.report import TextTable, render


def test_text_summary_names_every_medium(
    capsys: pytest.CaptureFixture[str], tiny: list[str]
) -> None:
    assert main(["bench", *tiny[:-1], "--tiers", "nvme"]) == 0
    out = capsys.readouterr().out
    assert "nvme" in out and "ratio" in out and "os.pwrite/os.pread" in out
    assert "orchestrator bookkeeping, 512 resident keys" in out
    assert "streaming: one 4MiB request through a 512KiB primary" in out
    assert "raw = one file per block" in out and "one-file = os.pwrite/os.pread" in out
    assert "x the slower stage" in out and "us/block on 1,024-block loads" in out
    assert "target" not in out and "MISSED" not in out


def synthetic_report(
    *, store_ratio: float = 1.1, load_ratio: float = 0.9, host_store_us: float = 1.0
) -> dict[str, Any]:
    """A report as `run_bench` makes it, with the streaming ratios and the host
    tensor's store cost chosen; every other target met."""
    mib = 1 << 20
    stream: dict[str, Any] = {
        "request_bytes": 64 * mib,
        "primary_bytes": 4 * mib,
        "blocks": 64,
        "windows": 32,
        "baseline": "one file per block",
        "one_file_baseline": "os.pwrite/os.pread",
        "raw_store_seconds": 1.0,
        "raw_load_seconds": 1.0,
        "store_seconds": 1.0 / store_ratio,
        "load_seconds": 1.0 / load_ratio,
        "one_file_store_seconds": 0.5,
        "one_file_load_seconds": 0.5,
        "stage1_seconds": 1.0,
        "stage2_seconds": 0.1,
    }
    for key in ("store", "load", "raw_store", "raw_load", "one_file_store", "one_file_load"):
        seconds = stream[f"{key}_seconds"]
        stream[f"{key}_spread_seconds"] = [seconds * 0.9, seconds * 1.1]
        stream[f"{key}_cpu_us_per_block"] = 100.0
    for phase in ("store", "load"):
        stream[f"{phase}_ratio"] = stream[f"raw_{phase}_seconds"] / stream[f"{phase}_seconds"]
        stream[f"one_file_{phase}_ratio"] = 0.5 / stream[f"{phase}_seconds"]
    stream["promotion_vs_slower_stage"] = stream["load_seconds"] / 1.0
    orch = {
        "resident_keys": 1_000_000,
        "keys_per_call": 128,
        "load_1024_us_per_block": 1.5,
        "host_store_us_per_key_beyond_copy": host_store_us,
        "host_load_us_per_key_beyond_copy": 1.0,
        "host_copy_us_per_key": 0.5,
        "admission_us_per_block": {
            "reuse": {"32": 0.5, "1024": 0.25},
            "adaptive": {"32": 1.0, "1024": 0.125},
        },
        **{f"{op}_keys_per_s": 2e6 for op in ("store", "lookup_hit", "lookup_miss", "load")},
        **{f"{op}_calls_per_s": 2e6 / 128 for op in ("store", "lookup_hit", "lookup_miss", "load")},
    }
    return {
        "block_bytes": mib,
        "total_bytes": 16 * mib,
        "blocks": 16,
        "batch": 8,
        "concurrency": 8,
        "repeat": 3,
        "media": [],
        "streaming": stream,
        "orchestrator": orch,
        "integrity": None,
        "elapsed_seconds": 1.0,
    }


def text(report: dict[str, Any]) -> str:
    out = io.StringIO()
    render(bench_summary(report), out, use_rich=False)
    return out.getvalue()


def streaming_ratios(report: dict[str, Any]) -> dict[str, str]:
    """The streaming table's ratio cell per phase."""
    [table] = [
        b for b in bench_summary(report) if isinstance(b, TextTable) and "streaming" in str(b.title)
    ]
    column = table.headers.index("ratio")
    return {row[0]: row[column] for row in table.rows}


def test_figures_that_miss_the_projects_targets_are_shown_as_measured() -> None:
    """A user's bench reports measurements: the streaming load at 0.5x, the promotion
    at 2x its slower stage and a host store at 2.5 us/key (each past one of the
    project's bounds) are printed as figures, with no target, flag or count."""
    report = synthetic_report(store_ratio=1.1, load_ratio=0.5, host_store_us=2.5)
    assert streaming_ratios(report) == {"store": "1.10", "load": "0.50"}
    out = text(report)
    assert "target" not in out and "MISSED" not in out
    lines = out.splitlines()
    [promotion] = [line for line in lines if "the slower stage" in line]
    assert promotion.endswith("2.00x the slower stage")
    [bookkeeping] = [line for line in lines if line.startswith("  bookkeeping:")]
    assert bookkeeping == (
        "  bookkeeping: 1.50 us/block on 1,024-block loads; lookup 0.50 us/key at "
        "1,000,000 resident keys; host tensor store 2.50 / load 1.00 us/key beyond the copy"
    )
    [admission] = [line for line in lines if line.startswith("  admission")]
    assert admission == (
        "  admission (lookup + store decision): us/block at 32 / 1,024-block asks: "
        "reuse 0.50 / 0.25; adaptive 1.00 / 0.12"
    )
    assert lines[-1] == "ran in 1.0 s"


def test_a_report_without_streaming_or_orchestrator() -> None:
    report = {**synthetic_report(), "streaming": None, "orchestrator": None}
    out = text(report)
    assert "streaming" not in out and "bookkeeping" not in out
