"""`tierkv bench` (tierkv.cli.bench) as a command: progress lines on stderr, the JSON
report on stdout; with --config, a temporary directory under the tiers' paths; the
usage lines. The bench itself is tested in tests/bench/."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
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


def test_bench_config_measures_in_a_temporary_directory_under_the_tiers_path(
    tmp_path: Path,
    chain_file: Callable[..., str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The nvme tier is measured on its own disk, in a `.tierkv-bench-*` directory made
    in its path, and the path is left as it was (no namespace directory, no raw
    baseline's files)."""
    import tierkv.bench.scratch

    disk = tmp_path / "nvme"
    disk.mkdir()
    (disk / "kept").write_text("a server's file")
    made: list[Path] = []
    real = tierkv.bench.scratch.make_scratch

    def make(name: str, field: str, path: Path, purpose: str) -> Path:
        made.append(real(name, field, path, purpose))
        return made[-1]

    monkeypatch.setattr(tierkv.bench.scratch, "make_scratch", make)
    config = chain_file(f"[{{type: nvme, path: {disk}, capacity: 64MiB, fsync: never}}]")
    argv = ["bench", "--config", config, "--total", "1MiB", "--block-size", "256KiB"]
    assert main([*argv, "--keys", "0", "--repeat", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [m["medium"] for m in report["media"]] == ["cpu", "nvme"]
    assert report["streaming"] is not None
    assert [p.parent for p in made] == [disk] and made[0].name.startswith(".tierkv-bench-")
    assert [p.name for p in disk.iterdir()] == ["kept"]


def test_bench_config_on_a_path_it_cannot_write_says_so_in_one_line(
    tmp_path: Path,
    chain_file: Callable[..., str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A read-only (or immutable) directory fails the run before anything is measured,
    naming the tier and the directory, not with a raw PermissionError."""
    import errno
    import tempfile

    def refuse(*args: object, **kwargs: object) -> str:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    config = chain_file(f"[{{type: nvme, path: {tmp_path}, capacity: 64MiB}}]")
    argv = ["bench", "--config", config, "--total", "1MiB", "--block-size", "256KiB"]
    assert main([*argv, "--keys", "0", "--repeat", "1", "--json"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    [line] = captured.err.strip().splitlines()
    assert line.startswith(
        f"tierkv: error: tier nvme: cannot create a directory in {tmp_path} (Operation not "
        "permitted); tierkv bench measures the tier's disk in a temporary directory there"
    )
    assert "PermissionError" not in line and "cpu: repetition" not in captured.err


def test_bench_config_where_the_path_is_under_a_file(
    tmp_path: Path, chain_file: Callable[..., str], capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")
    config = chain_file(f"[{{type: nvme, path: {tmp_path}/file/kv, capacity: 64MiB}}]")
    argv = ["bench", "--config", config, "--total", "1MiB", "--block-size", "256KiB"]
    assert main([*argv, "--keys", "0", "--repeat", "1", "--json"]) == 1
    err = capsys.readouterr().err
    assert f"tier nvme: cannot create a directory in {tmp_path}/file (Not a directory)" in err


def test_bench_trace_help_has_a_plain_usage_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "trace", "--help"]) == 0
    usage = capsys.readouterr().out.split("\n\n")[0]
    assert usage.startswith("usage: tierkv bench trace [-h]")
    assert "(see bench trace -h)" not in usage and "[options]" not in usage


@pytest.mark.parametrize(("argv", "total"), [([], 32 << 20), (["--full"], 256 << 20),
                                             (["--total", "8MiB"], 8 << 20)])  # fmt: skip
def test_bench_gpu_gets_a_size_per_transfer(
    argv: list[str], total: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--gpu` without `--total` is measured at the quick (or --full) size, not with
    no size at all."""
    import tierkv.gpu.bench

    seen: list[tuple[int, int, bool]] = []

    def fake(total_bytes: int, repeats: int, as_json: bool) -> int:
        seen.append((total_bytes, repeats, as_json))
        return 0

    monkeypatch.setattr(tierkv.gpu.bench, "run_gpu_bench", fake)
    assert main(["bench", "--gpu", *argv]) == 0
    assert seen == [(total, 3, False)]
