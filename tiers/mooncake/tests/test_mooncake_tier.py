"""The mooncake tier against a real Mooncake Store (mooncake_master on loopback, a
second process holding the segment): the shared conformance suite, then names,
namespaces, config errors and the registry."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
from pydantic import ValidationError
from tierkv_mooncake import MooncakeTier, MooncakeTierConfig
from tierkv_mooncake.testing import MooncakeMaster

from tierkv.contract.errors import TierUnavailable
from tierkv.contract.jobs import JobMetadata, ReqContext
from tierkv.contract.keys import OffloadKey
from tierkv.contract.slab import PrimaryView
from tierkv.registry import get_tier_class
from tierkv.testing import TierConformanceSuite, fill_slots, random_keys
from tierkv.tier import SecondaryTierManager

pytestmark = pytest.mark.anyio

CTX = ReqContext(request_id="mooncake-tests")
_job_ids = itertools.count(1)


def job(keys: list[OffloadKey], slots: list[int] | range) -> JobMetadata:
    return JobMetadata(next(_job_ids), tuple(keys), tuple(slots), CTX)


def mooncake_tier(master: MooncakeMaster, view: PrimaryView, **fields: Any) -> MooncakeTier:
    """A pure client (segment 0) of `master`, under a fresh key prefix."""
    settings = {
        "master": master.master,
        "metadata_server": master.metadata_server,
        "key_prefix": f"t{random.getrandbits(48):x}/",
        **fields,
    }
    return MooncakeTier(MooncakeTierConfig.model_validate(settings), view)


class TestMooncakeConformance(TierConformanceSuite):
    supports_capacity = False  # the store's eviction is its own, and unreported
    master: MooncakeMaster

    @pytest.fixture(autouse=True)
    def _master(self, mooncake_store: MooncakeMaster) -> None:
        self.master = mooncake_store

    def make_tier(
        self, primary: PrimaryView, *, capacity_blocks: int | None, **fields: Any
    ) -> SecondaryTierManager:
        return mooncake_tier(self.master, primary, batch_blocks=3, **fields)

    async def corrupt(self, tier: SecondaryTierManager, key: OffloadKey) -> None:
        assert isinstance(tier, MooncakeTier)
        frame = bytearray(raw_get(tier, key))
        frame[-1] ^= 0xFF
        await plant_frame(tier, key, bytes(frame))

    async def plant(self, tier: SecondaryTierManager, key: OffloadKey, frame: bytes) -> None:
        assert isinstance(tier, MooncakeTier)
        await plant_frame(tier, key, frame)


def raw_get(tier: MooncakeTier, key: OffloadKey) -> bytes:
    assert tier._client is not None
    return bytes(tier._client.store.get(tier._names.name(key)))


async def plant_frame(tier: MooncakeTier, key: OffloadKey, frame: bytes) -> None:
    """Replace the stored value of `key` behind the tier's back (what any client of
    the store can do)."""
    assert tier._client is not None
    store, name = tier._client.store, tier._names.name(key)
    assert store.remove(name, True) in (0, -704)
    assert store.put(name, frame) == 0


# -- names, namespaces, config -----------------------------------------------------------
async def test_namespaces_never_see_each_others_blocks(mooncake_store: MooncakeMaster) -> None:
    rng = random.Random(21)
    a = PrimaryView(bytearray(8 * 4096), 4096, "model-a")
    b = PrimaryView(bytearray(8 * 4096), 4096, "model-b")
    ta = mooncake_tier(mooncake_store, a, key_prefix="shared/")
    tb = mooncake_tier(mooncake_store, b, key_prefix="shared/")
    await ta.open()
    await tb.open()
    try:
        keys = random_keys(2, rng)
        fill_slots(a, [0, 1], rng)
        assert (await ta.store(job(keys, [0, 1]))).ok
        assert await ta.lookup(keys, CTX) == [True, True]
        assert await tb.lookup(keys, CTX) == [False, False]
        assert not (await tb.load(job(keys, [2, 3]))).ok_keys
        await ta.remove(keys)
    finally:
        await ta.close()
        await tb.close()


async def test_an_unreachable_master_fails_open_fast_and_names_it() -> None:
    view = PrimaryView(bytearray(4096), 4096, "ns")
    tier = MooncakeTier(
        MooncakeTierConfig(master="127.0.0.1:1", metadata_server="http://127.0.0.1:1/metadata"),
        view,
    )
    with pytest.raises(TierUnavailable, match=r"master at 127\.0\.0\.1:1 is unreachable"):
        await tier.open()
    with pytest.raises(TierUnavailable, match="not open"):
        await tier.lookup(random_keys(1), CTX)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"master": "nohost"}, "is not host:port"),
        ({"metadata_server": "ftp://x/metadata"}, "is not a metadata server"),
        ({"rdma_devices": "mlx5_0"}, "applies to protocol rdma"),
        ({"protocol": "udp"}, "tcp"),
        ({"replicas": 0}, "replicas"),
        ({"segment_size": "8MiB"}, "at least 16MiB"),
        ({"segment_size": "1GB"}, None),
    ],
)
def test_config_errors_name_the_field(fields: dict[str, Any], message: str | None) -> None:
    if message is None:  # decimal units are accepted (with a warning elsewhere)
        MooncakeTierConfig.model_validate({"type": "mooncake", **fields})
        return
    with pytest.raises(ValidationError, match=message):
        MooncakeTierConfig.model_validate({"type": "mooncake", **fields})


def test_rdma_config_takes_device_names() -> None:
    config = MooncakeTierConfig(protocol="rdma", rdma_devices="mlx5_0,mlx5_1", segment_size="4GiB")
    assert int(config.segment_size) == 4 << 30


def test_registered_as_mooncake() -> None:
    assert get_tier_class("mooncake") is MooncakeTier
