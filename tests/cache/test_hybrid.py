"""Hybrid layouts through a real `TieredCache` (issue 22, items 2 and 3): a store keeps
only the sliding-window and state blocks a hit at a checkpoint can use, a load moves
only the window's and the state's blocks, `gpu_tokens` offsets every group kind, and
`usable_tokens` says what a partly failed load can still serve."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import torch

from tierkv.cache import TieredCache
from tierkv.config import parse_config
from tierkv.contract.keys import (
    OffloadKey,
    get_offload_group_idx,
    hash_token_blocks,
    make_offload_key,
)
from tierkv.testing import FaultyTier

pytestmark = pytest.mark.anyio

BLOCK = 1024
BS = 16
WINDOW = 64  # the next token sees 63 before it: 4 blocks of 16
FULL = {"kind": "full", "block_size": BS}
SLIDING = {"kind": "sliding_window", "block_size": BS, "window": WINDOW}
STATE = {"kind": "state", "block_size": BS}


def chain(groups: list[dict[str, Any]], **layout: Any) -> dict[str, Any]:
    return {
        "namespace": "hybrid",
        "layout": {"block_bytes": BLOCK, "groups": groups, **layout},
        "primary": {"capacity": 16 * BLOCK, "pin_memory": False},
        "tiers": [{"type": "faulty"}],
    }


@asynccontextmanager
async def opened(config: dict[str, Any]) -> AsyncIterator[tuple[TieredCache, FaultyTier]]:
    async with TieredCache(parse_config(config)) as cache:
        tier = cache.tier("faulty")
        assert isinstance(tier, FaultyTier)
        yield cache, tier


def request(cache: TieredCache, tokens: list[int]) -> list[list[OffloadKey]]:
    """One list of keys per group, as a server makes them."""
    return [
        [make_offload_key(h, g) for h in hash_token_blocks(tokens, group.block_size, namespace="x")]
        for g, group in enumerate(cache.config.layout.groups)
    ]


def payload(key: OffloadKey) -> bytes:
    return (hashlib.blake2b(key, digest_size=64).digest() * (BLOCK // 64))[:BLOCK]


async def store_request(
    cache: TieredCache, per_group: list[list[OffloadKey]], **kwargs: Any
) -> Any:
    """Store every block of every group, saying where each sits (`positions`)."""
    keys = [k for ks in per_group for k in ks]
    positions = [j for ks in per_group for j in range(len(ks))]
    result = await cache.store(keys, [payload(k) for k in keys], positions=positions, **kwargs)
    await cache.flush()
    return result


async def push_out_of_primary(cache: TieredCache) -> None:
    n = cache.primary.num_blocks
    fillers = [
        make_offload_key(h, 0) for h in hash_token_blocks(list(range(BS * n)), BS, namespace="f")
    ]
    assert (await cache.store(fillers, [bytes(BLOCK)] * n)).ok
    await cache.flush()


def per_group(keys: tuple[OffloadKey, ...] | list[OffloadKey], groups: int) -> list[int]:
    counts = [0] * groups
    for key in keys:
        counts[get_offload_group_idx(key)] += 1
    return counts


async def load_bytes(cache: TieredCache, hit: Any) -> list[int]:
    """Load the hit; check every block's bytes; return bytes moved per group."""
    out = torch.zeros(len(hit.keys_to_load), BLOCK, dtype=torch.uint8)
    result = await cache.load(hit.keys_to_load, out)
    assert result.ok, result.errors
    for i, key in enumerate(hit.keys_to_load):
        assert bytes(out[i].numpy()) == payload(key)
    groups = cache.config.layout.num_groups
    return [n * BLOCK for n in per_group(result.ok_keys, groups)]


