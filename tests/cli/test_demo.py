"""`tierkv demo` (tierkv.cli.demo): the summary's three columns, the plot, usage
errors, one-line runtime errors, progress lines; and a run that repeats: the tiers'
files in a fresh temporary directory, removed at exit, unless --keep."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tierkv.cli import main

TINY_DEMO = [
    "--users", "2", "--turns", "2", "--system-tokens", "64", "--message-tokens", "32",
    "--reply-tokens", "2", "--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "256",
]  # fmt: skip


def without_progress(stderr: str) -> list[str]:
    """stderr's lines less the progress lines (written when stderr is not a terminal)."""
    return [line for line in stderr.strip().splitlines() if not line.startswith("[tierkv ")]


def test_options_the_model_cannot_take_are_usage_errors(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", "--hidden", "30", "--heads", "4"]) == 2
    assert "demo: error: hidden 30 must split into 4 heads" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_demo_on_cuda_without_a_device_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", "--device", "cuda"]) == 2
    assert "no CUDA device is available" in capsys.readouterr().err


def test_a_tier_that_cannot_open_is_a_runtime_failure_in_one_line(
    tmp_path: Path,
    broken_tier: str,
    capsys: pytest.CaptureFixture[str],
    chain_file: Callable[..., str],
) -> None:
    config = chain_file("[{type: broken}]")
    assert main(["demo", *TINY_DEMO, "--config", config]) == 1
    err = without_progress(capsys.readouterr().err)
    assert err == [
        "tierkv: error: tier 'broken' failed to open: ConnectionRefusedError: connection "
        "refused by 127.0.0.1:1 (--verbose for the traceback)"
    ]
    assert main(["demo", *TINY_DEMO, "--config", config, "--verbose"]) == 1
    err_text = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err_text
    assert err_text.strip().splitlines()[-1].startswith("tierkv: error: tier 'broken'")


def test_demo_prints_three_columns_and_draws_the_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    plot = tmp_path / "ttft.png"
    assert main(["demo", *TINY_DEMO, "--device", "cpu", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "no cache" in line)
    assert header.index("no cache") < header.index("GPU prefix cache") < header.index("+ tierkv")
    for text in (
        "TTFT mean",
        "speed-up",
        "GPU prefix cache",
        "primary (cpu)",
        "nvme",
        "recomputed",
    ):
        assert text in out
    assert "correctness: greedy tokens identical in 4/4 turns" in out and ": OK" in out
    assert f"plot: {plot}" in out
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_demo_json_has_the_three_columns(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *TINY_DEMO, "--device", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["columns"] == ["no_cache", "gpu_prefix_cache", "tierkv"]
    assert all(isinstance(report["ttft"][c]["mean_ms"], float) for c in report["columns"])
    assert report["ok"] is True and isinstance(report["kv_cache"]["gpu_blocks"], int)


@pytest.mark.parametrize("kind", ["window", "state"])
def test_hybrid_demo_prints_bytes_moved_per_kv_group(
    kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    hybrid = ["--layers", "2", "--hybrid", kind, *(["--window", "40"] if kind == "window" else [])]
    assert main(["demo", *TINY_DEMO, "--device", "cpu", *hybrid]) == 0
    out = capsys.readouterr().out
    other = "sliding_window (40 tokens)" if kind == "window" else "state"
    assert f"hybrid: layers full, {kind}" in out
    assert "per KV group (tierkv column; every block moves as one" in out
    rows = [line for line in out.splitlines() if line.startswith(("0 full", f"1 {other}"))]
    assert len(rows) == 2, out
    assert f"{other} layers moved" in out and "full-attention layers of the same size" in out
    assert "correctness: greedy tokens identical in 4/4 turns" in out and ": OK" in out


def test_hybrid_demo_json_has_the_groups(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            ["demo", *TINY_DEMO, "--device", "cpu", "--layers", "2", "--hybrid", "window", "--json"]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True
    assert report["model"]["hybrid"] == {"kind": "window", "window": 96, "checkpoint_every": None}
    assert report["skipped_blocks"] == 0  # every boundary is a checkpoint: nothing skipped
    assert [g["kind"] for g in report["groups"]] == ["full", "sliding_window"]
    assert report["groups"][1]["window_tokens"] == 96  # 3 offloaded blocks of 32 by default


def test_hybrid_options_that_do_not_fit_are_usage_errors(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", *TINY_DEMO, "--window", "64"]) == 2
    assert "--window needs --hybrid window" in capsys.readouterr().err
    assert main(["demo", *TINY_DEMO, "--hybrid", "state"]) == 2  # TINY_DEMO has 1 layer
    assert "a hybrid model needs at least 2 layers" in capsys.readouterr().err
    assert main(["demo", *TINY_DEMO, "--layers", "2", "--hybrid", "window", "--window", "1"]) == 2
    assert "a sliding window needs at least 2 tokens" in capsys.readouterr().err
    assert main(["demo", *TINY_DEMO, "--checkpoint-every", "64"]) == 2
    assert "--checkpoint-every needs --hybrid" in capsys.readouterr().err
    assert (
        main(["demo", *TINY_DEMO, "--layers", "2", "--hybrid", "state", "--checkpoint-every", "40"])
        == 2
    )
    assert (
        "--checkpoint-every 40 is not a multiple of the offloaded block (32 tokens); use e.g. 32"
        in capsys.readouterr().err
    )


def test_hybrid_state_demo_with_checkpoints_stores_fewer_states_and_still_agrees(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """States between checkpoints are not stored; hits land on checkpoints or on a
    request's end, and every column still produces the no-cache tokens."""
    args = ["demo", *TINY_DEMO, "--device", "cpu", "--layers", "2", "--hybrid", "state"]
    assert main([*args, "--json"]) == 0
    every = json.loads(capsys.readouterr().out)
    assert main([*args, "--checkpoint-every", "64", "--json"]) == 0
    sparse = json.loads(capsys.readouterr().out)
    assert every["ok"] and sparse["ok"]
    assert every["skipped_blocks"] == 0 < sparse["skipped_blocks"]
    stored = [g["blocks_stored"] for g in sparse["groups"]]
    assert stored[1] < stored[0] == every["groups"][0]["blocks_stored"]


def test_demo_plot_without_matplotlib_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    assert main(["demo", *TINY_DEMO, "--plot", "x.png"]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_progress_lines_when_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    """Under capsys stderr is a pipe, as in CI or `tierkv demo 2> log`."""
    assert main(["demo", *TINY_DEMO, "--json"]) == 0
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert lines and all(line.startswith("[tierkv demo ") for line in lines), lines
    assert any("turn" in line for line in lines)
    json.loads(captured.out)  # the progress never mixes into the JSON on stdout


# -- a run that repeats: the tiers' files in a temporary directory (issue 23) ---------------
@pytest.fixture
def temp_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The system's temporary directory for this test (where the demo's scratch
    directory and a default plot go)."""
    import tempfile

    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


SMALL_DEMO = [
    "--users", "3", "--turns", "3", *TINY_DEMO[4:], "--device", "cpu", "--primary", "32KiB",
]  # fmt: skip
"""Three users, three turns, a primary of 4 blocks: the disk tier serves (1-2 s)."""


def shares(report: dict[str, object]) -> dict[str, object]:
    tiers = report["tiers"]
    assert isinstance(tiers, dict)
    return {
        "gpu": report["gpu_hit_rate"],
        "recomputed": report["recomputed_block_rate"],
        **{name: t["hit_rate"] for name, t in tiers.items()},
        "stored": report["stored_blocks"],
    }


def test_demo_twice_in_a_row_gives_the_same_shares(
    tmp_path: Path,
    temp_root: Path,
    capsys: pytest.CaptureFixture[str],
    chain_file: Callable[..., str],
) -> None:
    kv = tmp_path / "kv"
    config = chain_file(f"[{{type: nvme, path: {kv}, capacity: 64MiB, fsync: never}}]")
    argv = ["demo", *SMALL_DEMO, "--config", config]
    reports = []
    for _ in range(2):
        assert main([*argv, "--json"]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    first, second = reports
    assert first["tiers"]["nvme"]["blocks_served"] > 0  # the disk tier really served
    assert shares(first) == shares(second)
    for report in reports:
        assert report["earlier_run"] == {"blocks_at_start": {"nvme": 0}, "served_blocks": 0}
        assert report["tier_files"]["temporary"] is True
        [path] = report["tier_files"]["paths"]["nvme"]
        assert Path(path).is_relative_to(temp_root) and Path(path).name == "kv"
    assert not kv.exists(), "the config's own path is left alone"
    assert list(temp_root.iterdir()) == [], "the temporary directory is removed at exit"
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "tier files: in a temporary directory, removed at exit" in out
    assert "earlier run" not in out


def test_demo_keep_uses_the_configs_paths_and_reports_an_earlier_run(
    tmp_path: Path,
    temp_root: Path,
    capsys: pytest.CaptureFixture[str],
    chain_file: Callable[..., str],
) -> None:
    kv = tmp_path / "kv"
    config = chain_file(f"[{{type: nvme, path: {kv}, capacity: 64MiB, fsync: never}}]")
    argv = ["demo", *SMALL_DEMO, "--config", config]
    assert main([*argv, "--keep", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["earlier_run"]["served_blocks"] == 0
    assert first["tier_files"] == {"temporary": False, "paths": {"nvme": [str(kv)]}}
    assert any(kv.rglob("*")), "the blocks stay in the config's path"
    assert main([*argv, "--keep"]) == 0
    out = capsys.readouterr().out
    assert f"tier files: kept (nvme {kv})" in out
    [line] = [line for line in out.splitlines() if "from an earlier run" in line]
    held = first["stored_blocks"]  # every block the first run stored is on the disk
    assert line.startswith(f"{held:,} blocks found from an earlier run (nvme {held:,}); ")
    assert list(temp_root.iterdir()) == []


def test_demo_keep_needs_a_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *TINY_DEMO, "--device", "cpu", "--keep"]) == 2
    assert "demo: error: --keep needs --config FILE" in capsys.readouterr().err


def test_the_temporary_directory_goes_when_the_demo_fails(
    tmp_path: Path,
    temp_root: Path,
    broken_tier: str,
    capsys: pytest.CaptureFixture[str],
    chain_file: Callable[..., str],
) -> None:
    config = chain_file(f"[{{type: nvme, path: {tmp_path}/kv, capacity: 1MiB}}, {{type: broken}}]")
    assert main(["demo", *TINY_DEMO, "--device", "cpu", "--config", config]) == 1
    assert "tier 'broken' failed to open" in capsys.readouterr().err
    assert list(temp_root.iterdir()) == []


def test_sigterm_ends_the_demo_as_ctrl_c_does_and_removes_its_directory(
    tmp_path: Path, chain_file: Callable[..., str]
) -> None:
    import os
    import signal
    import subprocess

    temp = tmp_path / "tmp"
    temp.mkdir()
    config = chain_file(f"[{{type: nvme, path: {tmp_path}/kv, capacity: 64MiB}}]")
    cmd = [
        sys.executable, "-m", "tierkv.cli", "demo", *TINY_DEMO, "--device", "cpu",
        "--config", config, "--json", "--linger", "60",
    ]  # fmt: skip
    env = {**os.environ, "TMPDIR": str(temp)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the report comes before the linger
            if line.rstrip() == "}":
                break
        assert any(temp.iterdir()), "the demo's directory exists while it runs"
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "tierkv: interrupted" in err
    assert list(temp.iterdir()) == []
    assert not (tmp_path / "kv").exists()


def test_plot_without_a_file_goes_to_the_temporary_directory(
    temp_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    assert main(["demo", *TINY_DEMO, "--device", "cpu", "--plot"]) == 0
    [plot] = temp_root.glob("tierkv-demo-ttft-*.png")
    assert f"plot: {plot}" in capsys.readouterr().out
    assert plot.read_bytes().startswith(b"\x89PNG")
