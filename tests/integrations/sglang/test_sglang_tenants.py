"""The tenant of an SGLang call reaches the tiers: stock SGLang's
`HiCacheStorageExtraInfo` carries none (the default tenant); one whose `extra_info`
names a `tenant` or a `cache_salt` is read, the salt only as its digest. SGLang's real
storage classes, as the other adapter tests build them."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from tierkv.contract.errors import ConfigError
from tierkv.contract.tenants import salt_tenant

SALT = "sglang-secret-salt-41c0"


def info(**extra: Any) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    return HiCacheStorageExtraInfo(prefix_keys=None, extra_info=extra or None)


def tenants_seen(backend: Any) -> set[str | None]:
    assert backend.kv is not None
    return {t for c in backend.kv.components for _, t in c.chain.tiers[0].tier.tenants}


def roundtrip(rig: Any, backend: Any, pool: Any, extra_info: Any, salt: str) -> None:
    hashes = rig.page_hashes(2, salt)
    rig.fill(pool, [0, 1], salt)
    assert backend.batch_set_v1(hashes, pool.indices([0, 1]), extra_info) == [True, True]
    assert backend.batch_exists(hashes, extra_info) == 2
    assert backend.batch_get_v1(hashes, pool.indices([2, 3]), extra_info) == [True, True]


def test_stock_sglang_passes_no_tenant(rig: Any, faulty_tier_type: str) -> None:
    """SGLang 0.5.23's cache controller builds `HiCacheStorageExtraInfo(prefix_keys=...)`
    and nothing else: every call is the default tenant."""
    pool = rig.pool(pages=8)
    backend = rig.backend(pool, [{"type": faulty_tier_type, "capacity": "1MiB"}])
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    stock = HiCacheStorageExtraInfo(prefix_keys=rig.page_hashes(1, "before"))
    roundtrip(rig, backend, pool, stock, "stock")
    roundtrip(rig, backend, pool, None, "none")
    assert tenants_seen(backend) == {None}


def test_a_tenant_or_salt_in_extra_info_reaches_every_call(
    rig: Any, faulty_tier_type: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    pool = rig.pool(pages=8)
    backend = rig.backend(pool, [{"type": faulty_tier_type, "capacity": "1MiB"}])
    roundtrip(rig, backend, pool, info(cache_salt=SALT), "salted")
    tier = backend.kv.components[0].chain.tiers[0].tier
    ops = {op for op, t in tier.tenants if t == salt_tenant(SALT)}
    assert ops == {"store", "lookup", "load"}
    tier.tenants.clear()
    roundtrip(rig, backend, pool, info(tenant="acme", cache_salt=SALT), "named")
    assert tenants_seen(backend) == {"acme"}  # a name given wins over the salt
    assert not any(SALT in r.getMessage() for r in caplog.records)


def test_a_chain_that_isolates_tenants_is_refused(tmp_path: Path) -> None:
    """`tenants.isolate` is `TieredCache`'s: SGLang's tiers get SGLang's page hashes as
    they come, which know nothing of a tenant `extra_info` names."""
    from tierkv.integrations.sglang.settings import PoolGeometry, resolve

    geometry = PoolGeometry("m", "bfloat16", "page_first", 16, 4096, 2, is_mla=False)
    chain = tmp_path / "chain.yaml"
    body = (
        "namespace: t\nlayout: {block_bytes: 4KiB, groups: [{block_size: 16}]}\n"
        "primary: {capacity: 64KiB}\ntiers: [{type: memory, capacity: 1MiB}]\n"
    )
    chain.write_text(body + "tenants: {isolate: true}\n")
    with pytest.raises(ConfigError, match=r"tenants\.isolate: true is not available under SGLang"):
        resolve({"interface_v1": 1, "chain": str(chain)}, geometry)
    chain.write_text(body + "tenants: {isolate: false}\n")
    assert resolve({"interface_v1": 1, "chain": str(chain)}, geometry).names == ("memory",)
