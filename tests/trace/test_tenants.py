"""Tenants in a replay: each request's tenant reaches the cache (tierkv.trace.replay,
tierkv.trace.server), and the two-tenant report (tierkv.trace.tenants) over a real
nvme tier."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tierkv.config import parse_config
from tierkv.trace.conversations import ConversationSpec, generate, write_trace
from tierkv.trace.costmodel import CostModel
from tierkv.trace.format import TraceError, TraceRequest, read_trace, request_keys
from tierkv.trace.replay import ReplayOptions, ReplayReport, chain_config, replay
from tierkv.trace.server import ServerOptions, replay_queued
from tierkv.trace.tenants import TenantReportOptions, run_tenant_report, tenant_lines

pytestmark = pytest.mark.anyio

BLOCK = 4096
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
"""A two-tenant trace small enough for a few seconds of nvme: about 25 requests of
A's conversations and ten times as many one-off prompts of B's."""


@pytest.fixture
def mix(tmp_path: Path) -> Path:
    path = tmp_path / "mix.jsonl"
    write_trace(generate(MIX, seed=3), path)
    return path


def keyed(path: Path) -> list[tuple[TraceRequest, list[bytes]]]:
    return [(r, request_keys(r)) for r in read_trace(path)]


def options(**kw: object) -> ReplayOptions:
    base: dict[str, object] = {
        "block_bytes": BLOCK,
        "primary_blocks": 8,
        "tiers": ("memory",),
        "tier_blocks": 64,
    }
    return ReplayOptions(**{**base, **kw})  # type: ignore[arg-type]


def asked_by_tenant(trace: list[tuple[TraceRequest, list[bytes]]]) -> Counter[str]:
    asked: Counter[str] = Counter()
    for r, keys in trace:
        asked[r.tenant or "default"] += len(keys)
    return asked


async def test_every_lookup_load_and_store_carries_the_requests_tenant(mix: Path) -> None:
    trace = keyed(mix)
    report = await replay(trace, options())
    tenants = report.tenants
    requests = Counter(r.tenant for r, _ in trace)
    assert set(tenants) == {"A", "B"}  # nothing counted for the default tenant
    for name, row in tenants.items():
        assert row["lookups"] == requests[name]
        assert row["hits"] + row["misses"] == asked_by_tenant(trace)[name]
        assert row["stored_blocks"] > 0  # the stores carried the tenant too
    assert tenants["B"]["hits"] == 0  # one-off prompts: B never hits
    assert tenants["A"]["hits"] > 0 and tenants["A"]["loaded_blocks"] == tenants["A"]["hits"]
    assert sum(row["hits"] for row in tenants.values()) == report.blocks_served
    assert report.as_dict()["tenants"] == tenants


async def test_the_queued_replay_carries_the_tenant_too(mix: Path) -> None:
    trace = keyed(mix)[:80]
    model = CostModel(bandwidth={"cpu": 25e9, "memory": 3e9})
    report = await replay_queued(trace, options(), ServerOptions(arrival_scale=0.2), model)
    requests = Counter(r.tenant for r, _ in trace)
    assert {name: row["lookups"] for name, row in report.tenants.items()} == requests
    assert report.prefetches > 0


def test_quotas_go_into_the_chains_tenants_config(tmp_path: Path) -> None:
    quotas = {"primary": {"tenants": {"A": "50%"}}}
    config = chain_config(options(quotas=quotas), tmp_path)
    assert config["tenants"]["quotas"] == quotas
    parsed = parse_config(config)
    assert parsed.tenants.quotas["primary"].tenants["A"].share == 0.5
    assert "quotas" not in chain_config(options(), tmp_path)["tenants"]


async def test_the_report_replays_the_tenant_alone_then_the_mix_through_nvme(
    mix: Path, tmp_path: Path
) -> None:
    tier_dir = tmp_path / "tiers"
    tier_dir.mkdir()
    trace = read_trace(mix)
    said: list[str] = []
    o = TenantReportOptions(
        mix, "A", block_bytes=BLOCK, primary="10%", capacities=("50%",), directory=tier_dir
    )
    report = await run_tenant_report(o, said.append)
    a = [r for r in trace if r.tenant == "A"]
    distinct = len({k for r in a for k in request_keys(r)})
    assert report["tenants"] == dict(Counter(r.tenant for r in trace))
    assert report["tenant_distinct_blocks"] == distinct and report["quotas"] is None
    (run,) = report["runs"]
    assert run["tier_blocks"] == distinct // 2 and run["primary_blocks"] == -(-distinct // 10)
    alone, mixed = run["alone"], run["mix"]
    assert alone["requests"] == len(a) and mixed["requests"] == len(trace)
    assert set(alone["tenants"]) == {"A"} and set(mixed["tenants"]) == {"A", "B"}
    asked = sum(len(r.hash_ids) for r in a)
    for share in (alone, mixed):
        assert share["looked_up"] == asked
        assert share["served_share"] == share["hits"] / asked
        assert share["hits"] == share["tenants"]["A"]["hits"] and share["failed_loads"] == 0
    assert 0 < alone["served_share"] <= report["tenant_infinite_cache_hit_rate"]
    assert mixed["served_share"] < alone["served_share"]  # the flood costs A hits
    assert run["mix_vs_alone"] == pytest.approx(mixed["served_share"] / alone["served_share"])
    assert list(tier_dir.iterdir()) == []  # each chain's nvme files are gone
    assert any("alone" in s for s in said) and any("whole trace" in s for s in said)
    lines = tenant_lines(report)
    assert "tenant A:" in lines[0] and "quotas: none" in lines[1]
    assert any(f"{run['mix_vs_alone']:.2f}" in line for line in lines)


async def test_the_report_passes_the_quotas_to_both_chains(
    mix: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tierkv.trace.tenants as module

    seen: list[object] = []

    async def recording(trace: Any, options: ReplayOptions) -> ReplayReport:
        seen.append(options.quotas)
        return await replay(trace, options)

    monkeypatch.setattr(module, "replay", recording)
    quotas = {"primary": {"tenants": {"A": "50%"}}}
    o = TenantReportOptions(
        mix, "A", block_bytes=BLOCK, primary="8", tiers=("memory",), quotas=quotas
    )
    report = await run_tenant_report(o)
    assert seen == [quotas, quotas] and report["quotas"] == quotas
    assert '"A": "50%"' in tenant_lines(report)[1]


async def test_a_tenant_the_trace_lacks_is_an_error_naming_its_tenants(mix: Path) -> None:
    with pytest.raises(TraceError, match=r"no request of tenant 'C' \(its tenants: A, B\)"):
        await run_tenant_report(TenantReportOptions(mix, "C", tiers=("memory",)))


async def test_requests_without_a_tenant_are_the_default_tenants(tmp_path: Path) -> None:
    path = tmp_path / "plain.jsonl"
    write_trace(generate(ConversationSpec(sessions=4, turns=(2, 3), concurrent=2)), path)
    o = TenantReportOptions(path, "default", block_bytes=BLOCK, tiers=("memory",))
    (run,) = (await run_tenant_report(o))["runs"]
    assert run["alone"]["hits"] == run["mix"]["hits"] > 0  # the mix is the tenant alone
    assert run["mix_vs_alone"] == 1.0
