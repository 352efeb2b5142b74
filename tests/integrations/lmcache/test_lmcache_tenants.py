"""Each LMCache `ObjectKey`'s `cache_salt` reaches the tiers as its tenant (a digest,
never the salt): a task whose keys carry several salts runs one part per tenant, and
the answers still land at their keys' places. LMCache's real classes, as the other
adapter tests build them."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tierkv.contract.tenants import salt_tenant

SIZE = 16 << 10
ALICE, BOB = "alice-secret-7a1f", "bob-secret-03c9"


def faulty_tier(adapter: Any) -> Any:
    (one,) = adapter._chains.all()
    return one.chain.tiers[0].tier


def test_each_salt_is_its_tenant_in_every_call(
    rig: Any, faulty_tier_type: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    l1 = rig.L1(1 << 20)
    adapter = rig.adapter([{"type": faulty_tier_type, "capacity": "1MiB"}], l1)
    drive = rig.Driver(adapter)
    keys = [rig.key(1, salt=ALICE), rig.key(2, salt=BOB), rig.key(3), rig.key(4, salt=ALICE)]
    seeds = ["a1", "b2", "n3", "a4"]
    assert drive.store(keys, [l1.obj(SIZE, s) for s in seeds]).is_successful()
    absent = rig.key(9, salt=BOB)
    assert drive.lookup([keys[0], absent, keys[2], keys[1]]) == [True, False, True, True]
    out = [l1.obj(SIZE) for _ in keys]
    assert drive.load(list(reversed(keys)), out) == [True] * 4
    assert [rig.content(o) for o in out] == [rig.pattern(s, SIZE) for s in reversed(seeds)]

    tier = faulty_tier(adapter)
    alice, bob = salt_tenant(ALICE), salt_tenant(BOB)
    for op in ("store", "lookup", "load"):
        assert {t for o, t in tier.tenants if o == op} == {alice, bob, None}, op
    stores = [keys for op, keys in tier.calls if op == "store"]
    assert sorted(len(k) for k in stores) == [1, 1, 2]  # one job per tenant
    assert not any(ALICE in r.getMessage() or BOB in r.getMessage() for r in caplog.records)


def test_one_salt_is_one_job(rig: Any, faulty_tier_type: str) -> None:
    """Keys of one salt: one store job, every call for that tenant."""
    l1 = rig.L1(1 << 20)
    adapter = rig.adapter([{"type": faulty_tier_type, "capacity": "1MiB"}], l1)
    drive = rig.Driver(adapter)
    keys = [rig.key(i, salt=ALICE) for i in range(3)]
    assert drive.store(keys, [l1.obj(SIZE, str(i)) for i in range(3)]).is_successful()
    assert drive.lookup(keys) == [True] * 3
    tier = faulty_tier(adapter)
    assert [k for op, k in tier.calls if op == "store"] == [tuple(keys_of(keys))]
    assert {t for _, t in tier.tenants} == {salt_tenant(ALICE)}


def keys_of(keys: list[Any]) -> list[bytes]:
    from tierkv.integrations.lmcache.keys import offload_key

    return [offload_key(k) for k in keys]
