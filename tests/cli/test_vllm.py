"""`tierkv vllm` (tierkv.cli.vllm) as a command: its subcommand is required,
`check` documents its options, reads `@FILE` and prints no engine import noise.
Reading a real --kv-transfer-config with vLLM's parser is tested in
tests/integrations/test_vllm_check.py (where vLLM is installed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tierkv.cli import main
from tierkv.contract.errors import ConfigError
from tierkv.testing import missing_server

TIER = {"type": "tierkv", "tier": {"type": "memory", "capacity": "64MiB"}}


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
    from tierkv.integrations.vllm.check import VLLM_TESTED

    pins = (Path(__file__).parents[2] / "requirements-vllm.txt").read_text()
    assert f"vllm=={VLLM_TESTED}\n" in pins


def test_vllm_check_reads_at_file_as_the_other_checks_do(tmp_path: Path) -> None:
    """`@FILE`, as `tierkv sglang check` and `tierkv lmcache check` take it (and a
    plain path)."""
    from tierkv.integrations.vllm.check import read_config_text

    path = tmp_path / "kv.json"
    path.write_text('{"kv_connector": "OffloadingConnector"}')
    assert read_config_text(f"@{path}") == read_config_text(str(path)) == path.read_text()
    with pytest.raises(ConfigError, match="neither a JSON object nor a file"):
        read_config_text(f"@{tmp_path}/missing.json")


def test_vllm_check_prints_no_engine_import_noise(tmp_path: Path) -> None:
    """vLLM's `Failed to import from vllm._C` (its compiled ops, which an offline
    check never runs) is not shown; the check reads `@FILE`."""
    try:
        import vllm.config  # noqa: F401
    except Exception as exc:
        missing_server("vllm (bash scripts/setup-vllm.sh)", exc)
    path = tmp_path / "kv.json"
    extra = {"spec_name": "TieringOffloadingSpec", "secondary_tiers": [TIER]}
    path.write_text(json.dumps(
        {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
         "kv_connector_extra_config": extra}
    ))  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "tierkv.cli", "vllm", "check", f"@{path}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "secondary_tiers[0]: tierkv memory (memory)" in done.stdout
    assert "vllm._C" not in done.stderr and done.stderr == ""
