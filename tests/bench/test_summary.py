"""`bench_summary`: the report for the terminal names every medium and phase, and flags
each figure that misses its target (from a report built by hand: one figure above its
target and one below)."""

from __future__ import annotations

import io
from typing import Any

import pytest

from tierkv.bench import MISSED, bench_summary
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
    assert "targets: " in out


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
    column = table.headers.index("ratio (target >= 0.8)")
    return {row[0]: row[column] for row in table.rows}


def test_the_figure_below_its_target_is_flagged_and_the_one_above_is_not() -> None:
    report = synthetic_report(store_ratio=1.1, load_ratio=0.5)
    assert streaming_ratios(report) == {"store": "1.10", "load": f"0.50 {MISSED}"}
    lines = text(report).splitlines()
    # promotion at 2.0x its slower stage misses its bound too (the load is slow)
    [promotion] = [line for line in lines if "the slower stage" in line]
    assert promotion.endswith(f"2.00x the slower stage (target <= 1.25: {MISSED})")
    [bookkeeping] = [line for line in lines if line.startswith("  bookkeeping:")]
    assert MISSED not in bookkeeping
    assert lines[-2] == (
        f"targets: 5 of 7 met; {MISSED}: streaming load, tierkv/raw 0.50x (target >= 0.8); "
        "promotion / its slower stage 2.00x (target <= 1.25)"
    )


def test_a_report_that_meets_every_target_reads_as_before() -> None:
    report = synthetic_report()
    out = text(report)
    assert MISSED not in out
    assert streaming_ratios(report) == {"store": "1.10", "load": "0.90"}
    assert "1.11x the slower stage (target <= 1.25)\n" in out
    assert "1.50 us/block on 1,024-block loads (target <= 5); lookup 0.50 us/key" in out
    assert "us/key beyond the copy (target <= 2)\n" in out
    assert out.splitlines()[-2] == "targets: all 7 met"


def test_one_of_two_figures_sharing_a_target_is_named() -> None:
    out = text(synthetic_report(host_store_us=2.5))
    assert f"store 2.50 / load 1.00 us/key beyond the copy (target <= 2: store {MISSED})" in out
    assert "host tensor store beyond the copy 2.50 us/key (target <= 2)" in out


def test_a_report_without_streaming_or_orchestrator_has_no_targets_line() -> None:
    report = {**synthetic_report(), "streaming": None, "orchestrator": None}
    assert "targets" not in text(report)
