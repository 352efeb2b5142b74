"""`tierkv lmcache check` (tierkv.cli.lmcache) as a command: a chain file keeps the
adapter's lookup deadline, the machine checks apply, `--round-trip` leaves nothing in
the tiers, and no engine import noise reaches the terminal. Reading real specs with
LMCache's parser is tested in tests/integrations/lmcache/test_lmcache_check.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tierkv.cli import main
from tierkv.testing import missing_server

PLUGIN = {
    "type": "plugin",
    "module_path": "tierkv.integrations.lmcache",
    "class_name": "TierkvL2Adapter",
}


def spec(**params: Any) -> str:
    return json.dumps({**PLUGIN, "adapter_params": params})


def lmcache() -> None:
    """Skip (fail under CI=true) where LMCache is not installed."""
    try:
        import lmcache.v1.check.check_mode_test_l2_adapter  # noqa: F401
    except Exception as exc:
        missing_server("lmcache 0.5.6 (bash scripts/setup-lmcache.sh)", exc)


@pytest.mark.parametrize(("line", "lookup"), [("", "1s"), ("lookup_timeout: 250ms\n", "0.25s")])
def test_a_chain_file_keeps_the_adapters_lookup_deadline(
    line: str, lookup: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`"chain"` in place of `"tiers"`: a lookup waits 1 s as with inline tiers (not the
    embedded cache's 50 ms default), unless the file sets its own lookup_timeout."""
    chain = tmp_path / "chain.yaml"
    chain.write_text(
        f"namespace: t\n{line}layout: {{block_bytes: 4KiB, groups: [{{block_size: 16}}]}}\n"
        "primary: {capacity: 1MiB}\ntiers: [{type: memory, capacity: 64MiB, job_timeout: 2s}]\n"
    )
    assert main(["lmcache", "check", spec(chain=str(chain), object_bytes=["2MiB"])]) == 0
    assert f"a lookup misses after {lookup}" in capsys.readouterr().out


def test_a_tier_larger_than_its_disk_is_refused_as_validate_refuses_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tier = {"type": "nvme", "path": str(tmp_path / "kv"), "capacity": "500TiB"}
    assert main(["lmcache", "check", spec(tiers=[tier])]) == 2
    assert "adapter_params.tiers[0].capacity: 500TiB is more than the filesystem" in (
        capsys.readouterr().err
    )


def test_round_trip_leaves_nothing_in_the_tiers_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """LMCache's check mode writes its 5 objects into a temporary directory made in
    the nvme tier's path (its disk), removed afterwards: the path is as it was."""
    lmcache()
    disk = tmp_path / "kv"
    disk.mkdir()
    (disk / "kept").write_text("a server's file")
    tier = {"type": "nvme", "path": str(disk), "capacity": "1GiB", "job_timeout": "2s"}
    assert main(["lmcache", "check", spec(tiers=[tier]), "--round-trip"]) == 0
    assert "Validation (content): 5/5" in capsys.readouterr().out
    assert [p.name for p in disk.iterdir()] == ["kept"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kv"]


def test_round_trip_deletes_its_objects_from_a_tier_without_files(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Redis (no files to put elsewhere): the objects are deleted before the
    adapter closes, so the server holds nothing afterwards."""
    lmcache()
    import redis

    tier = {"type": "redis", "url": redis_url, "job_timeout": "2s"}
    assert main(["lmcache", "check", spec(tiers=[tier]), "--round-trip"]) == 0
    assert "Validation (content): 5/5" in capsys.readouterr().out
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.dbsize() == 0
    finally:
        client.close()


def test_lmcache_check_prints_no_engine_import_noise(tmp_path: Path) -> None:
    """LMCache's coloured INFO line at import is not shown (its warnings would be)."""
    lmcache()
    env = {k: v for k, v in os.environ.items() if k != "LMCACHE_LOG_LEVEL"}
    tier = {"type": "memory", "capacity": "64MiB", "job_timeout": "2s"}
    done = subprocess.run(
        [sys.executable, "-m", "tierkv.cli", "lmcache", "check", spec(tiers=[tier])],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "LMCache parses it" in done.stdout
    assert "LMCache INFO" not in done.stdout + done.stderr and done.stderr == ""
