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
