"""`tierkv lmcache check`: an `--l2-adapter` JSON read as LMCache and the adapter will,
offline; `--round-trip` runs LMCache's own adapter check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tierkv.cli import main

PLUGIN = {
    "type": "plugin",
    "module_path": "tierkv.integrations.lmcache",
    "class_name": "TierkvL2Adapter",
}


def spec(tmp_path: Path, **params: Any) -> str:
    tiers = [
        {"type": "nvme", "path": str(tmp_path / "kv"), "capacity": "1GiB", "job_timeout": "2s"}
    ]
    return json.dumps({**PLUGIN, "adapter_params": {"tiers": tiers, **params}})


def test_a_good_spec_opens_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], rig: Any
) -> None:
    assert main(["lmcache", "check", spec(tmp_path, object_bytes=["2MiB"])]) == 0
    out = capsys.readouterr().out
    assert "a store or load fails by 3s, a lookup misses after 1s" in out
    assert "nvme: nvme, job_timeout 2s, locks last at most 10s" in out
    assert "LMCache parses it and loads tierkv.integrations.lmcache.TierkvL2Adapter: yes" in out
    assert "warning" not in out
    assert not (tmp_path / "kv").exists()


def test_a_file_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str], rig: Any) -> None:
    path = tmp_path / "l2.json"
    path.write_text(spec(tmp_path))
    assert main(["lmcache", "check", f"@{path}", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["namespace"] == "lmcache" and report["lmcache_parsed"] is True
    assert any("object_bytes" in w for w in report["warnings"])


@pytest.mark.parametrize(
    ("mutate", "where"),
    [
        (lambda s: {**s, "class_name": "Other"}, "class_name"),
        (
            lambda s: {**s, "adapter_params": {"tiers": [{"type": "nvme", "capacity": "x"}]}},
            "adapter_params.tiers[0]",
        ),
        (
            lambda s: {**s, "adapter_params": {**s["adapter_params"], "tierz": 1}},
            "adapter_params.tierz",
        ),
        (
            lambda s: {**s, "adapter_params": {**s["adapter_params"], "chain": "/nope.yaml"}},
            "adapter_params",
        ),
    ],
)
def test_a_bad_spec_names_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mutate: Any, where: str
) -> None:
    bad = mutate(json.loads(spec(tmp_path)))
    assert main(["lmcache", "check", json.dumps(bad)]) == 2
    assert where in capsys.readouterr().err


def test_round_trip_runs_lmcache_own_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], rig: Any
) -> None:
    assert main(["lmcache", "check", spec(tmp_path), "--round-trip"]) == 0
    assert "Validation (content): 5/5" in capsys.readouterr().out
