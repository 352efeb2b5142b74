"""Per-tenant quotas under vLLM's REAL tiering manager: requests carrying vLLM's
`cache_salt` reach the tierkv tier as their tenants (`salt_tenant(salt)`), and the
entry's `quotas` hold each tenant to its share of the tier, whoever's blocks vLLM
cascades. vLLM's `Request`s and its connector's `_create_req_context`, as
`test_vllm_tenants.py` builds them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tierkv.contract.errors import ConfigError
from tierkv.contract.jobs import ReqContext
from tierkv.contract.tenants import salt_tenant

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

KEEPER, FLOODER = "keeper-salt-5b1e", "flooder-salt-c07a"
MEMORY = {"type": "memory", "capacity": "96KiB"}  # a score of 4 KiB rows, framed


def new_request(engine: Any, req_id: str, salt: str) -> Any:
    """A vLLM `Request` with `cache_salt`, its context built by vLLM's connector."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    request = Request(req_id, list(range(32)), SamplingParams(max_tokens=1), None, cache_salt=salt)
    ctx = scheduler._create_req_context(request)
    with engine.manager.lock:
        engine.manager.on_new_request(ctx)
    return ctx


def held(adapter: Any, keys: list[bytes]) -> list[bool]:
    """Which keys the tierkv tier itself holds (asked on its loop)."""
    tier = adapter.tierkv_tier
    return list(adapter.loop.run(tier.lookup(keys, ReqContext(request_id="check")), 30))


def store_as(engine: Any, salt: str, name: str, keys: list[bytes]) -> None:
    ctx = new_request(engine, name, salt)
    engine.store(ctx, keys)
    engine.finish(ctx)
    engine.settle()


def test_the_salted_tenant_keeps_its_share_while_another_floods(vllm: Any) -> None:
    keeper, flooder = salt_tenant(KEEPER), salt_tenant(FLOODER)
    assert keeper is not None and flooder is not None
    entry = vllm.entry(MEMORY, quotas={"tenants": {keeper: "50%"}})
    engine = vllm.engine([entry], chunks=16)
    (adapter,) = engine.tiers
    mine = vllm.keys(6, "keeper")
    store_as(engine, KEEPER, "keeper", mine)
    for i in range(8):  # 64 one-off rows, more than the tier holds
        store_as(engine, FLOODER, f"flood{i}", vllm.keys(8, f"flood{i}"))

    gate = adapter.driver.quotas
    assert gate is not None and gate.enforced
    book = gate.book
    capacity = adapter.tierkv_tier.room().capacity_blocks
    assert book.held == {keeper: 6, flooder: capacity - 6}  # the tenants arrived by salt
    assert held(adapter, mine) == [True] * 6
    # the primary (16 rows) lost the keeper's rows long ago: vLLM promotes them back
    again = new_request(engine, "keeper-again", KEEPER)
    assert engine.promote(again, mine) == 6
    assert engine.read(again, mine) == [vllm.payload(k) for k in mine]
    engine.finish(again)
    engine.settle()


def test_a_capped_tenant_is_declined_past_its_cap_and_cycles_its_own(vllm: Any) -> None:
    """`default` caps every tenant not named; without `borrow` a tenant at its cap
    evicts its own oldest blocks, and a job larger than its whole cap has the rest
    declined (reported to vLLM as failed keys, reason `quota`, not a tier fault)."""
    from tierkv.integrations.vllm import metrics

    flooder = salt_tenant(FLOODER)
    entry = vllm.entry(MEMORY, quotas={"default": "12KiB", "borrow": False})
    engine = vllm.engine([entry], chunks=16)
    (adapter,) = engine.tiers
    store_as(engine, FLOODER, "big", vllm.keys(6, "big"))  # 6 rows, the cap holds 3
    book = adapter.driver.quotas.book
    assert book.cap(flooder) == 3
    assert book.held == {flooder: 3} and book.declined == {flooder: 3}
    assert held(adapter, vllm.keys(6, "big")) == [True] * 3 + [False] * 3
    assert adapter.driver.stats.errors == 0 and adapter.driver.serving == "read_write"
    _types, values = engine.manager.get_stats().metric_sections()
    jobs = dict(values[metrics.FAILED_JOBS])
    assert jobs == {("1:tierkv", "store", "quota"): 1}  # not a fault of the tier

    store_as(engine, FLOODER, "next", vllm.keys(3, "next"))  # its own blocks give way
    assert book.held == {flooder: 3}
    assert held(adapter, vllm.keys(3, "next")) == [True] * 3


