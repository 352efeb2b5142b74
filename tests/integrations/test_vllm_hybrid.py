"""Hybrid models under vLLM's REAL tiering manager (issue 22, item 5).

vLLM's offloading API describes each KV group by tokens per block and
`sliding_window_size_in_chunks` (None: full attention; a window in chunks for sliding
windows and chunked local attention; 1 for a Mamba state) and applies the hit rule
itself. The adapter must serve every such group's chunks by key, keep models with
different windows apart, state each group truly in the layout it validates against,
and refuse a group it does not know with a message that says what to do.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from tierkv.contract.errors import ConfigError
from tierkv.hits import combine_group_hits
from tierkv.integrations.vllm import VllmGeometry
from tierkv.layout import KVLayout

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# full attention, a sliding window of 2 chunks, a Mamba state (1 chunk), 16 tokens each
HYBRID = ((16, None), (16, 2), (16, 1))


def nvme(path: Path) -> dict[str, Any]:
    return {"type": "nvme", "path": str(path), "capacity": "4MiB"}


def group_keys(n: int, group: int, salt: str = "") -> list[bytes]:
    from vllm.v1.kv_offload.base import make_offload_key

    hashes = [hashlib.sha256(f"{salt}{i}".encode()).digest()[:16] for i in range(n)]
    return [make_offload_key(h, group) for h in hashes]


def test_every_group_kind_is_stored_and_read_back_by_a_later_engine(
    vllm: Any, tmp_path: Path
) -> None:
    """Chunks of a full, a window and a state group, as vLLM's scheduler stores them
    (all of the full group, the window's chunks, the state's), go down to nvme and come
    back byte for byte into another engine of the same model."""
    full, window, state = group_keys(6, 0), group_keys(6, 1)[-2:], group_keys(6, 2)[-1:]
    writer = vllm.engine([vllm.entry(nvme(tmp_path))], groups=HYBRID)
    ctx = writer.new_request()
    for keys in (full, window, state):
        assert writer.store(ctx, keys) == keys
    writer.finish(ctx)
    writer.settle()
    writer.shutdown()  # one nvme tier per directory at a time

    reader = vllm.engine([vllm.entry(nvme(tmp_path))], groups=HYBRID)
    assert reader.tiers[0].namespace == writer.tiers[0].namespace
    ctx = reader.new_request()
    for keys in (full, window, state):
        assert reader.promote(ctx, keys) == len(keys)
        assert reader.read(ctx, keys) == [vllm.payload(k) for k in keys]
    # a window chunk vLLM never stored (outside the window) is a miss, not another's bytes
    assert reader.promote(ctx, group_keys(6, 1)[:1]) == 0


def test_models_that_differ_only_in_a_window_never_share_blocks(vllm: Any, tmp_path: Path) -> None:
    keys = group_keys(2, 1)
    writer = vllm.engine([vllm.entry(nvme(tmp_path))], groups=HYBRID)
    ctx = writer.new_request()
    writer.store(ctx, keys)
    writer.finish(ctx)
    writer.settle()
    writer.shutdown()
    wider = ((16, None), (16, 4), (16, 1))
    other = vllm.engine([vllm.entry(nvme(tmp_path))], groups=wider)
    assert other.tiers[0].namespace != writer.tiers[0].namespace
    assert other.promote(other.new_request(), keys) == 0


def geometry(windows: list[int | None], blocks_per_chunk: int = 1) -> VllmGeometry:
    return VllmGeometry(
        "m",
        "bfloat16",
        (16,) * len(windows),
        blocks_per_chunk,
        16,
        1 << 20,
        {"tp_size": 1},
        {"sliding_windows": windows},
        tuple(f"group {g} (l{g})" for g in range(len(windows))),
    )


@pytest.mark.parametrize("blocks_per_chunk", [1, 4])
def test_the_layout_states_each_group_as_vllm_applies_it(blocks_per_chunk: int) -> None:
    """A window of `w` chunks reads as a tierkv sliding window needing exactly the `w`
    chunks before a hit, a Mamba group (1 chunk) as needing the chunk ending there."""
    groups = geometry([None, 2, 1], blocks_per_chunk).layout_groups()
    chunk = 16 * blocks_per_chunk
    assert groups == [
        {"kind": "full", "block_size": chunk},
        {"kind": "sliding_window", "block_size": chunk, "window": 2 * chunk + 1},
        {"kind": "sliding_window", "block_size": chunk, "window": chunk + 1},
    ]
    layout = KVLayout(block_bytes=1 << 20, groups=groups)  # type: ignore[arg-type]
    tokens, ranges = combine_group_hits(layout.groups, [[True] * 6] * 3)
    assert tokens == 6 * chunk
    assert [(r.first, r.end) for r in ranges] == [(0, 6), (4, 6), (5, 6)]


@pytest.mark.parametrize("window", [0, -1, 1.5, "2"])
def test_a_group_kind_the_adapter_does_not_know_is_refused(vllm: Any, window: Any) -> None:
    with pytest.raises(ConfigError) as info:
        vllm.engine([vllm.entry({"type": "memory"})], groups=((16, None), (16, window)))
    (problem,) = info.value.problems
    assert problem.startswith(
        f"secondary_tiers[0]: vLLM's KV group 1 (l1) has sliding_window_size_in_chunks="
        f"{window!r}, a group kind tierkv cannot serve"
    )
    assert "drop the tierkv entries" in problem


def test_a_chain_entry_is_refused_for_such_a_group_too(tmp_path: Path) -> None:
    from tierkv.integrations.vllm import resolve_entry

    chain = tmp_path / "chain.yaml"
    chain.write_text(
        "namespace: t\nlayout: {block_bytes: 1MiB, groups: [{block_size: 16}]}\n"
        "primary: {capacity: 1MiB}\ntiers: [{type: memory}]\n"
    )
    with pytest.raises(ConfigError, match="sliding_window_size_in_chunks=0"):
        resolve_entry({"chain": str(chain)}, geometry([None, 0]), where="secondary_tiers[2]")
