"""One medium against its raw baseline: a tier type without one gets numbers but no
ratio, and a tier that loses blocks fails the bench."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tierkv.cli import main


def test_a_tier_without_a_raw_baseline_gets_numbers_but_no_ratio(
    bench_json: Callable[..., dict[str, Any]],
    check_medium: Callable[..., None],
    chain_file: Callable[..., str],
) -> None:
    chain = chain_file("[{type: memory, capacity: 8MiB}]", primary="64KiB")
    report = bench_json("--config", chain, "--tiers", "memory", "--keys", "0")
    [memory] = report["media"]
    assert memory["medium"] == "memory" and memory["baseline"] is None
    check_medium(memory, with_ratio=False)
    assert report["orchestrator"] is None


def test_a_tier_that_loses_blocks_fails_the_bench(
    capsys: pytest.CaptureFixture[str], chain_file: Callable[..., str], tiny: list[str]
) -> None:
    # the tier keeps 256 KiB of the 1 MiB stored: the loads must come back failed
    chain = chain_file("[{type: memory, capacity: 300KiB}]", primary="64KiB")
    assert main(["bench", *tiny, "--config", chain, "--tiers", "memory"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    err = [line for line in err if not line.startswith("[tierkv bench ")]  # progress lines
    assert len(err) == 1 and "memory: " in err[0] and "failed to load" in err[0]


def test_an_nvme_tier_moving_blocks_with_o_direct_says_so_in_the_report(
    bench_json: Callable[..., dict[str, Any]],
    chain_file: Callable[..., str],
    tmp_path: Path,
) -> None:
    from tierkv_nvme import native

    if not native.AVAILABLE:
        pytest.skip(native.reason)
    probe = tmp_path / "direct-probe"
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError:
        pytest.skip("the test directory's filesystem refuses O_DIRECT")
    nvme = f"{{type: nvme, path: {tmp_path / 'nvme'}, capacity: 64MiB, direct: true}}"
    report = bench_json("--config", chain_file(f"[{nvme}]"), "--tiers", "nvme", "--keys", "0")
    [medium] = report["media"]
    assert medium["io_engine"] == "native (core queue), O_DIRECT"
