"""Bytes a long conversation moves per KV group, full attention against hybrid layouts.

    python examples/hybrid_conversation.py                    # 8 turns of 1,024 tokens
    python examples/hybrid_conversation.py --turns 16 --window 4096 --checkpoint-every 2048

A server embeds a `TieredCache` (primary + a `memory` tier) and plays one conversation:
each turn's prompt is everything so far; it looks the prompt up, loads the hit, and
stores the blocks it computed, saying where each sits in its group (`positions`), so
a store keeps only the blocks a hit at a checkpoint can use (`tierkv.retention`). The
same model size is run three ways: two full-attention groups; full + sliding window;
full + recurrent state. Every block is one `block_bytes` row in every group, so bytes
per group compare directly. Prints one line per layout and group: blocks and bytes
stored (into the primary, then the tier) and loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from tierkv import TieredCache, hash_token_blocks, make_offload_key, parse_config
from tierkv.contract.keys import OffloadKey, get_offload_group_idx


def layouts(block: int, window: int) -> dict[str, list[dict[str, Any]]]:
    full = {"kind": "full", "block_size": block}
    return {
        "full+full": [full, full],
        "full+sliding_window": [
            full,
            {"kind": "sliding_window", "block_size": block, "window": window},
        ],
        "full+state": [full, {"kind": "state", "block_size": block}],
    }


async def conversation(
    groups: list[dict[str, Any]], args: argparse.Namespace
) -> list[dict[str, int]]:
    """Play the conversation; per group: blocks stored, skipped and loaded."""
    config = parse_config(
        {
            "namespace": "hybrid-example",
            "layout": {
                "block_bytes": args.block_bytes,
                "groups": groups,
                "checkpoint_every": args.checkpoint_every,
            },
            "primary": {"capacity": 64 * args.block_bytes, "pin_memory": False},
            "tiers": [{"type": "memory"}],
        }
    )
    counts = [{"stored": 0, "skipped": 0, "loaded": 0} for _ in groups]
    row = bytes(args.block_bytes)
    async with TieredCache(config) as cache:
        for turn in range(1, args.turns + 1):
            prompt = list(range(turn * args.turn_tokens))
            keys = [
                [
                    make_offload_key(h, g)
                    for h in hash_token_blocks(prompt, spec.block_size, namespace="c")
                ]
                for g, spec in enumerate(config.layout.groups)
            ]
            hit = await cache.lookup(keys)
            loaded = await cache.load(hit.keys_to_load, [bytearray(row) for _ in hit.keys_to_load])
            for key in loaded.ok_keys:
                counts[get_offload_group_idx(key)]["loaded"] += 1
            # the blocks the server computed: everything past the hit, in every group
            new: list[OffloadKey] = []
            positions: list[int] = []
            for g, spec in enumerate(config.layout.groups):
                first = hit.hit_tokens // spec.block_size
                new.extend(keys[g][first:])
                positions.extend(range(first, len(keys[g])))
            stored = await cache.store(new, [row] * len(new), positions=positions)
            for key in stored.stored:
                counts[get_offload_group_idx(key)]["stored"] += 1
            for key in stored.skipped:
                counts[get_offload_group_idx(key)]["skipped"] += 1
            await cache.flush()
    return counts


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--turn-tokens", type=int, default=1024)
    parser.add_argument("--block", type=int, default=16, help="tokens per block")
    parser.add_argument("--window", type=int, default=512, help="sliding window, tokens")
    parser.add_argument("--checkpoint-every", type=int, default=1024)
    parser.add_argument("--block-bytes", type=int, default=64 << 10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = {
        name: await conversation(groups, args)
        for name, groups in layouts(args.block, args.window).items()
    }
    if args.json:
        print(json.dumps(results))
        return
    mib = args.block_bytes / 2**20
    for name, groups in results.items():
        for g, c in enumerate(groups):
            stored, loaded = c["stored"], c["loaded"]
            print(
                f"{name:20} group {g}: stored {stored:5} blocks ({stored * mib:7.1f} MiB), "
                f"skipped {c['skipped']:5}, loaded {loaded:5} blocks ({loaded * mib:7.1f} MiB)"
            )


if __name__ == "__main__":
    asyncio.run(main())
