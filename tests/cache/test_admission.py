"""Reuse-aware admission in the cache: a write-through tier with `admission: reuse`
is written only blocks seen in two requests, or the new tail of a continuing request
(issue 21, item 2); with `tinylfu`, every block while it has room, then those that
out-see the block it would evict (issue 36, item 1)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tierkv.cache import TieredCache
from tierkv.config import parse_config
from tierkv.contract.errors import ConfigError
from tierkv.contract.framing import FIXED_HEADER_BYTES
from tierkv.contract.jobs import ReqContext
from tierkv.contract.keys import OffloadKey, hash_token_blocks, make_offload_key
from tierkv.memory_tier import MemoryTier
from tierkv.policies.adaptive import AdaptiveAdmission

pytestmark = pytest.mark.anyio

BLOCK = 4096


def keys(n: int, tag: str) -> list[OffloadKey]:
    return [
        make_offload_key(h, 0) for h in hash_token_blocks(list(range(16 * n)), 16, namespace=tag)
    ]


def data(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, BLOCK), dtype=torch.uint8, generator=g)


def chain(blocks: int = 8, **tier: Any) -> dict[str, Any]:
    return {
        "namespace": "admission",
        "layout": {"block_bytes": BLOCK, "groups": [{"block_size": 16}]},
        "primary": {"capacity": blocks * BLOCK, "pin_memory": False},
        "tiers": [{"type": "memory", "capacity": 256 * BLOCK, "admission": "reuse", **tier}],
        "lookup_timeout": None,
    }


async def serve(cache: TieredCache, ks: list[OffloadKey], request: str, seed: int = 0) -> int:
    """One request as a server runs it: lookup, load the hit, store the rest."""
    ctx = ReqContext(request_id=request)
    hit = await cache.lookup([ks], ctx)
    n = len(hit.keys_to_load)
    if n:
        out = torch.empty(n, BLOCK, dtype=torch.uint8)
        result = await cache.load(hit.keys_to_load, out, ctx)
        assert not result.failed_keys
    if n < len(ks):
        await cache.store(ks[n:], data(len(ks), seed)[n:])
    await cache.flush()
    return n


def tier_blocks(cache: TieredCache) -> int:
    return int(cache.stats().tiers["memory"]["blocks_stored"])


async def test_blocks_seen_once_are_declined_and_written_when_seen_again() -> None:
    async with TieredCache(parse_config(chain(blocks=4))) as cache:
        one_shot = keys(12, "a")
        await serve(cache, one_shot, "r1")
        stats = cache.stats().tiers["memory"]
        assert stats["blocks_stored"] == 0 and stats["declined"] == 12
        # the primary (4 blocks) lost most of them: the second sight recomputes them,
        # and now they are written
        assert await serve(cache, one_shot, "r2") < 12
        assert tier_blocks(cache) >= 8
        # the third request finds every block: primary or tier
        assert await serve(cache, one_shot, "r3") == 12


async def test_the_new_tail_of_a_continuing_request_is_written_at_once() -> None:
    async with TieredCache(parse_config(chain(blocks=32))) as cache:
        conversation = keys(10, "c")
        await serve(cache, conversation[:6], "turn1")
        assert tier_blocks(cache) == 0
        # turn 2 hits 6 of its 10 blocks (from the primary): a continuation, so its 4
        # new blocks go down at once; the 6 hit blocks have just been seen twice and
        # are resident, so they follow (late admission)
        assert await serve(cache, conversation, "turn2") == 6
        assert tier_blocks(cache) == 10
        # a request sharing only a short prefix adds blocks seen once: declined
        other = [*conversation[:2], *keys(8, "other")]
        await serve(cache, other, "q")
        assert tier_blocks(cache) == 10


async def test_a_streaming_store_of_declined_blocks_is_not_rejected() -> None:
    # 40 new blocks through an 8-block primary: the tier declines them all, yet the
    # store streams (declined blocks are evictable) instead of rejecting the rest
    async with TieredCache(parse_config(chain(blocks=8))) as cache:
        ks = keys(40, "s")
        result = await cache.store(ks, data(40))
        assert not result.rejected and len(result.stored) == 40
        assert cache.stats().tiers["memory"]["declined"] == 40


async def test_admission_all_writes_everything() -> None:
    async with TieredCache(parse_config(chain(blocks=4, admission="all"))) as cache:
        await serve(cache, keys(12, "a"), "r1")
        assert tier_blocks(cache) == 12


def test_reuse_admission_needs_a_write_through_tier() -> None:
    with pytest.raises(ConfigError, match="admission 'reuse' applies to write_through"):
        parse_config(chain(write_policy="write_back"))
    with pytest.raises(ConfigError, match="admission"):
        parse_config(chain(admission="sometimes"))


# -- tinylfu: relative to the block the tier would evict (issue 36) -----------------------
def frames(n: int) -> int:
    """Bytes of `n` framed blocks in the memory tier (a 36-byte key, no MAC)."""
    return n * (BLOCK + FIXED_HEADER_BYTES + 36)


async def test_tinylfu_writes_every_block_while_the_tier_has_room() -> None:
    async with TieredCache(parse_config(chain(blocks=4, admission="tinylfu"))) as cache:
        await serve(cache, keys(12, "a"), "r1")
        stats = cache.stats().tiers["memory"]
        assert stats["blocks_stored"] == 12 and stats["declined"] == 0


async def test_tinylfu_keeps_popular_blocks_from_a_one_shot_request() -> None:
    config = chain(blocks=4, admission="tinylfu", capacity=frames(8))
    async with TieredCache(parse_config(config)) as cache:
        popular = keys(8, "p")
        for n in range(3):  # 8 blocks seen 3 times: the tier (8 blocks) is full of them
            await serve(cache, popular, f"p{n}")
        assert tier_blocks(cache) == 8
        one_shot = keys(6, "o")
        await serve(cache, one_shot, "o1")
        stats = cache.stats().tiers["memory"]
        # seen once, against blocks seen 3 times: kept out, except where the candidate
        # is resident in the primary (its tier copy serves nobody while it is there)
        assert stats["declined"] >= 2
        assert await serve(cache, popular, "p3") == 8  # every popular block still served
        # seen a second time: admitted against anything
        await serve(cache, one_shot, "o2")
        assert await serve(cache, one_shot, "o3") == 6


async def test_tinylfu_on_a_tier_that_cannot_name_its_candidates_is_reuse(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(MemoryTier, "names_eviction_candidates", False)  # as redis, s3
    async with TieredCache(parse_config(chain(blocks=4, admission="tinylfu"))) as cache:
        await serve(cache, keys(12, "a"), "r1")
        stats = cache.stats().tiers["memory"]
        assert stats["blocks_stored"] == 0 and stats["declined"] == 12


def test_tinylfu_admission_needs_a_write_through_tier() -> None:
    with pytest.raises(ConfigError, match="admission 'tinylfu' applies to write_through"):
        parse_config(chain(admission="tinylfu", write_policy="write_back"))


async def test_tinylfu_falls_back_to_reuse_when_a_tier_cannot_say(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(self: MemoryTier) -> object:
        raise RuntimeError("no idea")

    monkeypatch.setattr(MemoryTier, "room", broken)
    async with TieredCache(parse_config(chain(blocks=4, admission="tinylfu"))) as cache:
        await serve(cache, keys(12, "a"), "r1")  # the store goes on, by the reuse rule
        stats = cache.stats().tiers["memory"]
        assert stats["blocks_stored"] == 0 and stats["declined"] == 12
    assert "uses the reuse rule from now on" in caplog.text


async def test_tinylfu_counts_the_blocks_already_on_their_way_to_the_tier() -> None:
    config = chain(blocks=2, admission="tinylfu", capacity=frames(6))
    async with TieredCache(parse_config(config)) as cache:
        old = keys(4, "old")
        await serve(cache, old, "r1")  # 4 of 6 taken: room for 2
        primary = cache.core.primary
        assert [primary.is_ready(k) for k in old] == [False, False, True, True]
        handle = cache.core.tiers[0]
        new = keys(4, "new")
        cache.cascader.count_hits(new, ReqContext(request_id="r2"), new)  # seen once
        # 2 fit; the next 2 meet old[0] and old[1], seen once too: kept out
        assert cache.cascader._weighed(handle, new) == [True, True, False, False]
        handle.stats.inflight_bytes = 2 * BLOCK  # 2 blocks on their way take the room
        assert cache.cascader._weighed(handle, new) == [False] * 4
        # 4 on their way: the room and then old[0], old[1] are theirs; these meet
        # old[2] and old[3], resident in the primary (counted unseen), then nothing
        handle.stats.inflight_bytes = 4 * BLOCK
        assert cache.cascader._weighed(handle, new) == [True, True, False, False]
        handle.stats.inflight_bytes = 0


# -- adaptive: tinylfu or write-all, as the shadows' duel says (issue 36) -----------------
def test_adaptive_is_a_config_name_and_a_misspelling_lists_the_names() -> None:
    config = parse_config(chain(admission="adaptive"))
    assert config.tiers[0].admission == "adaptive"
    with pytest.raises(ConfigError, match="'all', 'reuse', 'tinylfu' or 'adaptive'"):
        parse_config(chain(admission="adaptiv"))
    with pytest.raises(ConfigError, match="admission 'adaptive' applies to write_through"):
        parse_config(chain(admission="adaptive", write_policy="write_back"))


async def test_adaptive_writes_every_block_while_the_tier_has_room() -> None:
    async with TieredCache(parse_config(chain(blocks=4, admission="adaptive"))) as cache:
        await serve(cache, keys(12, "a"), "r1")
        stats = cache.stats().tiers["memory"]
        assert stats["blocks_stored"] == 12 and stats["declined"] == 0


async def test_adaptive_sizes_its_shadows_for_the_tier_and_keeps_popular_blocks() -> None:
    config = chain(blocks=4, admission="adaptive", capacity=frames(8))
    async with TieredCache(parse_config(config)) as cache:
        popular = keys(8, "p")
        for n in range(3):
            await serve(cache, popular, f"p{n}")
        admission = cache.cascader.admission
        assert isinstance(admission, AdaptiveAdmission)
        assert admission.all_shadow.tier_blocks == 8 and admission.all_shadow.primary_blocks == 4
        assert not admission.writes_all  # both shadows served the same: tinylfu
        await serve(cache, keys(6, "o"), "o1")
        assert cache.stats().tiers["memory"]["declined"] >= 2  # as tinylfu
        assert await serve(cache, popular, "p3") == 8


async def test_adaptive_writes_everything_while_the_duel_says_write_all() -> None:
    config = chain(blocks=4, admission="adaptive", capacity=frames(8))
    async with TieredCache(parse_config(config)) as cache:
        for n in range(3):
            await serve(cache, keys(8, "p"), f"p{n}")
        admission = cache.cascader.admission
        assert isinstance(admission, AdaptiveAdmission)
        admission.all_shadow.hits = 1e9  # the write-all shadow far ahead
        await serve(cache, keys(6, "o"), "o1")
        assert admission.writes_all
        assert cache.stats().tiers["memory"]["declined"] == 0


async def test_adaptive_on_a_tier_that_cannot_name_its_candidates(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(MemoryTier, "names_eviction_candidates", False)  # as redis, s3
    async with TieredCache(parse_config(chain(blocks=4, admission="adaptive"))) as cache:
        await serve(cache, keys(12, "a"), "r1")  # reuse: seen once, declined
        assert cache.stats().tiers["memory"]["declined"] == 12
        admission = cache.cascader.admission
        assert isinstance(admission, AdaptiveAdmission)
        admission.all_shadow.hits = 1e9
        # unsized (no room to read), the shadows model SHADOW_BLOCKS, one key in
        # `sampling`: the duel runs on a request holding a sampled key
        batch = keys(40, "b")
        assert any(k[0] < 256 // admission.sampling for k in batch)
        await serve(cache, batch, "r2")
        assert admission.writes_all
        assert cache.stats().tiers["memory"]["blocks_stored"] == 40
