"""The hybrid demo engine through a real `TieredCache` (tierkv.demo.hybrid_engine,
tierkv.demo.groups): each group loads only what its layers read; a failed load
narrows the hit and the rest is recomputed; the demo's three columns agree for both
hybrid kinds; a long sliding-window conversation moves a fraction of full
attention's bytes; and a wrong restore (a window block of another request, a state of
the wrong boundary) fails the correctness check the demo applies."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tierkv.cache import TieredCache
from tierkv.config import CacheConfig, parse_config
from tierkv.contract.keys import OffloadKey
from tierkv.demo import DemoOptions, ModelConfig, WorkloadConfig, run_demo
from tierkv.demo.engine import Generation
from tierkv.demo.hybrid_engine import HybridEngine
from tierkv.demo.hybrid_model import HybridConfig, HybridDecoder
from tierkv.demo.run import agrees
from tierkv.registry import register_tier, unregister_tier
from tierkv.testing.faulty import FaultyTier

pytestmark = pytest.mark.anyio

TINY = ModelConfig(vocab=512, hidden=64, layers=4, heads=2, seed=3)
WINDOW = HybridConfig("window", 24)  # the 24 tokens before a hit: 2 blocks of 16
STATE = HybridConfig("state")
ATOL = 1e-3


def hybrid(kind: str) -> HybridConfig:
    return WINDOW if kind == "window" else STATE


def engine(model: HybridDecoder, *, prefix_caching: bool = False) -> HybridEngine:
    """Blocks of 8 tokens, 2 per offloaded block (16 tokens); room for 160 tokens."""
    return HybridEngine(
        model,
        gpu_blocks=20,
        gpu_block_tokens=8,
        block_factor=2,
        threaded=False,
        prefix_caching=prefix_caching,
    )


def chain(eng: HybridEngine, tier: dict[str, Any] | None = None, slots: int = 64) -> CacheConfig:
    config = parse_config(
        {
            "namespace": "overridden",
            "layout": {"block_bytes": "4KiB", "groups": [{"block_size": 16}]},
            "primary": {"capacity": f"{slots * int(eng.layout.block_bytes)}B", "pin_memory": False},
            "tiers": [tier or {"type": "memory", "capacity": "64MiB"}],
            "promotion_reserve": 1.0,
        }
    )
    return config.model_copy(update={"layout": eng.layout, "namespace": eng.namespace})


def tokens(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY.vocab, (n,), generator=gen).tolist()


async def blocks_of(model: HybridDecoder, prompt: list[int]) -> dict[OffloadKey, torch.Tensor]:
    """Every block of both groups a request over `prompt` stores, by key, as bytes."""
    eng = engine(model)
    async with TieredCache(chain(eng)) as cache:
        eng.attach(cache)
        await eng.generate(prompt, 2)
        await cache.flush()
        keys = [k for group in eng.block_keys(prompt) for k in group]
        rows = torch.empty(len(keys), int(eng.layout.block_bytes), dtype=torch.uint8)
        assert (await cache.load(keys, rows)).ok
    return dict(zip(keys, rows))


async def served(
    model: HybridDecoder,
    prompt: list[int],
    planted: dict[OffloadKey, torch.Tensor],
    tier: dict[str, Any] | None = None,
) -> Generation:
    """`prompt` on a fresh engine over a chain holding exactly `planted`."""
    eng = engine(model)
    async with TieredCache(chain(eng, tier)) as cache:
        stored = await cache.store(list(planted), torch.stack(list(planted.values())))
        assert stored.ok
        await cache.flush()
        eng.attach(cache)
        return await eng.generate(prompt, 4)


@pytest.fixture
def faulty() -> Iterator[str]:
    register_tier(FaultyTier)
    yield "faulty"
    unregister_tier("faulty")


# -- each group moves what its layers read ---------------------------------------------------
@pytest.mark.parametrize("kind", ["window", "state"])
async def test_each_group_loads_only_what_its_layers_read(kind: str) -> None:
    model = HybridDecoder(TINY, hybrid(kind))
    eng, base = engine(model), engine(model)
    prompt = tokens(97, seed=1)  # 6 reusable blocks of 16: a hit of 96 tokens
    async with TieredCache(chain(eng, slots=4)) as cache:
        eng.attach(cache)
        first = await eng.generate(prompt, 3)
        await cache.flush()
        for seed in (2, 3):  # push the prompt's blocks out of the 4-slot primary
            await eng.generate(tokens(97, seed), 3)
            await cache.flush()
        again = await eng.generate([*prompt, 5, 6, 7], 3)
        keys = eng.block_keys(prompt)
        lookup = await cache.lookup(keys)
    assert first.group_stored == [6, 6] and first.reused_tokens == 0
    assert again.reused_tokens == 96 and again.sources.get("memory", 0) > 0
    assert again.group_loaded[0] == 6  # full attention: every block before the hit
    needed = lookup.group_ranges[1]
    assert again.group_loaded[1] == needed.end - needed.first
    assert needed.end == 6 and needed.end - needed.first < 6
    if kind == "window":  # tokens 73..95: blocks 4 and 5
        assert (needed.first, needed.end) == (4, 6)
    reference = await base.generate([*prompt, 5, 6, 7], 3, use_cache=False)
    assert agrees(reference, again, ATOL)
    # every request gave its chunks back to both groups
    assert all(a.available == a.num_chunks for a in eng.allocators)


@pytest.mark.parametrize("kind", ["window", "state"])
async def test_the_gpu_prefix_cache_holds_only_the_blocks_each_group_needs(kind: str) -> None:
    model = HybridDecoder(TINY, hybrid(kind))
    eng, base = engine(model, prefix_caching=True), engine(model)
    prompt = tokens(97, seed=4)
    first = await eng.generate(prompt, 2)
    again = await eng.generate([*prompt, 9], 2)
    assert again.gpu_hit_tokens == 96 and first.gpu_hit_tokens == 0
    # group 0 holds all six blocks; group 1 only its window (two) or state (one)
    held = eng.allocators[1].hit_chunks
    assert eng.allocators[0].hit_chunks == 6 and held == (2 if kind == "window" else 1)
    assert agrees(await base.generate([*prompt, 9], 2, use_cache=False), again, ATOL)


async def test_a_state_that_fails_to_load_narrows_the_hit_and_the_rest_is_recomputed(
    faulty: str,
) -> None:
    model = HybridDecoder(TINY, STATE)
    prompt = tokens(113, seed=5)  # 7 reusable blocks: a hit of 112 tokens
    planted = await blocks_of(model, prompt)
    keys = engine(model).block_keys(prompt)
    lost = keys[1][6]  # the state at 112: the tier claims it, its load fails
    del planted[lost]
    tier = {"type": faulty, "capacity": "64MiB"}
    eng = engine(model)
    async with TieredCache(chain(eng, tier)) as cache:
        await cache.store(list(planted), torch.stack(list(planted.values())))
        await cache.flush()
        cache.tier(faulty).lie_about = {lost}  # type: ignore[attr-defined]
        eng.attach(cache)
        got = await eng.generate(prompt, 4)
    assert got.load_failures == 1 and got.reused_tokens < 112
    assert agrees(await engine(model).generate(prompt, 4, use_cache=False), got, ATOL)


# -- a wrong restore fails the check -----------------------------------------------------------
@pytest.mark.parametrize("kind", ["window", "state"])
async def test_a_wrong_restore_fails_the_correctness_check(kind: str) -> None:
    model = HybridDecoder(TINY, hybrid(kind))
    prompt, other = tokens(97, seed=6), tokens(97, seed=7)
    mine, theirs = await blocks_of(model, prompt), await blocks_of(model, other)
    keys, their_keys = engine(model).block_keys(prompt), engine(model).block_keys(other)
    reference = await engine(model).generate(prompt, 4, use_cache=False)
    # the right blocks: the whole prefix comes from the chain and the check passes
    right = await served(model, prompt, mine)
    assert right.reused_tokens == 96 and agrees(reference, right, ATOL)
    wrong = dict(mine)
    if kind == "window":  # the last window block of another request under this key
        wrong[keys[1][5]] = theirs[their_keys[1][5]]
    else:  # the state after 80 tokens where the state after 96 belongs
        wrong[keys[1][5]] = mine[keys[1][4]]
    restored = await served(model, prompt, wrong)
    assert restored.reused_tokens == 96  # it was used ...
    assert not agrees(reference, restored, ATOL)  # ... and the check catches it


# -- the demo -----------------------------------------------------------------------------------
def options(hybrid_config: HybridConfig | None, workload: WorkloadConfig) -> DemoOptions:
    return DemoOptions(
        model=TINY,
        workload=workload,
        device="cpu",
        gpu_block_tokens=8,
        block_factor=2,
        primary_capacity=None,
        threaded=False,
        hybrid=hybrid_config,
    )


def memory_chain() -> CacheConfig:
    return parse_config(
        {
            "namespace": "overridden",
            "layout": {"block_bytes": "4KiB", "groups": [{"block_size": 16}]},
            "primary": {"capacity": "256KiB", "pin_memory": False},
            "tiers": [{"type": "memory", "capacity": "64MiB"}],
        }
    )


@pytest.mark.parametrize("kind", ["window", "state"])
async def test_the_three_columns_agree_for_a_hybrid_model(kind: str) -> None:
    workload = WorkloadConfig(users=3, turns=3, system_tokens=64, message_tokens=24, reply_tokens=4)
    report = await run_demo(memory_chain(), options(hybrid(kind), workload))
    corr = report["correctness"]
    assert corr["ok"] and corr["tokens_identical_turns"] == 9
    prefill = report["prefill_tokens"]
    assert prefill["tierkv"] < prefill["gpu_prefix_cache"] < prefill["no_cache"]
    assert report["model"]["hybrid"]["kind"] == kind
    full, other = report["groups"]
    assert full["kind"] == "full" and other["kind"] == (
        "sliding_window" if kind == "window" else "state"
    )
    assert full["blocks_loaded"] > other["blocks_loaded"] > 0
    block_bytes = report["kv_cache"]["block_bytes"]
    assert other["bytes_loaded"] == other["blocks_loaded"] * block_bytes
    assert full["blocks_stored"] == report["stored_blocks"] - other["blocks_stored"]
    if kind == "state":  # two layers of 64 float32 values: padded into the row
        assert other["payload_bytes"] == 2 * 64 * 4 < full["payload_bytes"] == block_bytes


async def test_a_long_sliding_window_conversation_moves_a_fraction_of_full_attentions_bytes() -> (
    None
):
    """The same model size (4 layers x 64 hidden), the same conversation: half the layers
    sliding-window (24 tokens) against all four full attention."""
    workload = WorkloadConfig(users=3, turns=6, system_tokens=32, message_tokens=48, reply_tokens=4)
    windowed = await run_demo(memory_chain(), options(WINDOW, workload))
    full = await run_demo(memory_chain(), options(None, workload))
    assert windowed["correctness"]["ok"] and full["correctness"]["ok"]
    (only,) = full["groups"]
    attention, window = windowed["groups"]
    # each tier hit loads at most the 2 blocks of the window, whatever the conversation
    hits = sum(1 for t in windowed["turns"] if t["reused_tokens"])
    assert hits >= 6 and window["blocks_loaded"] <= 2 * hits
    assert window["bytes_loaded"] < attention["bytes_loaded"] / 2
    # against the full-attention model of the same size: its block is both groups' rows
    assert only["bytes_loaded"] == pytest.approx(2 * attention["bytes_loaded"], rel=0.25)
    loaded = attention["bytes_loaded"] + window["bytes_loaded"]
    assert loaded < 0.75 * only["bytes_loaded"]
