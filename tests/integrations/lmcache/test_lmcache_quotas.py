"""Per-tenant quotas under LMCache's real classes: each `ObjectKey`'s `cache_salt`
reaches the tiers as its tenant (`salt_tenant(salt)`), and `adapter_params.tenants.
quotas` hold each tenant to its share of a tier (here an nvme tier in a temporary
directory), inside the shared capacity every object size's instance answers to.
Built by LMCache's plugin loader from the JSON, as the other adapter tests build it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tierkv.contract.errors import ConfigError
from tierkv.contract.tenants import salt_tenant

SIZE = 16 << 10
KEEPER, FLOODER = "keeper-salt-61aa", "flooder-salt-9e04"


def the_tier(adapter: Any) -> Any:
    (one,) = adapter._chains.all()
    (tier,) = one.chain.tiers
    return tier


def test_the_salted_tenant_keeps_its_share_while_another_floods(rig: Any) -> None:
    keeper, flooder = salt_tenant(KEEPER), salt_tenant(FLOODER)
    assert keeper is not None and flooder is not None
    l1 = rig.L1(4 << 20)
    quotas = {"nvme": {"tenants": {keeper: "50%"}}}
    adapter = rig.adapter(
        [rig.nvme(capacity="320KiB")], l1, object_bytes=[SIZE], tenants={"quotas": quotas}
    )
    drive = rig.Driver(adapter)
    mine = [rig.key(i, salt=KEEPER) for i in range(4)]
    seeds = [f"keeper{i}" for i in range(4)]
    assert drive.store(mine, [l1.obj(SIZE, s) for s in seeds]).is_successful()
    for r in range(8):  # 64 one-off objects, more than the tier holds
        flood = [rig.key(100 + 8 * r + i, salt=FLOODER) for i in range(8)]
        assert drive.store(flood, [l1.obj(SIZE, f"f{r}{i}") for i in range(8)]).is_successful()

    tier = the_tier(adapter)
    assert tier.quotas is not None and tier.quotas.enforced
    capacity = tier.tier.room().capacity_blocks
    assert tier.quotas.book.held == {keeper: 4, flooder: capacity - 4}  # arrived by salt
    assert drive.lookup(mine) == [True] * 4
    out = [l1.obj(SIZE) for _ in mine]
    assert drive.load(mine, out) == [True] * 4
    assert [rig.content(o) for o in out] == [rig.pattern(s, SIZE) for s in seeds]
    assert drive.lookup([rig.key(100, salt=FLOODER)]) == [False]  # its oldest gave way


def test_a_capped_tenant_past_its_cap_is_declined(rig: Any) -> None:
    """Without `borrow`, a store task larger than the tenant's whole cap has the rest
    declined for the tier (failed in the task's result); the tier's health is
    untouched."""
    l1 = rig.L1(1 << 20)
    quotas = {"nvme": {"default": "32KiB", "borrow": False}}  # two objects
    adapter = rig.adapter([rig.nvme()], l1, object_bytes=[SIZE], tenants={"quotas": quotas})
    drive = rig.Driver(adapter)
    keys = [rig.key(i, salt=FLOODER) for i in range(4)]
    result = drive.store(keys, [l1.obj(SIZE, str(i)) for i in range(4)])
    assert not result.is_successful()
    assert drive.lookup(keys) == [True, True, False, False]
    tier = the_tier(adapter)
    assert tier.quotas is not None
    assert tier.quotas.book.declined == {salt_tenant(FLOODER): 2}
    assert tier.stats.errors == 0 and tier.serving == "read_write"


def test_quota_mistakes_read_as_written(tmp_path: Path) -> None:
    from tierkv.integrations.lmcache.settings import resolve

    params: dict[str, Any] = {"tiers": [{"type": "memory", "capacity": "1MiB"}]}
    cases = [
        (
            {"quotas": {"memory": {"borrow": "maybe"}}},
            r"adapter_params\.tenants\.quotas\.memory\.borrow: 'maybe'",
        ),
        (
            {"quotas": {"primary": {"default": "50%"}}},
            r"adapter_params\.tenants\.quotas\.primary: not available under LMCache",
        ),
        ({"report_top": 3}, r"adapter_params\.tenants\.report_top: unknown field"),
    ]
    for tenants, message in cases:
        with pytest.raises(ConfigError, match=message):
            resolve({**params, "tenants": tenants})
    # a quota is checked to hold one object of the smallest size named
    small = {"tenants": {"quotas": {"memory": {"default": "16KiB"}}}}
    with pytest.raises(ConfigError, match=r"memory\.default: 16KiB is 16KiB, less than one"):
        resolve({**params, **small, "object_bytes": ["32KiB"]})
    settings = resolve({**params, **small, "object_bytes": ["16KiB"]})
    assert str(settings.quotas["memory"].default) == "16KiB"

    chain = tmp_path / "chain.yaml"
    chain.write_text(
        "namespace: t\nlayout: {block_bytes: 4KiB, groups: [{block_size: 16}]}\n"
        "primary: {capacity: 64KiB}\ntiers: [{type: memory, capacity: 1MiB}]\n"
        "tenants: {quotas: {memory: {tenants: {acme: 50%}}}}\n"
    )
    assert list(resolve({"chain": str(chain)}).quotas["memory"].tenants) == ["acme"]
    with pytest.raises(ConfigError, match=r"adapter_params\.tenants: only beside inline tiers"):
        resolve({"chain": str(chain), "tenants": {"quotas": {}}})


def test_the_check_prints_each_tiers_quotas(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], rig: Any
) -> None:
    from tierkv.cli import main

    nvme = {"type": "nvme", "path": str(tmp_path / "kv"), "capacity": "1GiB"}
    quotas = {"nvme": {"tenants": {"salt-0bc5fe16": "50%"}, "borrow": False}}
    spec = rig.adapter_json([nvme], object_bytes=["2MiB"], tenants={"quotas": quotas})
    assert main(["lmcache", "check", spec]) == 0
    assert "      quotas salt-0bc5fe16 50%, no borrowing" in capsys.readouterr().out
    assert not (tmp_path / "kv").exists()


def test_a_guarantee_holds_across_object_sizes(rig: Any) -> None:
    """The shared capacity of a section evicts by the quota rule, not by age alone: a
    tenant flooding one object size takes the unguaranteed blocks and its own, never
    the blocks another tenant's guarantee covers in another size."""
    keeper, flooder = salt_tenant(KEEPER), salt_tenant(FLOODER)
    assert keeper is not None and flooder is not None
    l1 = rig.L1(8 << 20)
    quotas = {"nvme": {"tenants": {keeper: "50%"}}}
    other = 2 * SIZE
    adapter = rig.adapter(
        [rig.nvme(capacity="640KiB")], l1, object_bytes=[SIZE, other], tenants={"quotas": quotas}
    )
    drive = rig.Driver(adapter)
    mine = [rig.key(i, salt=KEEPER) for i in range(4)]
    seeds = [f"keeper{i}" for i in range(4)]
    assert drive.store(mine, [l1.obj(SIZE, s) for s in seeds]).is_successful()
    for r in range(8):  # 32 one-off objects of the other size: more than the section holds
        flood = [rig.key(100 + 4 * r + i, salt=FLOODER) for i in range(4)]
        assert drive.store(flood, [l1.obj(other, f"f{r}{i}") for i in range(4)]).is_successful()

    assert drive.lookup(mine) == [True] * 4
    out = [l1.obj(SIZE) for _ in mine]
    assert drive.load(mine, out) == [True] * 4
    assert [rig.content(o) for o in out] == [rig.pattern(s, SIZE) for s in seeds]
    assert drive.lookup([rig.key(100, salt=FLOODER)]) == [False]  # its oldest gave way
    assert drive.lookup([rig.key(131, salt=FLOODER)]) == [True]


def test_a_cap_holds_over_every_object_size(rig: Any) -> None:
    """A tenant capped at 64 KiB of objects without `borrow` holds no more than that
    over all sizes together: its objects of a second size take the place of its own
    older ones (each size alone would have let it hold 64 KiB more)."""
    l1 = rig.L1(4 << 20)
    quotas = {"nvme": {"default": "64KiB", "borrow": False}}
    adapter = rig.adapter(
        [rig.nvme(capacity="1MiB")], l1, object_bytes=[SIZE, 2 * SIZE], tenants={"quotas": quotas}
    )
    drive = rig.Driver(adapter)
    small = [rig.key(i, salt=FLOODER) for i in range(4)]  # 4 x 16 KiB: the whole cap
    assert drive.store(small, [l1.obj(SIZE, f"s{i}") for i in range(4)]).is_successful()
    large = [rig.key(10 + i, salt=FLOODER) for i in range(2)]  # 2 x 32 KiB
    assert drive.store(large, [l1.obj(2 * SIZE, f"l{i}") for i in range(2)]).is_successful()
    assert drive.lookup(large) == [True, True]
    assert drive.lookup(small) == [False] * 4  # its own oldest made the room
    shares = next(iter(adapter._chains.budgets.values())).shares
    assert shares is not None
    assert shares.report()[salt_tenant(FLOODER)]["held_object_bytes"] == 4 * SIZE
