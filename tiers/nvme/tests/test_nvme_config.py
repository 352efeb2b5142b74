"""The nvme tier as a YAML user meets it: installed through the entry point like any
third-party tier, configured with units, bad fields named by their YAML path, and a
chain using it round-trips real blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
from tierkv_nvme import NvmeTier, NvmeTierConfig

from tierkv.config import parse_config
from tierkv.contract.errors import ConfigError
from tierkv.registry import get_tier_class, installed_tiers
from tierkv.roundtrip import run_roundtrip

pytestmark = pytest.mark.anyio


def _chain(tier: str) -> str:
    return f"""
namespace: nvme-config-test
layout: {{block_bytes: 64KiB, groups: [{{kind: full, block_size: 16}}]}}
primary: {{capacity: 1MiB, eviction: lru, pin_memory: false}}
tiers:
  - {tier}
"""


def test_the_registry_finds_nvme_through_its_entry_point() -> None:
    info = installed_tiers()["nvme"]
    assert info.distribution == "tierkv-cache-nvme"
    assert info.target == "tierkv_nvme:NvmeTier"
    assert get_tier_class("nvme") is NvmeTier


def test_a_yaml_nvme_section_reads_units_and_defaults(tmp_path: Path) -> None:
    config = parse_config(_chain(f"{{type: nvme, path: {tmp_path}, capacity: 2GiB}}"))
    [tier] = config.tiers
    assert isinstance(tier, NvmeTierConfig)
    assert tier.capacity == 2 * 2**30
    assert tier.path == tmp_path
    assert (tier.eviction, tier.io_concurrency, tier.fsync) == ("lru", 8, "always")
    assert tier.write_policy == "write_through"
    home = parse_config(_chain("{type: nvme, path: ~/kv, capacity: 1GiB}")).tiers[0]
    assert isinstance(home, NvmeTierConfig)
    assert home.path == Path.home() / "kv"


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ("{type: nvme, capacity: 1GiB}", "tiers[0].path: is required"),
        ("{type: nvme, path: '', capacity: 1GiB}", "tiers[0].path: '': path must name"),
        ("{type: nvme, path: /x, capactiy: 1GiB}", "did you mean 'capacity'?"),
        ("{type: nvme, path: /x, capacity: 12 parsecs}", "tiers[0].capacity: '12 parsecs' is not"),
        ("{type: nvme, path: /x, capacity: 0}", "tiers[0].capacity: 0"),
        ("{type: nvme, path: /x, capacity: 1GiB, fsync: sometimes}", "tiers[0].fsync: 'sometimes'"),
        ("{type: nvme, path: /x, capacity: 1GiB, io_concurrency: 0}", "tiers[0].io_concurrency"),
        ("{type: nvme, path: /x, capacity: 1GiB, eviction: random}", "tiers[0].eviction"),
        (
            "{type: nvme, path: /x, capacity: 1GiB, layout: files, direct: true}",
            "tiers[0]: direct: true moves the slab layout's slots; with layout: files it "
            "would do nothing: set layout: slab, or direct: false",
        ),
        (
            "{type: nvme, path: /x, capacity: 1GiB, io_engine: python, direct: true}",
            "tiers[0]: direct: true needs the compiled core, which io_engine: python turns "
            "off: set io_engine: auto (or native), or direct: false",
        ),
    ],
)
def test_bad_nvme_fields_are_named_by_their_yaml_path(section: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(_chain(section))
    assert message in str(caught.value)


async def test_a_chain_with_an_nvme_tier_round_trips_every_block(tmp_path: Path) -> None:
    config = parse_config(_chain(f"{{type: nvme, path: {tmp_path}, capacity: 8MiB, fsync: never}}"))
    report = await run_roundtrip(config, 48, seed=3)
    assert report["ok"], report["lines"]
    assert report["tier_blocks"] == {"nvme": 48}
    assert report["promoted"]["nvme"] > 0
