"""The demo: the model's paged KV cache, the workload, the engine through tierkv, and
the whole run with and without tierkv agreeing (tiny sizes, a few seconds)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tierkv.config import parse_config
from tierkv.demo import (
    ChatWorkload,
    DemoOptions,
    ModelConfig,
    PagedKVCache,
    TinyDecoder,
    WorkloadConfig,
    build_engine,
    run_demo,
)
from tierkv.orchestrator import TieredCache

pytestmark = pytest.mark.anyio

TINY = ModelConfig(vocab=512, hidden=64, layers=2, heads=2, seed=3)


def chain(tmp_path: Path | None = None, primary: str = "1MiB") -> Any:
    tier = (
        {"type": "nvme", "path": str(tmp_path / "nvme"), "capacity": "64MiB", "fsync": "never"}
        if tmp_path is not None
        else {"type": "memory", "capacity": "64MiB"}
    )
    return parse_config(
        {
            "namespace": "overridden-by-the-demo",
            "layout": {"block_bytes": "4KiB", "groups": [{"block_size": 16}]},
            "primary": {"capacity": primary, "pin_memory": False},
            "tiers": [tier],
        }
    )


def test_prefill_against_a_paged_prefix_matches_the_full_prefill() -> None:
    model = TinyDecoder(TINY)
    kv = PagedKVCache(TINY, 16, 8, model.device)
    tokens = torch.randint(0, TINY.vocab, (40,), generator=torch.Generator().manual_seed(0))
    prompt = tokens.tolist()
    whole = model(prompt, 0, kv.allocate(5), kv)
    # the same prompt in two parts, in scattered blocks: the suffix attends to the
    # prefix through the block table
    table = [9, 2, 14, 7, 11]
    model(prompt[:24], 0, table, kv)
    split = model(prompt[24:], 24, table, kv)
    assert torch.allclose(whole, split, atol=1e-4)
    assert whole.std() > 1  # peaked logits: greedy choices are not near-ties


def test_model_checks_its_shape() -> None:
    with pytest.raises(ValueError, match="must split into 3 heads"):
        ModelConfig(hidden=64, heads=3)
    model = TinyDecoder(TINY)
    kv = PagedKVCache(TINY, 4, 8, model.device)
    with pytest.raises(ValueError, match="do not fit 1 blocks of 8"):
        model(list(range(9)), 0, [0], kv)
    with pytest.raises(RuntimeError, match="4 free blocks of 4; a request needs 5"):
        kv.allocate(5)


def test_workload_turns_extend_each_users_conversation() -> None:
    wl = ChatWorkload(
        WorkloadConfig(users=2, turns=2, system_tokens=8, message_tokens=4, reply_tokens=2),
        vocab=100,
    )
    seen = []
    for turn in wl.turns():
        seen.append(turn)
        wl.reply(turn, [7, 7])
    assert [(t.user, t.index) for t in seen] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert seen[0].prompt[:8] == seen[1].prompt[:8]  # the shared system prompt
    assert seen[2].prompt[: len(seen[0].prompt)] == seen[0].prompt  # a turn extends the last
    assert seen[2].prompt[len(seen[0].prompt) : len(seen[0].prompt) + 2] == [7, 7]
    assert len(seen[3].prompt) == wl.config.longest_prompt


async def test_engine_reuses_blocks_from_the_tier_below_the_primary() -> None:
    engine = build_engine(TINY, device="cpu", gpu_blocks=24, block_factor=2, threaded=False)
    primary = f"{4 * int(engine.layout.block_bytes)}B"  # 4 slots
    config = chain(primary=primary).model_copy(
        update={"layout": engine.layout, "namespace": engine.namespace, "promotion_reserve": 1.0}
    )
    prompt = list(range(0, 97))  # 97 tokens: 3 offloaded blocks of 32 are reusable
    async with TieredCache(config) as cache:
        engine.attach(cache)
        first = await engine.generate(prompt, 3)
        assert first.reused_tokens == 0 and first.stored_blocks == 3
        await cache.flush()
        # other requests push the prompt's blocks out of the primary (4 slots)
        for offset in (200, 400):
            await engine.generate(list(range(offset, offset + 97)), 3)
            await cache.flush()
        second = await engine.generate(prompt, 3)
        baseline = await engine.generate(prompt, 3, use_cache=False)
    assert second.reused_tokens == 96 and second.sources.get("memory", 0) > 0
    assert second.tokens == first.tokens == baseline.tokens
    for a, b in zip(second.logits, baseline.logits):
        assert torch.allclose(a, b, atol=1e-4)
    assert engine.kv.num_free == 24  # every request gave its blocks back


async def test_demo_runs_agree_with_and_without_tierkv(tmp_path: Path) -> None:
    options = DemoOptions(
        model=TINY,
        workload=WorkloadConfig(
            users=3, turns=3, system_tokens=64, message_tokens=24, reply_tokens=4
        ),
        device="cpu",
        gpu_block_tokens=8,
        block_factor=2,
        primary_capacity=8 * 16384,  # 8 blocks of 16 KiB: far less than the working set
        threaded=False,
    )
    turns: list[Any] = []
    report = await run_demo(chain(tmp_path), options, on_turn=turns.append)
    assert len(turns) == 9
    corr = report["correctness"]
    assert corr["ok"] and corr["tokens_identical_turns"] == 9
    assert corr["max_logit_diff"] <= corr["atol"] == 1e-3
    tiers = report["tiers"]
    assert set(tiers) == {"cpu", "nvme"}
    # blocks really left the primary and came back from the disk
    assert tiers["nvme"]["blocks_served"] > 0 and tiers["nvme"]["bytes_out"] > 0
    assert tiers["cpu"]["blocks_served"] > 0
    assert tiers["nvme"]["bytes_in"] == report["stored_blocks"] * report["kv_cache"]["block_bytes"]
    assert report["prefill_tokens"]["with"] < report["prefill_tokens"]["without"]
    served = sum(t["blocks_served"] for t in tiers.values())
    assert served / report["reusable_blocks"] == pytest.approx(
        sum(t["hit_rate"] for t in tiers.values())
    )
    assert report["ttft"]["with"]["mean_ms"] > 0 and report["ttft"]["speedup"] > 0
    assert report["chain"]["namespace"].startswith("tierkv-demo-")
