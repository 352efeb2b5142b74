"""Per-tenant quotas under SGLang's real storage classes: each call's tenant (what the
adapter reads from its `extra_info`: a `cache_salt` by its digest) reaches the tiers,
and the extra config's `tenants.quotas` hold each tenant to its share of a tier, here
an nvme tier in a temporary directory. Built as the other adapter tests build it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tierkv.contract.errors import ConfigError
from tierkv.contract.tenants import salt_tenant

KEEPER, FLOODER = "keeper-salt-8d0e", "flooder-salt-2f9b"


def info(salt: str) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    return HiCacheStorageExtraInfo(prefix_keys=None, extra_info={"cache_salt": salt})


def test_the_salted_tenant_keeps_its_share_while_another_floods(rig: Any) -> None:
    keeper, flooder = salt_tenant(KEEPER), salt_tenant(FLOODER)
    assert keeper is not None and flooder is not None
    pool = rig.pool(pages=16)  # 16 KiB pages, one block each (whole pages)
    quotas = {"nvme": {"tenants": {keeper: "50%"}}}
    backend = rig.backend(pool, [rig.nvme(capacity="320KiB")], tenants={"quotas": quotas})
    mine = rig.page_hashes(4, "keeper")
    rig.fill(pool, [0, 1, 2, 3], "keeper")
    assert backend.batch_set_v1(mine, pool.indices([0, 1, 2, 3]), info(KEEPER)) == [True] * 4
    for i in range(8):  # 64 one-off pages, more than the tier holds
        pages = list(range(8, 16))
        rig.fill(pool, pages, f"flood{i}")
        flood = rig.page_hashes(8, f"flood{i}")
        assert backend.batch_set_v1(flood, pool.indices(pages), info(FLOODER)) == [True] * 8

    (component,) = backend.kv.components
    (tier,) = component.chain.tiers
    assert tier.quotas is not None and tier.quotas.enforced
    capacity = tier.tier.room().capacity_blocks
    assert tier.quotas.book.held == {keeper: 4, flooder: capacity - 4}  # arrived by salt
    assert backend.batch_exists(mine, info(KEEPER)) == 4
    assert backend.batch_get_v1(mine, pool.indices([4, 5, 6, 7]), info(KEEPER)) == [True] * 4
    for src, dst in zip([0, 1, 2, 3], [4, 5, 6, 7]):
        assert pool.page_bytes(dst) == pool.page_bytes(src)
    assert backend.batch_exists(rig.page_hashes(8, "flood0"), info(FLOODER)) == 0


def test_a_capped_tenant_past_its_cap_is_declined(rig: Any) -> None:
    """Without `borrow`, a store larger than the tenant's whole cap has the rest
    declined for the tier: SGLang hears False for those pages, and the tier's health
    is untouched."""
    pool = rig.pool(pages=8)
    quotas = {"nvme": {"default": "32KiB", "borrow": False}}  # two pages
    backend = rig.backend(pool, [rig.nvme()], tenants={"quotas": quotas})
    hashes = rig.page_hashes(4, "capped")
    rig.fill(pool, [0, 1, 2, 3], "capped")
    answers = backend.batch_set_v1(hashes, pool.indices([0, 1, 2, 3]), info(FLOODER))
    assert answers == [True, True, False, False]
    (tier,) = backend.kv.components[0].chain.tiers
    assert tier.quotas is not None
    assert tier.quotas.book.declined == {salt_tenant(FLOODER): 2}
    assert tier.stats.errors == 0 and tier.serving == "read_write"


def geometry() -> Any:
    from tierkv.integrations.sglang.settings import PoolGeometry

    return PoolGeometry("m", "bfloat16", "page_first", 16, 4096, 2, is_mla=False)


def test_quota_mistakes_read_as_written(tmp_path: Path) -> None:
    from tierkv.integrations.sglang.settings import resolve

    tiers = [{"type": "memory", "capacity": "1MiB"}]
    extra: dict[str, Any] = {"interface_v1": 1, "tiers": tiers}
    cases = [
        (
            {"quotas": {"nvme": {}}},
            r"extra_config\.tenants\.quotas: 'nvme' names no tier of the "
            r"chain; use one of 'memory'$",
        ),
        (
            {"quotas": {"memory": {"tenants": {"a": "150%"}}}},
            r"extra_config\.tenants\.quotas\.memory\.tenants\.a: '150%'",
        ),
        (
            {"quotas": {"primary": {"default": "50%"}}},
            r"extra_config\.tenants\.quotas\.primary: not available under SGLang",
        ),
        ({"isolate": True}, r"extra_config\.tenants\.isolate: unknown field"),
    ]
    for tenants, message in cases:
        with pytest.raises(ConfigError, match=message):
            resolve({**extra, "tenants": tenants}, geometry())
    settings = resolve({**extra, "tenants": {"quotas": {"memory": {"default": "25%"}}}}, geometry())
    assert str(settings.quotas["memory"].default) == "25%"
    assert resolve(extra, geometry()).quotas == {}


def test_a_chain_file_brings_its_own_quotas(tmp_path: Path) -> None:
    from tierkv.integrations.sglang.settings import resolve

    chain = tmp_path / "chain.yaml"
    body = (
        "namespace: t\nlayout: {block_bytes: 4KiB, groups: [{block_size: 16}]}\n"
        "primary: {capacity: 64KiB}\ntiers: [{type: memory, capacity: 1MiB}]\n"
    )
    chain.write_text(body + "tenants: {quotas: {memory: {tenants: {acme: 50%}}}}\n")
    extra = {"interface_v1": 1, "chain": str(chain)}
    assert list(resolve(extra, geometry()).quotas["memory"].tenants) == ["acme"]
    with pytest.raises(ConfigError, match=r"extra_config\.tenants: only beside inline tiers"):
        resolve({**extra, "tenants": {"quotas": {}}}, geometry())
    chain.write_text(body + "tenants: {quotas: {primary: {default: 50%}}}\n")
    with pytest.raises(ConfigError, match=r"chain\.yaml: tenants\.quotas\.primary: not available"):
        resolve(extra, geometry())


def test_the_check_prints_each_tiers_quotas(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], rig: Any
) -> None:
    import json

    from tierkv.cli import main

    nvme = {"type": "nvme", "path": str(tmp_path / "kv"), "capacity": "1GiB"}
    quotas = {"nvme": {"tenants": {"acme": "50%"}, "default": "10%"}}
    extra = {
        "backend_name": "tierkv",
        "module_path": "tierkv.integrations.sglang",
        "class_name": "TierkvHiCacheStorage",
        "interface_v1": 1,
        "tiers": [nvme],
        "tenants": {"quotas": quotas},
    }
    assert main(["sglang", "check", json.dumps(extra), "--layers", "4"]) == 0
    assert "      quotas acme 50%, default 10%" in capsys.readouterr().out
    extra["tenants"] = {"quotas": {"nvme": {"tenants": {"acme": "150%"}}}}
    assert main(["sglang", "check", json.dumps(extra), "--layers", "4"]) == 2
    assert "extra_config.tenants.quotas.nvme.tenants.acme: '150%'" in capsys.readouterr().err
