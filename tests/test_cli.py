"""The `tierkv` command: usage and exit codes, one-line errors, validate (--connect),
plugins, the demo's summary, and the roundtrip job."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tierkv
from tierkv.cli import main
from tierkv.errors import PluginImportError
from tierkv.memory_tier import MemoryTier
from tierkv.registry import register_tier, unregister_tier


def test_roundtrip_default_chain_reads_everything_back(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["roundtrip", "--blocks", "40", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["blocks"] == 40
    assert report["mismatched"] == 0 and report["missing"] == 0
    # the primary is smaller than the data, so blocks really came back from the tier
    assert report["primary_blocks"] < 40
    assert report["tier_blocks"] == {"memory": 40}
    assert report["promoted"]["memory"] >= 40 - report["primary_blocks"]


def test_roundtrip_with_a_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "chain.yaml"
    cfg.write_text(
        "namespace: t\nlayout: {block_bytes: 4KiB, groups: [{block_size: 16}]}\n"
        "primary: {capacity: 16KiB, eviction: lru, pin_memory: false}\n"
        "tiers: [{type: memory, capacity: 1MiB}]\n"
    )
    assert main(["roundtrip", "--config", str(cfg), "--blocks", "10"]) == 0
    out = capsys.readouterr().out
    assert "every block read back byte-identical" in out and "primary holds 4 blocks" in out


def test_roundtrip_fails_when_a_tier_cannot_hold_the_data(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    cfg = tmp_path / "small.yaml"
    cfg.write_text(
        "namespace: t\nlayout: {block_bytes: 4KiB, groups: [{block_size: 16}]}\n"
        "primary: {capacity: 16KiB, pin_memory: false}\n"
        "tiers: [{type: memory, capacity: 20KiB}]\n"
    )
    assert main(["roundtrip", "--config", str(cfg), "--blocks", "12"]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_validate_reports_ok_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(
        "namespace: t\nlayout: {block_bytes: 4KiB, groups: [{block_size: 16}]}\n"
        "primary: {capacity: 1MiB}\ntiers: [{type: memory}]\n"
    )
    assert main(["validate", str(good)]) == 0
    assert "ok (namespace 't', 256 primary blocks, tiers: memory)" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text(good.read_text().replace("memory", "floppy"))
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "tiers[0].type: unknown tier type 'floppy'" in err


def test_plugins_lists_memory(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins"]) == 0
    assert "memory" in capsys.readouterr().out


def test_console_script_runs_as_a_module() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tierkv.cli", "validate", "/nonexistent.yaml"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert "cannot read config file" in done.stderr


# -- usage, exit codes, one-line errors ----------------------------------------------------
TINY_DEMO = [
    "--users", "2", "--turns", "2", "--system-tokens", "64", "--message-tokens", "32",
    "--reply-tokens", "2", "--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "256",
]  # fmt: skip


class BrokenTier(MemoryTier):
    """Fails to open, as an unreachable server does."""

    @staticmethod
    def get_tier_type() -> str:
        return "broken"

    async def open(self) -> None:
        raise ConnectionRefusedError("connection refused by 127.0.0.1:1")


@pytest.fixture
def broken_tier() -> Iterator[str]:
    register_tier(BrokenTier)
    yield "broken"
    unregister_tier("broken")


def without_progress(stderr: str) -> list[str]:
    """stderr's lines less the progress lines (written when stderr is not a terminal)."""
    return [line for line in stderr.strip().splitlines() if not line.startswith("[tierkv ")]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required: COMMAND"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["demo", "--users", "0"], "0 must be at least 1"),
        (["demo", "--metrics-port", "70000"], "70000 is not a TCP port"),
        (["demo", "--primary", "lots"], "'lots' is not a size"),
        (["bench", "--repeat", "x"], "'x' is not an integer"),
        (["validate"], "the following arguments are required: file"),
    ],
)
def test_bad_usage_exits_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("demo", "bench", "validate", "plugins", "roundtrip"):
        assert command in out


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


def test_a_bad_config_is_exit_2_for_every_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], chain_file: Callable[..., str]
) -> None:
    config = chain_file("[{type: memory, capactiy: 1GiB}]")
    for command in ("demo", "bench", "validate"):
        argv = [command, config] if command == "validate" else [command, "--config", config]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "tiers[0].capactiy: unknown field; did you mean 'capacity'?" in err


