"""The demo: the model's paged KV cache, the workload, the engine through tierkv, and
the whole run with and without tierkv agreeing (tiny sizes, a few seconds)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tierkv.cache import TieredCache
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
from tierkv.demo.records import TurnRecord
from tierkv.demo.report import demo_summary
from tierkv.demo.run_report import _by_column

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
    # every request gave its blocks back (no prefix caching: all free again)
    assert engine.chunks.available == engine.chunks.num_chunks == 12


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
    for column in ("gpu_prefix_cache", "tierkv"):
        seen = corr["by_column"][column]
        assert seen["tokens_identical_turns"] == 9 and seen["first_differing_turn"] is None
    assert not any(line.startswith("  GPU prefix cache") for line in _lines(report))
    # had the tierkv column gone wrong at one turn, the summary would name it and where
    records = [TurnRecord(**turn) for turn in report["turns"]]
    records[4].column_match["tierkv"], records[4].column_diff["tierkv"] = False, 3.5
    corr.update(ok=False, by_column=_by_column(records))
    lines = _lines(report)
    assert any(line.startswith("  GPU prefix cache: identical in 9/9 turns,") for line in lines)
    assert (
        f"  GPU prefix cache + tierkv: identical in 8/9 turns, max |logit difference| 3.50e+00, "
        f"first differs at user {records[4].user} turn {records[4].index + 1}"
    ) in lines
    tiers = report["tiers"]
    assert set(tiers) == {"cpu", "nvme"}
    # blocks really left the primary and came back from the disk
    assert tiers["nvme"]["blocks_served"] > 0 and tiers["nvme"]["bytes_out"] > 0
    assert tiers["cpu"]["blocks_served"] > 0
    assert tiers["nvme"]["bytes_in"] == report["stored_blocks"] * report["kv_cache"]["block_bytes"]
    # three columns, each computing less than the one before
    assert report["columns"] == ["no_cache", "gpu_prefix_cache", "tierkv"]
    prefill = report["prefill_tokens"]
    assert prefill["tierkv"] < prefill["gpu_prefix_cache"] < prefill["no_cache"]
    # the GPU prefix cache is bounded by the KV blocks: it evicted, and served less
    gpu = report["gpu_prefix_cache"]
    assert gpu["gpu_prefix_cache"]["evicted_blocks"] > 0
    assert gpu["gpu_prefix_cache"]["capacity_blocks"] == gpu["tierkv"]["capacity_blocks"]
    served = sum(t["blocks_served"] for t in tiers.values())
    assert served / report["reusable_blocks"] == pytest.approx(
        sum(t["hit_rate"] for t in tiers.values())
    )
    shares = report["gpu_hit_rate"] + sum(t["hit_rate"] for t in tiers.values())
    assert shares + report["recomputed_block_rate"] == pytest.approx(1.0)
    for column in report["columns"]:
        assert report["ttft"][column]["mean_ms"] > 0
    assert report["ttft"]["speedup"] > 0
    assert all(set(t["ttft"]) == set(report["columns"]) for t in report["turns"])
    assert report["chain"]["namespace"].startswith("tierkv-demo-")


# -- the GPU prefix cache, the sizing, the plot ------------------------------------------------
def test_chunk_allocator_keeps_finished_blocks_until_room_is_needed() -> None:
    from tierkv.demo.prefix_cache import ChunkAllocator

    alloc = ChunkAllocator(4, 2, prefix_caching=True)
    keys = [b"a", b"b", b"c"]
    first = alloc.allocate(3)
    assert alloc.blocks(first[:1]) == [first[0] * 2, first[0] * 2 + 1]
    alloc.release(first, keys[:2])  # two full blocks cached, the third chunk freed
    assert alloc.cached == 2 and alloc.available == 4
    hit = alloc.match(keys)  # the longest cached prefix: a, b
    assert hit == first[:2] and alloc.available == 2  # held: not evictable
    alloc.release(hit, keys[:2])
    # needing all four chunks evicts the cached ones, least recently used first
    alloc.allocate(4)
    assert alloc.cached == 0 and alloc.evicted_chunks == 2
    plain = ChunkAllocator(2, 2, prefix_caching=False)
    chunks = plain.allocate(2)
    plain.release(chunks, [b"a", b"b"])
    assert plain.match([b"a"]) == [] and plain.available == 2


def test_cuda_profile_is_about_a_billion_parameters_and_fits_the_memory() -> None:
    from tierkv.demo.sizing import (
        CPU_PROFILE,
        CUDA_PROFILE,
        gpu_memory_needed,
        parameters,
        profile_for,
    )

    assert parameters(CPU_PROFILE.model) == sum(
        p.numel() for p in TinyDecoder(CPU_PROFILE.model).parameters()
    )
    assert 0.9e9 < parameters(CUDA_PROFILE.model) < 1.1e9
    assert CUDA_PROFILE.model.dtype == "bfloat16" and CUDA_PROFILE.workload.system_tokens >= 2048
    assert profile_for("cpu", free_bytes=1 << 40) is CPU_PROFILE
    assert profile_for("cuda", free_bytes=80 << 30) == CUDA_PROFILE  # an H100 takes it whole
    small = profile_for("cuda", free_bytes=6 << 30)  # a small GPU: fewer layers
    assert small.model.layers < CUDA_PROFILE.model.layers
    assert gpu_memory_needed(small, 16) <= 0.7 * (6 << 30)


def test_plot_draws_the_three_columns(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from tierkv.demo.plot import plot_ttft

    turns = [{"ttft": {"no_cache": 0.2, "gpu_prefix_cache": 0.1, "tierkv": 0.05}} for _ in range(4)]
    report = {
        "columns": ["no_cache", "gpu_prefix_cache", "tierkv"],
        "turns": turns,
        "model": {"parameters": 4.7e6, "device": "cpu"},
        "workload": {"users": 2, "turns": 2, "system_tokens": 64},
    }
    out = plot_ttft(report, tmp_path / "ttft.png")
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000


def test_plain_tables_without_rich() -> None:
    import io

    from tierkv.demo.report import TextTable, render

    out = io.StringIO()
    render(
        ["head", TextTable(["name", "n"], [["a", "1"], ["bbb", "22"]], title="t")],
        out,
        use_rich=False,
    )
    assert out.getvalue() == "head\nt\nname   n\na      1\nbbb   22\n"


# -- where the demo's tiers keep their files (tierkv.demo.scratch) -----------------------------
def test_every_tier_path_moves_into_the_scratch_directory(tmp_path: Path) -> None:
    from tierkv.demo.scratch import in_scratch, path_fields, tier_paths
    from tierkv.tier import TierConfig

    class TwoFiles(TierConfig):
        """A plugin's config with a Path and a string path, and a string that is not one."""

        path: Path
        index_file: str
        url: str = "redis://somewhere/0"

    config = parse_config(
        {
            "namespace": "t",
            "layout": {"block_bytes": "4KiB", "groups": [{"block_size": 16}]},
            "primary": {"capacity": "1MiB", "pin_memory": False},
            "tiers": [
                {"type": "nvme", "path": "/srv/kv/nvme", "capacity": "1GiB"},
                {"type": "nvme", "name": "disk2", "path": "/srv/kv2", "capacity": "1GiB"},
                {"type": "memory"},
            ],
        }
    )
    plugin = TwoFiles(type="two", path=Path("/var/db/blocks.db"), index_file="/var/db/index")
    config = config.model_copy(update={"tiers": [*config.tiers, plugin]})
    assert path_fields(plugin) == {
        "path": Path("/var/db/blocks.db"),
        "index_file": Path("/var/db/index"),
    }

    moved = in_scratch(config, tmp_path)
    assert tier_paths(moved) == {
        "nvme": [str(tmp_path / "nvme" / "nvme")],
        "disk2": [str(tmp_path / "disk2" / "kv2")],
        "two": [
            str(tmp_path / "two" / "path" / "blocks.db"),
            str(tmp_path / "two" / "index_file" / "index"),
        ],
    }
    assert isinstance(moved.tiers[3].index_file, str)  # type: ignore[attr-defined]
    assert moved.tiers[2] == config.tiers[2] and moved.tiers[3].url == plugin.url  # type: ignore[attr-defined]
    assert tier_paths(config)["nvme"] == ["/srv/kv/nvme"]  # the original is unchanged


def test_the_summary_says_when_blocks_came_from_an_earlier_run() -> None:
    from tierkv.demo.report import _earlier_run

    assert _earlier_run({"blocks_at_start": {"nvme": 0}, "served_blocks": 0}) == []
    assert _earlier_run({"blocks_at_start": {"nvme": 68, "memory": 0}, "served_blocks": 60}) == [
        "68 blocks found from an earlier run (nvme 68); 60 blocks served came from it, so the "
        "shares are not a fresh run's"
    ]
    # a server tier (redis) does not say what it holds: the blocks served still show it
    assert _earlier_run({"blocks_at_start": {}, "served_blocks": 5}) == [
        "5 blocks served came from an earlier run, so the shares are not a fresh run's"
    ]


def _lines(report: dict[str, Any]) -> list[str]:
    return [b for b in demo_summary(report) if isinstance(b, str)]
