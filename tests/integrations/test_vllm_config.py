"""A `{"type": "tierkv", ...}` entry as vLLM hands it over: validated by tierkv's
models with path-precise errors (nothing created on a bad one), namespaces derived
from what vLLM knows, and registration through the `vllm.general_plugins` entry point."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tierkv.contract.errors import ConfigError, UnknownTierType

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def nvme(path: Path, **extra: Any) -> dict[str, Any]:
    return {"type": "nvme", "path": str(path), "capacity": "4MiB", **extra}


def refused(vllm: Any, tiers: list[dict[str, Any]]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        vllm.engine(tiers)
    return info.value


def test_a_bad_value_is_named_by_its_path(vllm: Any, tmp_path: Path) -> None:
    error = refused(
        vllm,
        [
            vllm.entry(nvme(tmp_path / "a")),
            vllm.entry(nvme(tmp_path / "b", capacity="12 parsecs")),
        ],
    )
    assert error.problems == [
        "secondary_tiers[1].tier.capacity: '12 parsecs' is not a size (use e.g. 8GiB, 512MiB, 4096)"
    ]
    assert not (tmp_path / "b").exists()


def test_an_unknown_tier_type_lists_what_is_installed(vllm: Any) -> None:
    with pytest.raises(UnknownTierType) as info:
        vllm.engine([vllm.entry({"type": "nvmee"})])
    (problem,) = info.value.problems
    assert problem.startswith("secondary_tiers[0].tier.type: unknown tier type 'nvmee'")
    assert "nvme" in problem


def test_a_typo_in_a_tier_field_is_refused(vllm: Any, tmp_path: Path) -> None:
    error = refused(vllm, [vllm.entry({"type": "nvme", "path": str(tmp_path), "capactiy": 1})])
    assert any(
        p.startswith("secondary_tiers[0].tier.capactiy: unknown field") for p in error.problems
    )


def test_write_policies_vllm_cannot_honour_are_refused(vllm: Any, tmp_path: Path) -> None:
    error = refused(vllm, [vllm.entry(nvme(tmp_path, write_policy="write_back"))])
    assert error.problems[0].startswith("secondary_tiers[0].tier.write_policy: 'write_back'")
    error = refused(vllm, [vllm.entry(nvme(tmp_path, admission="reuse"))])
    assert error.problems[0].startswith("secondary_tiers[0].tier.admission: 'reuse'")


@pytest.mark.parametrize(
    ("entry", "path"),
    [
        ({"type": "tierkv"}, "secondary_tiers[0]: give exactly one of"),
        ({"type": "tierkv", "tier": {"type": "memory"}, "chain": "x.yaml"}, "secondary_tiers[0]:"),
        ({"type": "tierkv", "tier": {"type": "memory"}, "tiers": []}, "secondary_tiers[0].tiers:"),
        ({"type": "tierkv", "tier": "memory"}, "secondary_tiers[0].tier: expected a tier"),
        ({"type": "tierkv", "tier": {"type": "memory"}, "namespace": ""}, ".namespace:"),
        (
            {"type": "tierkv", "tier": {"type": "memory"}, "medium": "gpu"},
            "secondary_tiers[0].medium: 'gpu' is not one of CPU, STORAGE",
        ),
        (
            {"type": "tierkv", "tier": {"type": "memory"}, "locality": "nearby"},
            "secondary_tiers[0].locality: 'nearby' is not one of LOCAL, REMOTE",
        ),
    ],
)
def test_malformed_entries_are_refused(vllm: Any, entry: dict[str, Any], path: str) -> None:
    error = refused(vllm, [entry])
    assert path in error.problems[0]


def test_each_tier_type_says_its_medium_and_locality_and_an_entry_overrides_them(
    vllm: Any, tmp_path: Path
) -> None:
    from vllm.v1.kv_offload.base import Locality, Medium, TierFilter, TierMatcher
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    memory = vllm.engine([vllm.entry({"type": "memory"})]).tiers[0]
    disk = vllm.engine([vllm.entry(nvme(tmp_path / "a"))]).tiers[0]
    relabelled = vllm.engine([vllm.entry(nvme(tmp_path / "b"), medium="cpu", locality="REMOTE")])
    remote = relabelled.tiers[0]
    assert (memory.medium, memory.locality) == (Medium.CPU, Locality.LOCAL)
    assert memory.cache_hit_source is CacheHitSource.HOST
    assert (disk.medium, disk.locality) == (Medium.STORAGE, Locality.LOCAL)
    assert disk.cache_hit_source is CacheHitSource.DISK
    assert (remote.medium, remote.locality) == (Medium.CPU, Locality.REMOTE)
    cpu_only = TierFilter(matchers=(TierMatcher(medium=Medium.CPU),))  # kv_load_tiers: cpu
    assert cpu_only.allows(memory.medium, memory.locality)
    assert not cpu_only.allows(disk.medium, disk.locality)
    for engine_tier in (memory, disk, remote):
        engine_tier.shutdown()


def write_chain(path: Path, tiers: str) -> Path:
    path.write_text(
        "namespace: tenant-a\n"
        "layout: {block_bytes: 4KiB, groups: [{block_size: 16}]}\n"
        "primary: {capacity: 64KiB}\n"
        f"tiers:\n{tiers}"
    )
    return path


def test_a_chain_file_names_the_tier_each_entry_is(vllm: Any, tmp_path: Path) -> None:
    chain = write_chain(
        tmp_path / "chain.yaml",
        "  - {type: memory, capacity: 1MiB}\n"
        f"  - {{type: nvme, path: {tmp_path}/kv, capacity: 4MiB}}\n",
    )
    engine = vllm.engine(
        [
            {"type": "tierkv", "chain": str(chain), "chain_tier": "memory"},
            {"type": "tierkv", "chain": str(chain), "chain_tier": 1},
        ]
    )
    assert [a.tierkv_tier.get_tier_type() for a in engine.tiers] == ["memory", "nvme"]
    assert engine.tiers[1].namespace.startswith("tenant-a|vllm:tiny-model:")
    keys = vllm.keys(3)
    ctx = engine.new_request()
    engine.store(ctx, keys)
    engine.finish(ctx)
    engine.settle()

    error = refused(vllm, [{"type": "tierkv", "chain": str(chain)}])
    assert error.problems == [
        f"secondary_tiers[0].chain_tier: {chain} has 2 tiers (memory, nvme); name the one "
        "this entry is (one secondary_tiers entry per tier, in chain order)"
    ]


def test_a_bad_chain_file_is_reported_as_tierkv_validate_does(vllm: Any, tmp_path: Path) -> None:
    chain = write_chain(tmp_path / "bad.yaml", "  - {type: memory, capacity: lots}\n")
    error = refused(vllm, [{"type": "tierkv", "chain": str(chain)}])
    assert error.source == str(chain)
    assert error.problems == [
        "tiers[0].capacity: 'lots' is not a size (use e.g. 8GiB, 512MiB, 4096)"
    ]


def test_the_default_namespace_says_model_dtype_block_and_layout(vllm: Any) -> None:
    a = vllm.engine([vllm.entry({"type": "memory"})], model="org/llama", dtype="bfloat16")
    b = vllm.engine([vllm.entry({"type": "memory"})], model="org/llama", dtype="float16")
    c = vllm.engine([vllm.entry({"type": "memory"})], model="org/llama", dtype="bfloat16", tp=2)
    d = vllm.engine([vllm.entry({"type": "memory"}, namespace="tenant-7")])
    name_a, name_b, name_c = (e.tiers[0].namespace for e in (a, b, c))
    assert name_a.startswith("vllm:org/llama:bfloat16:16t:tp1pp1:")
    assert name_c.startswith("vllm:org/llama:bfloat16:16t:tp2pp1:")
    assert len({name_a, name_b, name_c}) == 3
    assert d.tiers[0].namespace == "tenant-7"


@pytest.mark.parametrize("layout", ["agnostic", "replicated"])
def test_parallelism_agnostic_engines_of_one_model_share_blocks(
    vllm: Any, tmp_path: Path, layout: str
) -> None:
    # as vLLM's own fs and obj tiers: a portable layout collapses TP/PP into one
    # namespace, so a TP2 engine reads what a TP4 engine of the same model stored
    flags = {layout: True}
    tp4 = vllm.engine([vllm.entry(nvme(tmp_path))], model="org/llama", tp=4, **flags)
    keys = vllm.keys(4)
    ctx = tp4.new_request()
    tp4.store(ctx, keys)
    tp4.finish(ctx)
    tp4.settle()
    tp4.shutdown()  # one nvme tier per directory at a time
    tp2 = vllm.engine([vllm.entry(nvme(tmp_path))], model="org/llama", tp=2, **flags)
    assert tp2.tiers[0].namespace == tp4.tiers[0].namespace
    assert ":any:" in tp2.tiers[0].namespace
    assert tp2.promote(tp2.new_request(), keys) == 4
    tp2.shutdown()
    direct = [vllm.engine([vllm.entry({"type": "memory"})], tp=tp) for tp in (2, 4)]
    assert direct[0].tiers[0].namespace != direct[1].tiers[0].namespace
    for engine in direct:
        engine.shutdown()


def test_two_models_sharing_a_directory_never_see_each_others_blocks(
    vllm: Any, tmp_path: Path
) -> None:
    keys = vllm.keys(4)
    writer = vllm.engine([vllm.entry(nvme(tmp_path))], model="model-a")
    ctx = writer.new_request()
    writer.store(ctx, keys)
    writer.finish(ctx)
    writer.settle()
    writer.shutdown()

    other = vllm.engine([vllm.entry(nvme(tmp_path))], model="model-b")
    assert other.promote(other.new_request(), keys) == 0
    other.shutdown()
    same = vllm.engine([vllm.entry(nvme(tmp_path))], model="model-a")
    assert same.promote(same.new_request(), keys) == 4


def test_the_entry_point_registers_the_tierkv_type(vllm: Any) -> None:
    code = (
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory as F\n"
        "print(F.get_tier_class({'type': 'tierkv'}).__name__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "TierkvSecondaryTier"
