"""`tierkv bench trace` (tierkv.cli.trace)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierkv.cli import main


def trace(tmp_path: Path) -> Path:
    path = tmp_path / "t.jsonl"
    lines = []
    for i in range(40):  # two documents read again and again, plus one-off prompts
        ids = [0, 1, 2, 100 + i] if i % 2 else [10, 11, 1000 + i, 2000 + i]
        lines.append(json.dumps({"timestamp": 50 * i, "input_length": 2048, "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_bench_trace_reports_each_policy_as_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["bench", "trace", str(trace(tmp_path)), "--tiers", "memory", "--block-bytes", "4KiB"]
    assert main([*args, "--tier-capacity", "25%", "--bandwidth", "memory=10GiB", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["requests"] == 40 and report["distinct_blocks"] == 3 + 20 + 2 + 40
    runs = report["runs"]
    assert [r["admission"] for r in runs] == ["all", "reuse", "tinylfu"]
    assert runs[0]["estimates"]["bandwidth"]["memory"] == 10 * 2**30
    assert all(0 < r["hit_rate"] <= report["infinite_cache_hit_rate"] for r in runs)


def test_bench_trace_prints_a_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "trace", str(trace(tmp_path)), "--tiers", "memory", "--block-bytes", "4KiB"]
    assert main([*args, "--tier-capacity", "10", "--admission", "reuse"]) == 0
    out = capsys.readouterr().out
    assert "40 requests" in out and "   reuse " in out


def test_bench_trace_replays_each_prefetch_policy_against_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "docs.jsonl"  # six documents in turn, each after a fresh question
    lines = []
    for i in range(60):
        ids = [10 * (i % 6), 10 * (i % 6) + 1, 10 * (i % 6) + 2, 1000 + i]
        lines.append(json.dumps({"timestamp": 50 * i, "input_length": 2048, "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    args = ["bench", "trace", str(path), "--tiers", "memory", "--block-bytes", "4KiB"]
    extra = ["--primary", "12", "--tier-capacity", "100%", "--admission", "all"]
    extra += ["--bandwidth", "memory=3GiB"]
    policies = ["--prefetch", "best_effort,wait", "--prefetch-depth", "4", "--abandon", "0.25"]
    assert main([*args, *extra, *policies, "--backlog-load", "3", "--json"]) == 0
    backlog = json.loads(capsys.readouterr().out)["runs"][0]["backlog"]
    assert list(backlog) == ["off", "best_effort", "wait"]
    for name, run in backlog.items():  # clients abandon: the baseline is queued too
        assert run["server"]["abandon"] == 0.25 and run["dropped"] > 0
        assert run["server"]["prefetch"] == name
    assert backlog["wait"]["server"]["depth"] == 4
    assert backlog["best_effort"]["prefetch_counters"]["prefetched_blocks"] > 0
    assert backlog["off"]["prefetch_counters"]["prefetched_blocks"] == 0
    assert main([*args, *extra, "--prefetch", "none", "--json"]) == 0
    assert list(json.loads(capsys.readouterr().out)["runs"][0]["backlog"]) == ["off"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--admission", "sometimes"], "--admission: sometimes"),
        (["--prefetch", "eager"], "--prefetch: eager"),
        (["--abandon", "1"], "must be in [0, 1)"),
        (["--tier-capacity", "lots"], "'lots' is not a block count or a percentage"),
        (["--bandwidth", "nvme"], "write MEDIUM=BYTES_PER_SECOND"),
    ],
)
def test_bad_options_exit_2_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    args = ["bench", "trace", str(trace(tmp_path)), "--tiers", "memory", *extra]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_a_bad_trace_exits_2_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 1, "hash_ids": [1]}\nnot json\n')
    assert main(["bench", "trace", str(path), "--tiers", "memory"]) == 2
    assert "bad.jsonl:2: not JSON" in capsys.readouterr().err


def test_a_trace_that_asks_for_no_block_exits_2_saying_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 1, "hash_ids": []}\n')
    assert main(["bench", "trace", str(path), "--tiers", "memory"]) == 2
    err = capsys.readouterr().err
    assert "empty.jsonl: no request asks for a block" in err and "ZeroDivision" not in err


def test_capacity_sweep_prints_one_table_with_a_row_per_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["bench", "trace", str(trace(tmp_path)), "--capacity-sweep"]
    assert main([*args, "--tier-capacity", "10%,50%", "--primary", "2,4%"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if " | " in line]
    assert len(rows) == 1 + 2 * 2 and "all" in rows[0] and "/all" in rows[0]
    assert "tiers memory, 4,096-byte blocks" in out  # the sweep's defaults


def test_capacity_sweep_json_has_every_cell_with_its_ratios(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["bench", "trace", str(trace(tmp_path)), "--capacity-sweep", "--json"]
    assert main([*args, "--requests", "30", "--admission", "reuse,all"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["requests"] == 30 and report["baseline"] == "all"
    sizes = [(c["primary"], c["tier_capacity"]) for c in report["cells"][::2]]
    assert sizes == [
        (p, c) for p in ("0.5%", "2%") for c in ("5%", "12%", "20%", "27%", "40%", "50%")
    ]
    assert {c["admission"] for c in report["cells"]} == {"all", "reuse"}
    for cell in report["cells"]:
        lru = cell["lru_hit_rate"]  # None where the LRU serves nothing
        assert cell["vs_lru"] == (pytest.approx(cell["hit_rate"] / lru) if lru else None)
        assert {"vs_baseline", "blocks_written", "bytes_written"} <= set(cell)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--tier-capacity", "5%,120%"],
            "--tier-capacity: '120%': a percentage must be in (0, 100]",
        ),
        (["--primary", "0%"], "--primary: '0%': a percentage must be in (0, 100]"),
        (["--tier-capacity", "5%,lots"], "'lots' is not a block count or a percentage"),
        (["--admission", "sometimes"], "--admission: sometimes"),
        (["--plot", "x.png"], "drop it with --capacity-sweep"),
    ],
)
def test_a_bad_sweep_option_exits_2_before_reading_the_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    missing = tmp_path / "not-there.jsonl"  # never read: the options fail first
    assert main(["bench", "trace", str(missing), "--capacity-sweep", *extra]) == 2
    assert message in capsys.readouterr().err


def test_the_help_names_the_sweeps_default_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    """The command line states the defaults without importing the replay (torch)."""
    from tierkv.trace.sweep import SWEEP_CAPACITIES, SWEEP_PRIMARIES

    assert main(["bench", "trace", "-h"]) == 0
    text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")
    assert ",".join(SWEEP_CAPACITIES) in text and ",".join(SWEEP_PRIMARIES) in text
