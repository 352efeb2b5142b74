"""`tierkv bench` (tierkv.cli.bench) as a command: progress lines on stderr, the JSON
report on stdout. The bench itself is tested in tests/bench/."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

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


def _options_of(monkeypatch: pytest.MonkeyPatch, *argv: str) -> Any:
    """The `BenchOptions` that `tierkv bench argv` runs with (nothing measured)."""
    import tierkv.bench

    seen: list[Any] = []

    async def fake(chain: object, options: Any, **kwargs: object) -> dict[str, Any]:
        seen.append(options)
        raise KeyboardInterrupt  # stop here: only the options matter

    monkeypatch.setattr(tierkv.bench, "run_bench", fake)
    assert main(["bench", *argv, "--json"]) == 130
    return seen[0]


def test_bench_without_flags_is_a_quick_run_and_full_the_long_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    quick = _options_of(monkeypatch)
    assert (quick.total_bytes, quick.orchestrator_keys) == (32 << 20, 100_000)
    full = _options_of(monkeypatch, "--full")
    assert (full.total_bytes, full.orchestrator_keys) == (256 << 20, 1_000_000)
    mine = _options_of(monkeypatch, "--full", "--total", "64MiB", "--keys", "0")
    assert (mine.total_bytes, mine.orchestrator_keys) == (64 << 20, 0)


def test_bench_fails_on_an_unreachable_tier_before_measuring_anything(
    broken_tier: str, chain_file: Callable[..., str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A tier that cannot open (as an unreachable Redis) fails the run before the cpu
    phase, naming the tier."""
    config = chain_file(f"[{{type: {broken_tier}}}]")
    argv = ["bench", "--config", config, "--total", "1MiB", "--block-size", "256KiB"]
    assert main([*argv, "--keys", "0", "--repeat", "1", "--json"]) == 1
    captured = capsys.readouterr()
    assert "tier broken cannot open, nothing measured" in captured.err
    assert "connection refused by 127.0.0.1:1" in captured.err
    assert "cpu: repetition" not in captured.err and captured.out == ""