def test_quotas_are_checked_at_the_entrys_path() -> None:
    from tierkv.integrations.vllm.settings import VllmGeometry, resolve_entry

    geometry = VllmGeometry("m", "float16", (16,), 1, 16, 4096, {}, {})
    entry: dict[str, Any] = {"tier": MEMORY, "quotas": {"tenants": {"a": "12 parsecs"}}}
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.quotas\.tenants\.a: '12 pars"):
        resolve_entry(entry, geometry, where="secondary_tiers[0]")
    entry["quotas"] = {"tenants": {"a": "70%", "b": "40%"}}
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.quotas\.tenants: the named"):
        resolve_entry(entry, geometry, where="secondary_tiers[0]")
    entry["quotas"] = {"tenant": {"a": "10%"}}
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.quotas\.tenant: unknown field"):
        resolve_entry(entry, geometry, where="secondary_tiers[0]")
    entry["quotas"] = {"tenants": {"a": "25%"}, "default": "8KiB"}
    quotas = resolve_entry(entry, geometry, where="secondary_tiers[0]").quotas
    assert quotas is not None and str(quotas.tenants["a"]) == "25%"
    del entry["quotas"]
    assert resolve_entry(entry, geometry).quotas is None


def test_a_chain_entry_takes_the_files_quotas(tmp_path: Path) -> None:
    from tierkv.integrations.vllm.settings import VllmGeometry, resolve_entry

    geometry = VllmGeometry("m", "float16", (16,), 1, 16, 4096, {}, {})
    chain = tmp_path / "chain.yaml"
    body = (
        "namespace: t\nlayout: {block_bytes: 4KiB, groups: [{block_size: 16}]}\n"
        "primary: {capacity: 64KiB}\n"
        "tiers: [{type: memory, capacity: 1MiB}, {type: nvme, path: /tmp/x, capacity: 1GiB}]\n"
    )
    chain.write_text(body + "tenants: {quotas: {nvme: {tenants: {acme: 50%}}}}\n")
    entry: dict[str, Any] = {"chain": str(chain), "chain_tier": "nvme"}
    quotas = resolve_entry(entry, geometry).quotas
    assert quotas is not None and list(quotas.tenants) == ["acme"]
    assert resolve_entry({**entry, "chain_tier": "memory"}, geometry).quotas is None
    with pytest.raises(ConfigError, match=r"secondary_tiers\[\?\]\.quotas: only with `tier`"):
        resolve_entry({**entry, "quotas": {"default": "10%"}}, geometry)
    chain.write_text(body + "tenants: {quotas: {primary: {default: 50%}}}\n")
    with pytest.raises(ConfigError, match=r"tenants\.quotas\.primary: not available under vLLM"):
        resolve_entry(entry, geometry)


def test_the_manual_quota_entry_validates() -> None:
    """docs/vllm.md's tenant-quota entry is one `secondary_tiers` entry that resolves."""
    import json
    import re

    from tierkv.integrations.vllm.settings import VllmGeometry, resolve_entry

    page = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"
    section = page.read_text().split("**Tenant quotas.**", 1)[1]
    match = re.search(r"```json\n(.*?)```", section, re.S)
    assert match, "no JSON entry under 'Tenant quotas'"
    entry = json.loads(match.group(1))
    assert entry.pop("type") == "tierkv"
    geometry = VllmGeometry("m", "bfloat16", (16,), 1, 16, 1 << 20, {"tp_size": 1}, {})
    quotas = resolve_entry(entry, geometry, where="secondary_tiers[0]").quotas
    assert quotas is not None and str(quotas.tenants["salt-0bc5fe16"]) == "50%"


def test_the_check_prints_an_entrys_quotas_and_refuses_a_bad_one(
    vllm: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from tierkv.cli import main

    def config(quotas: Any) -> str:
        entry = {**vllm.entry({"type": "memory", "capacity": "1GiB"}), "quotas": quotas}
        extra = {"spec_name": "TieringOffloadingSpec", "secondary_tiers": [entry]}
        return json.dumps(
            {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": extra,
            }
        )

    good = {"tenants": {"acme": "50%"}, "default": "10%", "borrow": False}
    assert main(["vllm", "check", config(good)]) == 0
    out = capsys.readouterr().out
    assert "    quotas acme 50%, default 10%, no borrowing" in out
    assert main(["vllm", "check", config({"tenants": {"acme": "150%"}})]) == 2
    err = capsys.readouterr().err
    assert "secondary_tiers[0].quotas.tenants.acme: '150%'" in err
