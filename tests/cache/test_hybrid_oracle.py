"""The hybrid hit rule end to end, against an oracle (issue 22, item 4).

A real `TieredCache` (the primary, a `memory` tier and a `faulty` one) holds random
mixes of full, sliding-window and state groups with their own block sizes and windows;
each block is absent, resident in the primary, in one tier or both, or only claimed by
a lying tier (its load fails); some load jobs fail outright. The oracle is the
definition, in tokens, of what a hit of `L` needs (not `tierkv.hits`):

- the hit is the greatest `L` every group can serve from what the cache shows;
- every block a load returns is byte-identical to what was stored under its key;
- what a partly failed load can serve (`usable_tokens`) never exceeds the hit, is
  served by blocks that did load, and is the greatest such length; the next lookup
  does not count a block whose load failed.

A second property stores whole requests under `checkpoint_every` and checks a lookup
of any prefix still lands on the last checkpoint it covers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierkv.cache import TieredCache
from tierkv.config import parse_config
from tierkv.contract.keys import OffloadKey, hash_token_blocks, make_offload_key
from tierkv.layout import GroupSpec, KVLayout
from tierkv.retention import kept_blocks
from tierkv.testing import FaultyTier
from tierkv.testing.hits_oracle import blocks_needed

BLOCK = 64
PLACES = ("none", "primary", "memory", "faulty", "both", "lie")


def oracle(groups: Sequence[GroupSpec], present: Sequence[set[int]], lengths: Sequence[int]) -> int:
    """The greatest `L` every group serves: aligned to each block size, every needed
    block present."""
    top = min(n * g.block_size for g, n in zip(groups, lengths))
    for tokens in range(top, -1, -1):
        if all(
            tokens % g.block_size == 0 and blocks_needed(g, tokens) <= have
            for g, have in zip(groups, present)
        ):
            return tokens
    raise AssertionError("0 always serves")


def payload(key: OffloadKey) -> bytes:
    return (hashlib.blake2b(key, digest_size=BLOCK).digest() * (BLOCK // 64))[:BLOCK]


@st.composite
def group_specs(draw: st.DrawFn) -> tuple[GroupSpec, ...]:
    groups = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["full", "sliding_window", "state"]))
        bs = draw(st.sampled_from([1, 2, 4]))
        window = draw(st.integers(1, 12)) if kind == "sliding_window" else None
        groups.append(GroupSpec(kind=kind, block_size=bs, window=window))
    return tuple(groups)


@dataclass
class Scenario:
    groups: tuple[GroupSpec, ...]
    places: list[list[str]]  # per group, per block
    gpu_tokens: int
    fail_jobs: int


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    groups = draw(group_specs())
    tokens = draw(st.integers(0, 40))
    places = [
        draw(st.lists(st.sampled_from(PLACES), min_size=n, max_size=n))
        for n in (tokens // g.block_size for g in groups)
    ]
    return Scenario(groups, places, draw(st.integers(0, tokens)), draw(st.integers(0, 2)))


def chain(groups: Sequence[GroupSpec], slots: int, **layout: Any) -> dict[str, Any]:
    return {
        "namespace": "oracle",
        "layout": {"block_bytes": BLOCK, "groups": [g.model_dump() for g in groups], **layout},
        "primary": {"capacity": slots * BLOCK, "pin_memory": False},
        "tiers": [
            {"type": "memory"},
            {"type": "faulty", "failure_threshold": 1000},  # failed jobs never open it
        ],
    }


def group_keys(
    groups: Sequence[GroupSpec], lengths: Sequence[int], tag: str
) -> list[list[OffloadKey]]:
    tokens = list(range(max((n * g.block_size for g, n in zip(groups, lengths)), default=0)))
    return [
        [make_offload_key(h, i) for h in hash_token_blocks(tokens, g.block_size, namespace=tag)][:n]
        for i, (g, n) in enumerate(zip(groups, lengths))
    ]


async def store(cache: TieredCache, keys: list[OffloadKey]) -> None:
    if keys:
        result = await cache.store(keys, [payload(k) for k in keys])
        assert result.ok, result.error
    await cache.flush()


async def run_scenario(s: Scenario) -> None:
    groups = s.groups
    lengths = [len(p) for p in s.places]
    total = sum(lengths)
    async with TieredCache(parse_config(chain(groups, 2 * total + 8))) as cache:
        memory, faulty = cache.tier("memory"), cache.tier("faulty")
        assert isinstance(faulty, FaultyTier)
        ks = group_keys(groups, lengths, "req")
        at = {k: p for keys, places in zip(ks, s.places) for k, p in zip(keys, places)}
        # into both tiers, then out of the primary, then out of the tier it is not in
        await store(cache, [k for k, p in at.items() if p in ("memory", "faulty", "both")])
        n = cache.primary.num_blocks
        fillers = [
            make_offload_key(h, 0) for h in hash_token_blocks(list(range(n)), 1, namespace="f")
        ]
        await store(cache, fillers)
        await memory.remove([k for k, p in at.items() if p == "faulty"])
        await faulty.remove([k for k, p in at.items() if p == "memory"])
        primary_only = [k for k, p in at.items() if p == "primary"]
        await store(cache, primary_only)
        await memory.remove(primary_only)
        await faulty.remove(primary_only)
        faulty.lie_about = {k for k, p in at.items() if p == "lie"}
        faulty.fail_jobs = s.fail_jobs

        on_gpu = [min(n, s.gpu_tokens // g.block_size) for g, n in zip(groups, lengths)]
        shown = [
            {j for j, p in enumerate(places) if p != "none" or j < gpu}
            for places, gpu in zip(s.places, on_gpu)
        ]
        hit = await cache.lookup(ks, gpu_tokens=s.gpu_tokens)
        assert hit.hit_tokens == oracle(groups, shown, lengths)
        for g, (group, r) in enumerate(zip(groups, hit.group_ranges)):
            need = blocks_needed(group, hit.hit_tokens)
            assert set(range(r.first, r.end)) == need or (not need and r.first == r.end)
            assert hit.group_keys[g] == tuple(ks[g][j] for j in sorted(need) if j >= on_gpu[g])

        out = torch.zeros(len(hit.keys_to_load), BLOCK, dtype=torch.uint8)
        loaded = await cache.load(hit.keys_to_load, out)
        ok = set(loaded.ok_keys)
        for i, key in enumerate(hit.keys_to_load):
            if key in ok:
                assert bytes(out[i].numpy()) == payload(key), "a load returned other bytes"
        failed = set(loaded.failed_keys)
        assert {k for k in hit.keys_to_load if at[k] == "lie"} <= failed
        assert not {k for k in failed if at[k] in ("primary", "memory", "both")}
        if not s.fail_jobs:
            assert failed == {k for k in hit.keys_to_load if at[k] == "lie"}

        usable = cache.usable_tokens(hit, loaded)
        served = [
            {j for j, k in enumerate(keys) if k in ok or j < gpu} for keys, gpu in zip(ks, on_gpu)
        ]
        assert usable <= hit.hit_tokens
        assert usable == hit.hit_tokens or failed
        for group, have in zip(groups, served):
            assert blocks_needed(group, usable) <= have, (
                "usable tokens need a block that did not load"
            )
        assert usable == oracle(groups, served, [r.end for r in hit.group_ranges])

        again = await cache.lookup(ks, gpu_tokens=s.gpu_tokens)
        still = [{j for j in have if ks[g][j] not in failed} for g, have in enumerate(shown)]
        assert again.hit_tokens == oracle(groups, still, lengths)


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(s=scenarios())
def test_the_cache_serves_what_the_definition_says(faulty_tier_type: str, s: Scenario) -> None:
    anyio.run(run_scenario, s)


async def run_checkpoints(
    groups: tuple[GroupSpec, ...], every_steps: int | None, tokens: int, prefix: int
) -> None:
    layout = KVLayout(block_bytes=BLOCK, groups=groups)
    every = None if every_steps is None else every_steps * layout.hit_step
    layout = KVLayout(block_bytes=BLOCK, groups=groups, checkpoint_every=every)
    lengths = [tokens // g.block_size for g in groups]
    ks = group_keys(groups, lengths, "conversation")
    flat = [k for keys in ks for k in keys]
    positions = [j for keys in ks for j in range(len(keys))]
    async with TieredCache(parse_config(chain(groups, 4, checkpoint_every=every))) as cache:
        result = await cache.store(flat, [payload(k) for k in flat], positions=positions)
        await cache.flush()
        kept = kept_blocks(layout, flat, positions)
        assert set(result.stored) == {k for k, ok in zip(flat, kept) if ok}
        assert set(result.skipped) == {k for k, ok in zip(flat, kept) if not ok}
        assert cache.stats().primary["store_skipped"] == len(result.skipped)

        asked = [keys[: prefix // g.block_size] for keys, g in zip(ks, groups)]
        hit = await cache.lookup(asked)
        stored = set(result.stored)
        present = [{j for j, k in enumerate(keys) if k in stored} for keys in asked]
        assert hit.hit_tokens == oracle(groups, present, [len(a) for a in asked])
        step = layout.hit_step
        end = min(n * g.block_size for g, n in zip(groups, lengths)) // step * step
        reach = min(len(a) * g.block_size for a, g in zip(asked, groups))
        checkpoints = [
            p for p in range(0, reach + 1, step) if p % layout.checkpoint_tokens == 0 or p == end
        ]
        assert hit.hit_tokens >= max(checkpoints), "a checkpoint's blocks were not kept"

        out = torch.zeros(len(hit.keys_to_load), BLOCK, dtype=torch.uint8)
        loaded = await cache.load(hit.keys_to_load, out)
        assert loaded.ok
        for i, key in enumerate(hit.keys_to_load):
            assert bytes(out[i].numpy()) == payload(key)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    groups=group_specs(),
    every_steps=st.one_of(st.none(), st.integers(1, 5)),
    tokens=st.integers(0, 64),
    data=st.data(),
)
def test_a_store_under_checkpoints_keeps_every_checkpoint_hit(
    faulty_tier_type: str,
    groups: tuple[GroupSpec, ...],
    every_steps: int | None,
    tokens: int,
    data: st.DataObject,
) -> None:
    prefix = data.draw(st.integers(0, tokens + 8), label="prefix")
    anyio.run(run_checkpoints, groups, every_steps, tokens, prefix)
