"""The `tierkv` command: the placeholder main job, validate, plugins, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tierkv.cli import main


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
