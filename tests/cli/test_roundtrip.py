"""`tierkv roundtrip` (tierkv.cli.roundtrip): every block read back through a
TieredCache of the default chain or a config file, each tier written by its policies,
optional tiers that cannot open skipped, and exit 1 when a tier cannot hold the data."""

from __future__ import annotations

import json
from collections.abc import Callable
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


def _nvme_chain(tmp_path: Path) -> Path:
    """A chain whose nvme tier, named `disk`, lives under `tmp_path/nvme`."""
    cfg = tmp_path / "nvme.yaml"
    cfg.write_text(
        "namespace: t\nlayout: {block_bytes: 4KiB, groups: [{block_size: 16}]}\n"
        "primary: {capacity: 16KiB, pin_memory: false}\n"
        f"tiers: [{{type: nvme, name: disk, capacity: 1MiB, fsync: never, "
        f"path: {tmp_path / 'nvme'}}}]\n"
    )
    return cfg


def test_roundtrip_writes_into_a_temporary_directory_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --keep the config's own nvme directory is never touched (the files go to
    a temporary directory, removed), and the report names the tier as the YAML does."""
    assert main(["roundtrip", "--config", str(_nvme_chain(tmp_path)), "--blocks", "10"]) == 0
    out = capsys.readouterr().out
    assert not (tmp_path / "nvme").exists()
    assert "tier disk: holds 10 of 10 blocks" in out
    assert "temporary, removed" in out and "roundtrip-" in out


def test_roundtrip_twice_with_kept_blocks_reports_no_corruption(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An earlier run's blocks (kept, other bytes under other counts) are not read as
    this run's: each run hashes its keys under a namespace of its own."""
    cfg = str(_nvme_chain(tmp_path))
    assert main(["roundtrip", "--config", cfg, "--blocks", "8", "--keep"]) == 0
    assert main(["roundtrip", "--config", cfg, "--blocks", "12", "--keep", "--json"]) == 0
    capsys.readouterr()
    assert (tmp_path / "nvme").is_dir()
    assert main(["roundtrip", "--config", cfg, "--blocks", "12", "--keep", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["mismatched"] == 0 and report["kept"]


def test_roundtrip_removes_its_blocks_from_a_tier_without_files(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A memory tier (as Redis or S3 would) is asked to remove every block at the end."""
    import anyio

    from tierkv.config import parse_config
    from tierkv.memory_tier import MemoryTier
    from tierkv.roundtrip import run_roundtrip

    removed: list[int] = []
    real_remove = MemoryTier.remove

    async def remove(self: MemoryTier, keys: object) -> None:
        removed.append(len(list(keys)))  # type: ignore[call-overload]
        await real_remove(self, keys)  # type: ignore[arg-type]

    config = parse_config(
        "namespace: t\nlayout: {block_bytes: 4KiB, groups: [{block_size: 16}]}\n"
        "primary: {capacity: 16KiB, pin_memory: false}\n"
        "tiers: [{type: memory, capacity: 1MiB}]\n",
        source="test",
    )
    monkeypatch.setattr(MemoryTier, "remove", remove)
    report = anyio.run(lambda: run_roundtrip(config, 6, 0, remove_after=True))
    assert report["ok"] and removed == [6]


def test_roundtrip_follows_each_tiers_write_policy(
    chain_file: Callable[..., str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Through TieredCache: a tier written only blocks looked up twice holds none of
    the blocks stored once (issue 53), a write-back tier holds them all after the
    flush, and the round trip passes: that is the chain as configured."""
    config = chain_file(
        "[{type: memory, capacity: 1MiB}, "
        "{type: memory, name: twice, capacity: 1MiB, write_policy: write_through_selective}, "
        "{type: memory, name: later, capacity: 1MiB, write_policy: write_back}]",
        primary="64KiB",
    )
    assert main(["roundtrip", "--config", config, "--blocks", "32", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["mismatched"] == 0
    assert report["tier_blocks"] == {"memory": 32, "twice": 0, "later": 32}
    assert any(
        "tier twice: holds 0 of 32 blocks (write_through_selective: only blocks looked up 2 "
        "times)" in line
        for line in report["lines"]
    )


def test_roundtrip_reports_blocks_the_policies_kept_nowhere_without_failing(
    chain_file: Callable[..., str], capsys: pytest.CaptureFixture[str]
) -> None:
    """With only a selective tier, the blocks the primary evicted are kept nowhere:
    said (not kept, as configured), and every block the chain kept reads back."""
    config = chain_file(
        "[{type: memory, capacity: 1MiB, write_policy: write_through_selective}]",
        primary="16KiB",
    )
    assert main(["roundtrip", "--config", config, "--blocks", "12"]) == 0
    out = capsys.readouterr().out
    assert "tier memory: holds 0 of 12 blocks" in out
    assert "not kept: 8 blocks the chain's policies kept out of every tier" in out
    assert "result: every block the chain kept read back byte-identical" in out


def test_roundtrip_skips_an_optional_tier_that_cannot_open(
    broken_tier: str, chain_file: Callable[..., str], capsys: pytest.CaptureFixture[str]
) -> None:
    """An optional tier that cannot open (an unreachable Redis with required: false) is
    skipped, as the cache runs without it; a required one fails the run (exit 1)."""
    tiers = "[{type: memory, capacity: 1MiB}, {type: %s, required: %s}]"
    config = chain_file(tiers % (broken_tier, "false"))
    assert main(["roundtrip", "--config", config, "--blocks", "10", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["tier_blocks"] == {"memory": 10}
    assert "connection refused by 127.0.0.1:1" in report["skipped"]["broken"]
    assert any(
        line.startswith("  tier broken: skipped: optional (required: false)")
        and line.endswith("the cache runs without it")
        for line in report["lines"]
    )
    config = chain_file(tiers % (broken_tier, "true"))
    assert main(["roundtrip", "--config", config, "--blocks", "10"]) == 1
    assert "tier 'broken' failed to open" in capsys.readouterr().err
