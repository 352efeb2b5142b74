"""`tierkv bench` (tierkv.cli.bench) as a command: progress lines on stderr, the JSON
report on stdout. The bench itself is tested in tests/bench/."""

from __future__ import annotations

import json

import pytest

from tierkv.cli import main


def test_bench_writes_progress_lines_when_not_a_terminal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "--tiers", "cpu", "--total", "1MiB", "--block-size", "256KiB"]
    assert main([*argv, "--keys", "0", "--repeat", "1", "--json"]) == 0
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert lines[0].startswith("[tierkv bench ") and lines[0].endswith("] starting")
    assert any("cpu: repetition 1/1" in line for line in lines), lines
    assert json.loads(captured.out)["media"][0]["medium"] == "cpu"


def test_bench_help_does_not_show_trace_as_required(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    usage = out.split("\n\n")[0]
    assert usage.startswith("usage: tierkv bench [options]")
    assert "trace ..." not in out and "positional arguments" not in out
    assert "optional subcommand" in out
