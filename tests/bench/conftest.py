"""Shared by the bench's tests: `tierkv bench` on tiny sizes (`TINY`), run through the
CLI for its JSON report (`bench_json`), and the checks every measured medium passes
(`check_medium`). Numbers are only checked to exist, never timed."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from tierkv.cli import main

TINY = [
    "--block-size", "128KiB", "--total", "1MiB", "--batch", "2", "--concurrency", "2",
    "--repeat", "2", "--keys", "512", "--lookup-batch", "64", "--json",
]  # fmt: skip


@pytest.fixture
def tiny() -> list[str]:
    """The CLI flags of a tiny bench, ending with `--json`."""
    return list(TINY)


@pytest.fixture
def bench_json(capsys: pytest.CaptureFixture[str]) -> Callable[..., dict[str, Any]]:
    """`bench_json(*args)`: the JSON report of `tierkv bench` on tiny sizes plus `args`."""

    def run(*args: str) -> dict[str, Any]:
        assert main(["bench", *TINY, *args]) == 0, capsys.readouterr().err
        report: dict[str, Any] = json.loads(capsys.readouterr().out)
        return report

    return run


def _check_medium(entry: dict[str, Any], with_ratio: bool) -> None:
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


@pytest.fixture
def check_medium() -> Callable[..., None]:
    """`check_medium(entry, with_ratio)`: one medium's store and load figures exist,
    with a ratio to the raw medium or without one."""
    return _check_medium
