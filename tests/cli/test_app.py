"""The parser and `main` (tierkv.cli.app): usage and exit codes, one-line errors,
--help and --version, `python -m tierkv.cli`, a closed stdout, the command's own
logging."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import tierkv
from tierkv.cli import main


def test_console_script_runs_as_a_module() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tierkv.cli", "validate", "/nonexistent.yaml"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert "cannot read config file" in done.stderr


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


def test_a_bad_config_is_exit_2_for_every_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], chain_file: Callable[..., str]
) -> None:
    config = chain_file("[{type: memory, capactiy: 1GiB}]")
    for command in ("demo", "bench", "validate"):
        argv = [command, config] if command == "validate" else [command, "--config", config]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "tiers[0].capactiy: unknown field; did you mean 'capacity'?" in err


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


class _ClosesAfterFirstLine:
    """A stdout whose reader leaves after the first line (`| head -1`)."""

    def __init__(self) -> None:
        self.lines = 0

    def write(self, text: str) -> int:
        if self.lines:
            raise BrokenPipeError(32, "Broken pipe")
        self.lines += text.count("\n")
        return len(text)

    def flush(self) -> None:
        if self.lines > 1:
            raise BrokenPipeError(32, "Broken pipe")

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return os.open(os.devnull, os.O_WRONLY)


@pytest.mark.parametrize(
    "argv",
    [
        ["plugins"],
        ["demo", "--users", "1", "--turns", "1", "--system-tokens", "32"],
        ["--help"],
        ["bench", "--help"],
    ],
)
def test_head_1_exits_141(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> None:
    """`tierkv plugins | head -1`, `tierkv demo | head -1`: exit 141 as a Unix tool
    killed by SIGPIPE, also when the text goes through rich (whose own answer to a
    closed pipe is exit 1)."""
    monkeypatch.setattr(sys, "stdout", _ClosesAfterFirstLine())
    assert main(argv) == 141


def test_help_imports_no_torch() -> None:
    """`tierkv --help` builds every command's parser without importing torch (or the
    config, which imports it): each command imports what it needs when it runs."""
    code = (
        "import sys, contextlib, io\n"
        "from tierkv.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['--help']) == 0\n"
        "heavy = sorted(m for m in ('torch', 'numpy', 'tierkv.config') if m in sys.modules)\n"
        "print(heavy)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_engine_import_noise_is_left_out_unless_verbose(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command's own logging: vLLM's missing-kernels warning and LMCache's INFO
    lines are left out (a level the user gave LMCache stays theirs); vLLM's other
    warnings pass; --verbose shows everything."""
    import logging

    from tierkv.cli.app import configure_logging

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger = logging.getLogger("vllm.platforms.interface")
    handler = Keep()
    logger.addHandler(handler)
    monkeypatch.delenv("LMCACHE_LOG_LEVEL", raising=False)
    try:
        configure_logging(False)
        logger.warning("Failed to import from vllm._C: %r", ModuleNotFoundError("vllm._C"))
        logger.warning("a real warning")
        assert seen == ["a real warning"]
        assert os.environ["LMCACHE_LOG_LEVEL"] == "WARNING"
        monkeypatch.setenv("LMCACHE_LOG_LEVEL", "DEBUG")
        configure_logging(False)
        assert os.environ["LMCACHE_LOG_LEVEL"] == "DEBUG"
        configure_logging(True)
        logger.warning("Failed to import from vllm._C: again")
        assert seen[-1] == "Failed to import from vllm._C: again"
    finally:
        logger.removeHandler(handler)
        configure_logging(False)