async def test_checkpoints_keep_only_the_window_and_state_blocks_a_hit_can_use(
    faulty_tier_type: str,
) -> None:
    async with opened(chain([FULL, SLIDING, STATE], checkpoint_every=256)) as (cache, tier):
        conversation = list(range(1024))  # 64 blocks per group
        ks = request(cache, conversation)
        result = await store_request(cache, ks)
        assert not result.rejected
        # full: all 64; window: the 4 blocks before each of 256, 512, 768, 1024 (the end);
        # state: the states at those four points
        assert per_group(result.stored, 3) == [64, 16, 4]
        assert per_group(result.skipped, 3) == [0, 48, 60]
        assert cache.stats().primary["store_skipped"] == 108
        assert tier.stored_keys() >= set(result.stored)
        assert not tier.stored_keys() & set(result.skipped)
        assert set(ks[1][44:48]) <= set(result.stored) and ks[2][47] in result.stored

        await push_out_of_primary(cache)
        # the next turn: the conversation so far and more; the hit is the end checkpoint
        hit = await cache.lookup(request(cache, [*conversation, *range(5000, 5100)]))
        assert hit.hit_tokens == 1024
        assert [(r.first, r.end) for r in hit.group_ranges] == [(0, 64), (60, 64), (63, 64)]
        assert await load_bytes(cache, hit) == [64 * BLOCK, 4 * BLOCK, 1 * BLOCK]

        # a request sharing 900 tokens lands on the checkpoint below it, not at 896
        hit = await cache.lookup(request(cache, conversation[:900]))
        assert hit.hit_tokens == 768
        assert [(r.first, r.end) for r in hit.group_ranges] == [(0, 48), (44, 48), (47, 48)]
        assert await load_bytes(cache, hit) == [48 * BLOCK, 4 * BLOCK, 1 * BLOCK]


async def test_without_checkpoints_every_block_is_kept_and_loads_still_move_only_the_window(
    faulty_tier_type: str,
) -> None:
    async with opened(chain([FULL, SLIDING, STATE])) as (cache, _):
        conversation = list(range(1024))
        result = await store_request(cache, request(cache, conversation))
        assert per_group(result.stored, 3) == [64, 64, 64] and not result.skipped
        await push_out_of_primary(cache)
        hit = await cache.lookup(request(cache, conversation[:900]))
        assert hit.hit_tokens == 896  # every boundary is a checkpoint
        assert await load_bytes(cache, hit) == [56 * BLOCK, 4 * BLOCK, 1 * BLOCK]
        assert cache.stats().tiers["faulty"]["bytes_out"] == 61 * BLOCK


async def test_a_store_without_positions_keeps_every_block(faulty_tier_type: str) -> None:
    async with opened(chain([SLIDING, STATE], checkpoint_every=256)) as (cache, _):
        ks = request(cache, list(range(1024)))
        keys = [k for g in ks for k in g]
        result = await cache.store(keys, [payload(k) for k in keys])
        assert len(result.stored) == 128 and not result.skipped
        assert cache.stats().primary["store_skipped"] == 0


async def test_a_store_in_the_middle_of_a_request_keeps_no_end_checkpoint(
    faulty_tier_type: str,
) -> None:
    async with opened(chain([FULL, STATE], checkpoint_every=256)) as (cache, _):
        ks = request(cache, list(range(400)))  # 25 blocks per group
        result = await store_request(cache, ks, end_tokens=0)
        assert [k for k in result.stored if get_offload_group_idx(k) == 1] == [ks[1][15]]
        hit = await cache.lookup(ks)
        assert hit.hit_tokens == 256


async def test_bad_positions_change_nothing(faulty_tier_type: str) -> None:
    async with opened(chain([FULL, STATE], checkpoint_every=256)) as (cache, _):
        ks = request(cache, list(range(64)))[1]
        with pytest.raises(ValueError, match="3 positions for 4 keys"):
            await cache.store(ks, [payload(k) for k in ks], positions=[0, 1, 2])
        assert len(cache.primary) == 0 and cache.stats().primary["store_skipped"] == 0