# -- validate --connect --------------------------------------------------------------------
def test_validate_connect_opens_each_tier_and_times_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], chain_file: Callable[..., str]
) -> None:
    config = chain_file(f"[{{type: memory}}, {{type: nvme, path: {tmp_path}/kv, capacity: 1MiB}}]")
    assert main(["validate", "--connect", config]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("tiers: memory, nvme)")
    assert lines[1].startswith("  memory: ok (open ") and "ms, lookup " in lines[1]
    assert lines[2].startswith("  nvme: ok (open ")


def test_validate_connect_reports_a_tier_it_cannot_reach(
    tmp_path: Path,
    broken_tier: str,
    capsys: pytest.CaptureFixture[str],
    chain_file: Callable[..., str],
) -> None:
    config = chain_file("[{type: memory}, {type: broken}]")
    assert main(["validate", config]) == 0  # the file itself is fine
    capsys.readouterr()
    assert main(["validate", "--connect", config]) == 1
    captured = capsys.readouterr()
    assert "  memory: ok (open " in captured.out
    assert (
        "  broken: FAILED: open failed: ConnectionRefusedError: connection refused by "
        "127.0.0.1:1" in captured.out
    )
    assert captured.err.strip() == "tierkv: error: cannot use tier broken"


# -- plugins -----------------------------------------------------------------------------
def test_plugins_lists_packages_versions_and_config_fields(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["plugins", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    memory = report["types"]["memory"]
    assert memory["distribution"] == "tierkv-cache" and memory["version"] == tierkv.__version__
    assert memory["target"] == "tierkv.memory_tier:MemoryTier"
    capacity = memory["fields"]["capacity"]
    assert capacity["default"] == 1 << 30 and capacity["unit"] == "bytes"
    assert capacity["default_text"] == "1GiB"
    assert "write_policy" not in memory["fields"]  # common fields are listed once
    common = report["common_fields"]
    assert common["write_policy"]["default"] == "write_through"
    assert common["required"]["default"] is True and common["required"]["default_text"] == "true"
    assert common["job_timeout"]["default"] == 30.0 and common["job_timeout"]["unit"] == "seconds"
    assert common["job_timeout"]["default_text"] == "30s"
    assert common["max_inflight_bytes"]["default"] == 256 << 20
    assert common["name"]["default"] is None and not common["name"]["required"]
    nvme = report["types"].get("nvme")
    if nvme is not None:  # installed in CI and in the dev setup
        assert nvme["distribution"] == "tierkv-cache-nvme"
        assert (
            nvme["fields"]["path"]["required"] and nvme["fields"]["io_concurrency"]["default"] == 8
        )

    assert main(["plugins"]) == 0
    text = capsys.readouterr().out
    assert "memory" in text and "tierkv.memory_tier:MemoryTier" in text
    assert "every tier also takes" in text and "write_through_selective" in text


def test_plugins_reports_a_broken_plugin_and_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import tierkv.cli

    real = tierkv.cli.get_tier_class

    def flaky(name: str) -> Any:
        if name == "memory":
            raise PluginImportError("tier type 'memory' failed to import: ImportError: boom")
        return real(name)

    monkeypatch.setattr(tierkv.cli, "get_tier_class", flaky)
    assert main(["plugins"]) == 1
    assert "memory: BROKEN: tier type 'memory' failed to import" in capsys.readouterr().out


# -- the demo's text summary ---------------------------------------------------------------
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


def test_demo_plot_without_matplotlib_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    assert main(["demo", *TINY_DEMO, "--plot", "x.png"]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err


def test_plain_tables_without_rich() -> None:
    import io

    from tierkv.demo.report import TextTable, render

    out = io.StringIO()
    render(
        ["head", TextTable(["name", "n"], [["a", "1"], ["bbb", "22"]], title="t")],
        out,
        use_rich=False,
    )
    assert out.getvalue() == "head\nt\nname   n\na      1\nbbb   22\n"


# -- issue 14: version, pipes, progress, validate against the machine -----------------------
def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert (
        capsys.readouterr().out.strip()
        == f"tierkv {tierkv.__version__} (distribution tierkv-cache)"
    )


def test_every_command_has_a_description() -> None:
    from tierkv.cli import build_parser

    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for name, command in sub.choices.items():
        assert command.description and len(command.description) > 40, name
        assert command.format_help().count("\n") > 3


def test_a_closed_pipe_ends_quietly() -> None:
    """`tierkv plugins --json | head -1`: no BrokenPipeError, no traceback."""
    reader = subprocess.Popen(["head", "-c", "1"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    assert reader.stdin is not None
    done = subprocess.run(
        [sys.executable, "-m", "tierkv.cli", "plugins", "--json"],
        stdout=reader.stdin,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    )
    reader.stdin.close()
    reader.wait(timeout=30)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert done.returncode in (0, 141)


def test_closed_pipe_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    class Closed(io.StringIO):
        def write(self, s: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self) -> int:
            return os.open(os.devnull, os.O_WRONLY)

    monkeypatch.setattr(sys, "stdout", Closed())
    assert main(["plugins", "--json"]) == 141


def test_progress_lines_when_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    """Under capsys stderr is a pipe, as in CI or `tierkv demo 2> log`."""
    assert main(["demo", *TINY_DEMO, "--json"]) == 0
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert lines and all(line.startswith("[tierkv demo ") for line in lines), lines
    assert any("turn" in line for line in lines)
    json.loads(captured.out)  # the progress never mixes into the JSON on stdout


def test_progress_writes_a_line_per_phase_or_every_few_seconds() -> None:
    import io

    from tierkv.cli import _Progress

    out = io.StringIO()
    with _Progress(True, None, "starting", command="bench", every=3600, stream=out) as p:
        p.update("cpu: repetition 1/3, tierkv")
        p.update("cpu: repetition 1/3, raw")  # same phase, too soon: no line
        p.update("nvme: repetition 1/3, tierkv")
    text = out.getvalue().splitlines()
    assert [line.split("] ", 1)[1] for line in text] == [
        "starting",
        "cpu: repetition 1/3, tierkv",
        "nvme: repetition 1/3, tierkv",
    ]
    out = io.StringIO()
    with _Progress(True, None, "starting", command="bench", every=0, stream=out) as p:
        p.update("cpu: repetition 1/3, tierkv")
        p.update("cpu: repetition 1/3, raw")  # `every` passed: a line
    assert len(out.getvalue().splitlines()) == 3


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            "primary: {capacity: 99999TiB}\ntiers: []\n",
            "primary.capacity: 99999TiB is more than this machine's memory",
        ),
        (
            "primary: {capacity: 1MiB}\ntiers: [{type: nvme, path: PATH/kv, capacity: 500TiB}]\n",
            "tiers[0].capacity: 500TiB is more than the filesystem under 'PATH' holds",
        ),
        (
            "primary: {capacity: 1MiB}\n"
            "tiers: [{type: nvme, path: PATH/kv, capacity: 1MiB}, "
            "{type: nvme, path: PATH/kv, capacity: 1MiB}]\n",
            "tiers[1].path: 'PATH/kv' is also the path of tiers[0]",
        ),
        ("primary: {capacity: 1MiB}\nprimary: {capacity: 2MiB}\n", "primary: duplicate key"),
        (
            "primary: {capacity: 1MiB}\ntiers: [{type: memory, name: cpu}]\n",
            "tiers[0].name: 'cpu' is the primary's name",
        ),
    ],
)
def test_validate_exits_2_naming_the_path(
    body: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "chain.yaml"
    path.write_text(
        "namespace: t\nlayout: {block_bytes: 4KiB, groups: [{block_size: 16}]}\n"
        + body.replace("PATH", str(tmp_path))
    )
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"invalid tierkv config in {path}:" in err
    assert message.replace("PATH", str(tmp_path)) in err, err


def test_validate_a_file_that_is_not_utf8_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "chain.yaml"
    path.write_bytes(b"namespace: caf\xe9\n")
    assert main(["validate", str(path)]) == 2
    assert "line 1, column 15: byte 0xe9 is not UTF-8" in capsys.readouterr().err


def test_validate_never_prints_a_secret(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "chain.yaml"
    path.write_text(
        "namespace: t\nlayout: {block_bytes: 4KiB, groups: [{block_size: 16}]}\n"
        "primary: {capacity: 1MiB}\n"
        "tiers:\n  - 'redis://:hunter2@10.0.0.5:6379/0'\n"
        "  - {type: s3, url: 's3://AKIA:hunter2@bucket/p'}\n"
    )
    assert main(["validate", str(path)]) == 2
    captured = capsys.readouterr()
    assert "hunter2" not in captured.err + captured.out
    assert "tiers[0]: expected a mapping" in captured.err


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
