"""`tierkv vllm check`: a --kv-transfer-config read with vLLM's own parser and
factories and tierkv's resolver, offline; exit 2 with the path of the first problem."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tierkv.cli import main

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def transfer_config(*tiers: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec",
            "secondary_tiers": list(tiers),
            **extra,
        },
    }


NVME = {"type": "tierkv", "tier": {"type": "nvme", "path": "/mnt/nvme/kv", "capacity": "500GiB"}}


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["vllm", "check", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_good_config_prints_the_chain_with_medium_size_and_namespace(
    vllm: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    config = transfer_config(NVME, {"type": "tierkv", "tier": {"type": "memory"}, "medium": "CPU"})
    code, out, _ = run(capsys, json.dumps(config), "--model", "org/m", "--tp", "2")
    assert code == 0
    assert "secondary_tiers[0]: tierkv nvme (nvme), STORAGE/LOCAL, capacity 500GiB" in out
    assert "secondary_tiers[1]: tierkv memory (memory), CPU/LOCAL" in out
    assert "namespace vllm:org/m:bfloat16:16t:tp2pp1:" in out


def test_the_namespace_is_the_one_a_vllm_engine_of_that_geometry_gets(
    vllm: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same facts through vLLM's real spec (the test harness's engine) and through
    the check give one namespace: what the check prints is what the server will use."""
    from tests.integrations.conftest import ROW

    engine = vllm.engine([vllm.entry({"type": "memory"})], model="tiny-model", dtype="float16")
    code, out, _ = run(
        capsys,
        json.dumps(transfer_config({"type": "tierkv", "tier": {"type": "memory"}})),
        "--model=tiny-model",
        "--dtype=float16",
        f"--row-bytes={ROW}",
        "--json",
    )
    assert code == 0
    [tier] = json.loads(out)["tiers"]
    assert tier["tierkv"]["namespace"] == engine.tiers[0].namespace


def test_a_file_holding_the_config_is_read_and_human_numbers_expand(
    vllm: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "transfer.json"
    text = json.dumps(transfer_config(NVME, cpu_bytes_to_use=1))
    path.write_text(text.replace('"cpu_bytes_to_use": 1', '"cpu_bytes_to_use": 8G'))
    code, out, _ = run(capsys, str(path), "--json")
    assert code == 0
    assert json.loads(out)["cpu_bytes_to_use"] == 8 << 30


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ('{"kv_connector": "OffloadingConnector", ', "--kv-transfer-config: not JSON"),
        (
            transfer_config(
                {"type": "tierkv", "tier": {"type": "nvme", "path": "/x", "capacity": "12 parsecs"}}
            ),
            "secondary_tiers[0].tier.capacity: '12 parsecs' is not a size",
        ),
        (
            transfer_config(NVME, {"type": "tierkv", "tier": {"type": "floppy"}}),
            "kv_connector_extra_config.secondary_tiers[1].tier.type: unknown tier type 'floppy'",
        ),
        (transfer_config({"type": "nosuch"}), "secondary_tiers[0].type: Unknown secondary tier"),
        (
            {**transfer_config(), "kv_connector_extra_config": {"spec_name": "CPUOffloadingSpec"}},
            "spec_name: CPUOffloadingSpec takes no secondary tiers",
        ),
        ({**transfer_config(), "kv_connector": "LMCacheConnectorV1"}, "kv_connector: 'LMCache"),
        ({**transfer_config(), "kv_role": "kv_bot"}, "kv_role: Input should be"),
        (transfer_config({**NVME, "drain_timeout": "soon"}), "secondary_tiers[0].drain_timeout"),
        ("/no/such/file.json", "is neither a JSON object nor a file"),
    ],
)
def test_a_bad_config_exits_2_with_the_path_of_the_problem(
    vllm: Any, capsys: pytest.CaptureFixture[str], config: Any, message: str
) -> None:
    text = config if isinstance(config, str) else json.dumps(config)
    code, out, err = run(capsys, text)
    assert code == 2
    assert message in err
    assert out == ""


def test_the_command_line_entry_point(vllm: Any) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tierkv.cli", "vllm", "check", json.dumps(transfer_config(NVME))],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "--kv-transfer-config: ok (OffloadingConnector, TieringOffloadingSpec" in done.stdout


def test_groups_of_a_hybrid_model_are_checked_as_vllm_states_them(
    vllm: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--groups full,window:4,state`: the check resolves the entries against three KV
    groups, as the adapter will under such a model; the namespace differs from the
    one-group model's (different windows never share blocks)."""
    config = json.dumps(transfer_config(NVME))
    code, full_out, _ = run(capsys, config, "--model", "org/m")
    assert code == 0
    code, hybrid_out, _ = run(capsys, config, "--model", "org/m", "--groups", "full,window:4,state")
    assert code == 0
    assert "KV groups full,window:4,window:1" in hybrid_out
    namespace = [line for line in full_out.splitlines() if "namespace" in line]
    hybrid_namespace = [line for line in hybrid_out.splitlines() if "namespace" in line]
    assert namespace and hybrid_namespace and namespace != hybrid_namespace


def test_a_group_the_adapter_cannot_serve_exits_2_naming_it(
    vllm: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, json.dumps(transfer_config(NVME)), "--groups", "full,window:0")
    assert code == 2 and out == ""
    assert "secondary_tiers[0]" in err and "sliding_window_size_in_chunks=0" in err


@pytest.mark.parametrize("groups", ["full,sliding", "window", "window:x", "state:2", ""])
def test_a_bad_groups_list_is_refused_with_the_accepted_forms(
    capsys: pytest.CaptureFixture[str], groups: str
) -> None:
    code, out, err = run(capsys, "{}", "--groups", groups)
    assert code == 2 and out == ""
    assert "full, window:N (N chunks) or state" in err
