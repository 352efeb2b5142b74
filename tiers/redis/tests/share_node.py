"""One inference server of the sharing test, run as its own process.

    python share_node.py store URL NAMESPACE WORKDIR   # blocks.bin -> cache -> redis
    python share_node.py load  URL NAMESPACE WORKDIR   # lookup, then redis -> cache -> file

WORKDIR holds block_bytes.txt, keys.txt (one hex key a line, in prefix order) and, for
`store`, blocks.bin (the blocks back to back). The node is a `TieredCache` over a chain
of one redis tier, built from a YAML-shaped config, the way an embedding server
builds it: the `redis` entry point, the orchestrator's cascade and its promotion all
run in a fresh interpreter. It prints one JSON line: what it saw.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio

from tierkv import TieredCache, parse_config

BLOCK_TOKENS = 16


def make_cache(url: str, namespace: str, num_blocks: int, block_bytes: int) -> TieredCache:
    config = parse_config(
        {
            "namespace": namespace,
            "layout": {
                "block_bytes": block_bytes,
                "groups": [{"kind": "full", "block_size": BLOCK_TOKENS}],
            },
            "primary": {"capacity": 2 * num_blocks * block_bytes, "pin_memory": False},
            "tiers": [{"type": "redis", "url": url, "write_policy": "write_through"}],
        }
    )
    return TieredCache(config)


async def store_blocks(cache: TieredCache, keys: list[bytes], blob: bytes) -> dict[str, Any]:
    size = cache.block_bytes
    blocks = [blob[i * size : (i + 1) * size] for i in range(len(keys))]
    result = await cache.store(keys, blocks)
    await cache.flush()  # the cascade to redis has finished
    return {"stored": len(result.stored), "error": result.error}


async def load_blocks(cache: TieredCache, keys: list[bytes], out: Path) -> dict[str, Any]:
    found = await cache.lookup([keys])
    destination = [bytearray(cache.block_bytes) for _ in keys]
    result = await cache.load(keys, destination)
    out.write_bytes(b"".join(destination))
    return {
        "hit_blocks": found.hit_tokens // BLOCK_TOKENS,
        "ok": len(result.ok_keys),
        "failed": len(result.failed_keys),
        "sources": sorted(set(result.sources.values())),
    }


async def main(argv: list[str]) -> dict[str, Any]:
    mode, url, namespace, workdir = argv
    work = Path(workdir)
    keys = [bytes.fromhex(line) for line in (work / "keys.txt").read_text().split()]
    size = int((work / "block_bytes.txt").read_text())
    async with make_cache(url, namespace, len(keys), size) as cache:
        if mode == "store":
            return await store_blocks(cache, keys, (work / "blocks.bin").read_bytes())
        if mode == "load":
            return await load_blocks(cache, keys, work / f"loaded-{namespace}.bin")
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    print(json.dumps(anyio.run(main, sys.argv[1:])))