@pytest.mark.parametrize(
    ("gpu_tokens", "keys_per_group"),
    [
        (512, [32, 4, 1]),  # full: blocks 32..63; window 60..63; state 63
        (1000, [2, 2, 1]),  # 62 blocks on the GPU: full 62, 63; window 62, 63; state 63
        (1024, [0, 0, 0]),  # the GPU holds the whole hit: nothing to load
    ],
)
async def test_gpu_tokens_offset_full_window_and_state_groups(
    faulty_tier_type: str, gpu_tokens: int, keys_per_group: list[int]
) -> None:
    async with opened(chain([FULL, SLIDING, STATE], checkpoint_every=256)) as (cache, tier):
        conversation = list(range(1024))
        await store_request(cache, request(cache, conversation))
        await push_out_of_primary(cache)
        asked_before = len(tier.calls)
        ks = request(cache, [*conversation, *range(5000, 5032)])
        hit = await cache.lookup(ks, gpu_tokens=gpu_tokens)
        assert hit.hit_tokens == 1024 and hit.gpu_tokens == gpu_tokens
        assert [len(g) for g in hit.group_keys] == keys_per_group
        for g, group_keys in enumerate(hit.group_keys):
            r = hit.group_ranges[g]
            on_gpu = gpu_tokens // BS
            assert group_keys == tuple(ks[g][max(r.first, on_gpu) : r.end])
        # blocks the GPU holds were never asked about
        asked = {k for op, keys in tier.calls[asked_before:] if op == "lookup" for k in keys}
        assert not asked & {k for g in ks for k in g[: gpu_tokens // BS]}
        assert sum(await load_bytes(cache, hit)) == sum(keys_per_group) * BLOCK


async def test_the_gpu_holding_a_state_lets_a_later_checkpoint_hit(faulty_tier_type: str) -> None:
    """The GPU holds 300 tokens (its state at 288 on its own); the cache has the state
    and the window at 512: the hit goes on to 512 and loads only those."""
    async with opened(chain([SLIDING, STATE], checkpoint_every=256)) as (cache, _):
        conversation = list(range(512))
        await store_request(cache, request(cache, conversation))
        hit = await cache.lookup(request(cache, conversation), gpu_tokens=300)
        assert hit.hit_tokens == 512
        assert [len(g) for g in hit.group_keys] == [4, 1]


async def make_fail(cache: TieredCache, tier: FaultyTier, keys: list[OffloadKey]) -> None:
    """The tier still claims `keys` on lookup, but their loads fail."""
    await push_out_of_primary(cache)
    await tier.remove(keys)
    tier.lie_about.update(keys)


@pytest.mark.parametrize(
    ("groups", "fail", "usable"),
    [
        ([FULL], (0, 40), 640),  # full attention: up to the first failed block
        ([FULL, SLIDING], (1, 61), 0),  # a hole in the window: no length it loaded serves
        ([FULL, STATE], (1, 63), 0),  # the state did not arrive: nothing
        ([FULL, SLIDING], (0, 50), 0),  # the windows before 800 were never loaded
    ],
)
async def test_usable_tokens_after_a_partly_failed_load(
    faulty_tier_type: str, groups: list[dict[str, Any]], fail: tuple[int, int], usable: int
) -> None:
    async with opened(chain(groups)) as (cache, tier):
        ks = request(cache, list(range(1024)))
        await store_request(cache, ks)
        await make_fail(cache, tier, [ks[fail[0]][fail[1]]])
        hit = await cache.lookup(ks)
        assert hit.hit_tokens == 1024  # the tier lied
        out = torch.zeros(len(hit.keys_to_load), BLOCK, dtype=torch.uint8)
        loaded = await cache.load(hit.keys_to_load, out)
        assert loaded.failed_keys == (ks[fail[0]][fail[1]],)
        assert cache.usable_tokens(hit, loaded) == usable
        # the next lookup knows the block is gone and lands where the truth is
        again = await cache.lookup(ks)
        assert again.hit_tokens <= 1024 and ks[fail[0]][fail[1]] not in again.keys_to_load


@pytest.mark.parametrize(
    ("groups", "usable"),
    [
        # full blocks 0..31 on the GPU and 32..39 loaded: 640
        ([FULL], 640),
        # 640 would also need the window before it (blocks 36..39), which the hit at
        # 1024 never loaded: what the GPU holds is what is left
        ([FULL, SLIDING], 512),
    ],
)
async def test_usable_tokens_counts_what_the_gpu_holds(
    faulty_tier_type: str, groups: list[dict[str, Any]], usable: int
) -> None:
    async with opened(chain(groups)) as (cache, tier):
        ks = request(cache, list(range(1024)))
        await store_request(cache, ks)
        await make_fail(cache, tier, [ks[0][40]])
        hit = await cache.lookup(ks, gpu_tokens=512)
        out = torch.zeros(len(hit.keys_to_load), BLOCK, dtype=torch.uint8)
        loaded = await cache.load(hit.keys_to_load, out)
        assert loaded.failed_keys == (ks[0][40],)
        assert cache.usable_tokens(hit, loaded) == usable
