"""`tierkv sglang` (tierkv.cli.sglang) as a command: its subcommand is required and
`check` documents its options. Checking a real extra config is tested in
tests/integrations/sglang/test_sglang_check.py (where SGLang is installed); the check
itself needs no SGLang, as the last test shows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierkv.cli import main


def test_sglang_needs_a_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sglang"]) == 2
    assert "the following arguments are required: COMMAND" in capsys.readouterr().err


def test_sglang_check_help_lists_the_geometry(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sglang", "check", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--model", "--page-size", "--layers", "--kv-heads", "--layout", "--mla"):
        assert option in out


def test_sglang_check_reads_a_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = {
        "backend_name": "tierkv",
        "module_path": "tierkv.integrations.sglang",
        "class_name": "TierkvHiCacheStorage",
        "interface_v1": 1,
        "tiers": [{"type": "memory", "capacity": "64MiB"}],
    }
    assert main(["sglang", "check", json.dumps(config)]) == 0
    assert "tiers (gets try them in order" in capsys.readouterr().out


BACKEND = {
    "backend_name": "tierkv",
    "module_path": "tierkv.integrations.sglang",
    "class_name": "TierkvHiCacheStorage",
    "interface_v1": 1,
}


def test_sglang_check_applies_validates_machine_checks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A disk tier larger than the filesystem under its path is refused, as `tierkv
    validate` refuses it on the same machine, at the path written in the extra config
    (issue 53)."""
    tier = {"type": "nvme", "path": str(tmp_path / "kv"), "capacity": "500TiB"}
    assert main(["sglang", "check", json.dumps({**BACKEND, "tiers": [tier]})]) == 2
    err = capsys.readouterr().err
    assert "extra_config.tiers[0].capacity: 500TiB is more than the filesystem under " in err
    chain = tmp_path / "chain.yaml"
    chain.write_text(
        "namespace: t\nlayout: {block_bytes: 4KiB, groups: [{block_size: 16}]}\n"
        f"primary: {{capacity: 1MiB}}\ntiers: [{json.dumps(tier)}]\n"
    )
    assert main(["validate", str(chain)]) == 2
    assert "tiers[0].capacity: 500TiB is more than the filesystem" in capsys.readouterr().err
    assert main(["sglang", "check", json.dumps({**BACKEND, "chain": str(chain)})]) == 2
    assert f"{chain}: tiers[0].capacity: 500TiB" in capsys.readouterr().err


@pytest.mark.parametrize(("line", "exists"), [("", "0.5s"), ("lookup_timeout: 2s\n", "2s")])
def test_a_chain_file_keeps_the_backends_exists_deadline(
    line: str, exists: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`"chain"` in place of `"tiers"`: `batch_exists` waits 0.5 s as with inline tiers
    (not the embedded cache's 50 ms default of a chain file), unless the file sets its
    own lookup_timeout."""
    chain = tmp_path / "chain.yaml"
    chain.write_text(
        f"namespace: t\n{line}layout: {{block_bytes: 4KiB, groups: [{{block_size: 16}}]}}\n"
        "primary: {capacity: 1MiB}\ntiers: [{type: memory, capacity: 64MiB}]\n"
    )
    assert main(["sglang", "check", json.dumps({**BACKEND, "chain": str(chain)}), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["lookup_timeout_s"] == float(exists.rstrip("s"))
