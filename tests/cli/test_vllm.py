"""`tierkv vllm` (tierkv.cli.vllm) as a command: its subcommand is required and
`check` documents its options. Reading a real --kv-transfer-config with vLLM's parser is
tested in tests/integrations/test_vllm_check.py (where vLLM is installed)."""

from __future__ import annotations

import pytest

from tierkv.cli import main


def test_vllm_needs_a_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vllm"]) == 2
    assert "the following arguments are required: COMMAND" in capsys.readouterr().err


def test_vllm_check_help_lists_the_geometry(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["vllm", "check", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--model", "--tokens-per-block", "--row-bytes", "--tp"):
        assert option in out
