"""`tierkv roundtrip` (tierkv.cli.roundtrip): every block read back, through the
default chain or a config file, and exit 1 when a tier cannot hold the data."""

from __future__ import annotations

import json
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
