"""`tierkv bench trace FILE --tenant-report T [--quotas FILE]` (tierkv.cli.trace): the
two-tenant report end to end, over a real nvme tier, and `--quotas` in every mode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierkv.cli import main
from tierkv.trace.conversations import ConversationSpec, generate, write_trace

MIX = ConversationSpec(
    sessions=8,
    turns=(2, 4),
    concurrent=4,
    first_tokens=(600, 2500),
    turn_tokens=(100, 600),
    output_tokens=(100, 300),
    flooder_rate=10.0,
    flooder_blocks=(2, 6),
)


@pytest.fixture
def mix(tmp_path: Path) -> Path:
    path = tmp_path / "mix.jsonl"
    write_trace(generate(MIX, seed=3), path)
    return path


def quotas(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "quotas.yaml"
    path.write_text(text)
    return path


def test_the_tenant_report_prints_the_share_alone_in_the_mix_and_the_ratio(
    mix: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tiers = tmp_path / "tiers"
    tiers.mkdir()
    args = ["bench", "trace", str(mix), "--tenant-report", "A", "--dir", str(tiers)]
    assert main([*args, "--primary", "10%", "--tier-capacity", "50%"]) == 0
    out = capsys.readouterr().out
    assert "tenant A:" in out and "quotas: none" in out and "mix/alone" in out
    assert main([*args, "--tier-capacity", "25%,50%", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tiers"] == ["nvme"] and report["block_bytes"] == 4096
    assert [(r["tier_capacity"], r["admission"]) for r in report["runs"]] == [
        ("25%", "all"),
        ("50%", "all"),
    ]
    for run in report["runs"]:
        assert run["mix"]["served_share"] < run["alone"]["served_share"]
    assert list(tiers.iterdir()) == []


def test_quotas_reach_the_report_and_the_other_modes(
    mix: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = quotas(tmp_path, "primary:\n  tenants:\n    A: 50%\n")
    common = ["bench", "trace", str(mix), "--quotas", str(path), "--tiers", "memory"]
    assert main([*common, "--tenant-report", "A", "--primary", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["quotas"] == {"primary": {"tenants": {"A": "50%"}}}
    plain = ["--admission", "all", "--tier-capacity", "25%", "--prefetch", "none", "--json"]
    assert main([*common, *plain]) == 0
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    assert set(run["tenants"]) == {"A", "B"}
    sweep = ["--capacity-sweep", "--primary", "8", "--tier-capacity", "25%", "--json"]
    assert main([*common, *sweep, "--admission", "all"]) == 0
    assert len(json.loads(capsys.readouterr().out)["cells"]) == 1


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- primary\n", "expected the tenants.quotas mapping, got a list"),
        ("", "expected the tenants.quotas mapping, got nothing"),
        ("quotas:\n  primary: {tenants: {A: 50%}}\n", "without a `tenants:` or `quotas:` key"),
        ("primary: {\n", "malformed YAML"),
        ("primary: {}\nprimary: {}\n", "primary"),  # a repeated key
        ("primary: {tenants: {A: lots}}\n", "tenants.quotas.primary.tenants.A"),
    ],
)
def test_a_bad_quotas_file_exits_2_with_the_reason(
    mix: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    path = quotas(tmp_path, text)
    args = ["bench", "trace", str(mix), "--tiers", "memory", "--quotas", str(path)]
    assert main([*args, "--tenant-report", "A"]) == 2
    err = capsys.readouterr().err
    assert message in err and str(path) in err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tenant-report", "C"], "no request of tenant 'C' (its tenants: A, B)"),
        (["--tenant-report", " "], "--tenant-report: name a tenant"),
        (["--tenant-report", "A", "--capacity-sweep"], "drop --capacity-sweep"),
        (["--tenant-report", "A", "--tier-capacity", "lots"], "'lots' is not a block count"),
        (["--tenant-report", "A", "--quotas", "nope.yaml"], "--quotas nope.yaml: No such file"),
    ],
)
def test_bad_tenant_report_options_exit_2_with_the_reason(
    mix: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert main(["bench", "trace", str(mix), "--tiers", "memory", *extra]) == 2
    assert message in capsys.readouterr().err
