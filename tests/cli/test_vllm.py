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


def test_vllm_check_without_vllm_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not "invalid tierkv config": the config is fine, vLLM is missing."""
    import sys

    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")] + ["vllm"]:
        monkeypatch.setitem(sys.modules, name, None)
    config = '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}'
    assert main(["vllm", "check", config]) == 1
    err = capsys.readouterr().err
    assert "invalid tierkv config" not in err
    assert "vLLM is not installed here" in err and "bash scripts/setup-vllm.sh" in err


def test_the_install_hint_names_the_pinned_vllm() -> None:
    from pathlib import Path

    from tierkv.integrations.vllm.check import VLLM_TESTED

    pins = (Path(__file__).parents[2] / "requirements-vllm.txt").read_text()
    assert f"vllm=={VLLM_TESTED}\n" in pins
