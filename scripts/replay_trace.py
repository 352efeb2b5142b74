"""Replay a real request trace one request at a time and count hit blocks that a load
shed: with no contention at all, a block the lookup reported must come back.

    .venv/bin/python scripts/replay_trace.py [--primary-share 0.005] [--block-kib 64]

Trace: `../shared/traces/mooncake_synthetic_trace.jsonl` (3,993 requests, 43,924
distinct 512-token blocks). A block's key chains the request's `hash_ids` up to it,
so equal prefixes give equal keys. Chain: a primary of `--primary-share` of the
distinct blocks (0.5 %: 220 blocks) over an nvme tier that holds them all. Each
request, strictly after the previous one returned: `lookup`, `load` the hit into a
host tensor and check every byte, `store` the blocks the hit lacked right away (as a
server does once prefill ends; the store's cascade to nvme still runs when the next
request arrives). Prints hit, loaded, shed and wrong blocks; exits non-zero on a
wrong byte, an exception, or a leaked slot. Not a CI test (minutes).

`--nvme-share 0.27` makes the nvme tier hold only that share of the distinct blocks
(its own LRU evicts the rest), and the replay then also counts `claimed_failed`:
blocks the lookup reported in nvme whose load failed (a cascade's eviction ran between
lookup and load; claims, `claim_lease`, keep them). `--claim-lease 0` turns claims off.
`--no-request-ids` calls `lookup` and `load` without a `ReqContext`, as a server that
passes none does: a lookup's hit must be kept all the same.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import anyio
import numpy as np
import torch

from tierkv.cache import TieredCache
from tierkv.config import parse_config
from tierkv.contract.framing import header_bytes
from tierkv.contract.jobs import ReqContext
from tierkv.contract.keys import OffloadKey, hash_token_blocks, make_offload_key

TRACE = (
    Path(__file__).resolve().parent.parent.parent / "shared/traces/mooncake_synthetic_trace.jsonl"
)


def read_trace(path: Path, limit: int | None) -> list[list[OffloadKey]]:
    """Each request's block keys: hash_ids chained, so a key names its whole prefix."""
    requests = []
    with path.open() as f:
        for line in f:
            ids = json.loads(line)["hash_ids"]
            hashes = hash_token_blocks(ids, 1, namespace="mooncake")
            requests.append([make_offload_key(h, 0) for h in hashes])
            if limit is not None and len(requests) >= limit:
                break
    return requests


def pattern(key: OffloadKey, block_bytes: int) -> torch.Tensor:
    """The bytes of `key`'s block (the key repeated): a block served for the wrong key
    or half written is caught."""
    return torch.from_numpy(np.resize(np.frombuffer(key, dtype=np.uint8), block_bytes))


async def run(args: argparse.Namespace) -> int:
    requests = read_trace(Path(args.trace), args.requests)
    distinct = len({k for r in requests for k in r})
    block_bytes = args.block_kib << 10
    primary_blocks = max(1, math.ceil(args.primary_share * distinct))
    workdir = Path(tempfile.mkdtemp(prefix="tierkv-replay-"))
    nvme_capacity = (distinct + 1) * block_bytes * 2
    if args.nvme_share is not None:  # the tier's own capacity, in its disk footprint
        fs_block = os.statvfs(workdir).f_frsize or 4096
        frame = header_bytes(requests[0][0]) + block_bytes
        nvme_blocks = max(1, math.ceil(args.nvme_share * distinct))
        nvme_capacity = nvme_blocks * -(-frame // fs_block) * fs_block
    lease = {} if args.claim_lease is None else {"claim_lease": args.claim_lease}
    config = parse_config(
        {
            "namespace": "replay",
            "layout": {"block_bytes": block_bytes, "groups": [{"block_size": 512}]},
            "primary": {"capacity": primary_blocks * block_bytes, "pin_memory": False},
            **({"promotion_wait": args.promotion_wait} if args.promotion_wait else {}),
            "tiers": [
                {
                    "type": "nvme",
                    "path": str(workdir / "nvme"),
                    "capacity": nvme_capacity,
                    "fsync": "never",
                    **lease,
                }
            ],
        }
    )
    counts: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    errors: list[str] = []
    started = time.monotonic()
    async with TieredCache(config) as cache:
        for n, keys in enumerate(requests):
            ctx = None if args.no_request_ids else ReqContext(request_id=f"r{n}")
            try:
                hit = await cache.lookup([keys], ctx)
                load = list(hit.keys_to_load)
                counts["blocks_asked"] += len(keys)
                counts["blocks_hit"] += len(load)
                if load:
                    out = torch.empty(len(load), block_bytes, dtype=torch.uint8)
                    result = await cache.load(load, out, ctx)
                    counts["blocks_loaded"] += len(result.ok_keys)
                    counts["blocks_shed"] += len(result.failed_keys)
                    for key in result.failed_keys:
                        reasons[result.errors[key][:70]] += 1
                        if hit.locations[key] == "nvme":  # lookup reported it there
                            counts["claimed_failed"] += 1
                    ok = set(result.ok_keys)
                    for j, key in enumerate(load):
                        if key in ok and not torch.equal(out[j], pattern(key, block_bytes)):
                            counts["blocks_wrong"] += 1
                rest = keys[len(load) :]
                if rest:
                    src = torch.stack([pattern(k, block_bytes) for k in rest])
                    stored = await cache.store(rest, src)
                    counts["blocks_stored"] += len(stored.stored)
                    counts["blocks_rejected"] += len(stored.rejected)
            except Exception as exc:  # nothing a tier does may raise out of the cache
                errors.append(f"{type(exc).__name__}: {exc}")
            if args.progress and (n + 1) % 500 == 0:
                print(f"[{time.monotonic() - started:6.1f}s] {n + 1} requests {dict(counts)}")
        await cache.flush()
        stats = cache.stats().tiers
        p = cache.primary
        leaked = p.num_blocks - p.num_free - p.num_evictable
    elapsed = time.monotonic() - started
    hit = counts["blocks_hit"] or 1
    print(
        f"{len(requests)} requests, {distinct:,} distinct blocks, primary {primary_blocks} "
        f"blocks of {args.block_kib} KiB over nvme, promotion_wait "
        f"{getattr(config, 'promotion_wait', 'n/a')}, "
        f"request ids {'no' if args.no_request_ids else 'yes'}, {elapsed:.1f} s"
    )
    print("counts:", dict(counts))
    print(
        f"hit share of asked blocks: {counts['blocks_hit'] / (counts['blocks_asked'] or 1):.1%}; "
        f"shed share of hit blocks: {counts['blocks_shed'] / hit:.2%} ({counts['blocks_shed']})"
    )
    print("shed by reason:", dict(reasons.most_common(5)))
    print(
        f"wrong blocks: {counts['blocks_wrong']}; exceptions: {len(errors)}; leaked slots: {leaked}"
    )
    for line in Counter(errors).most_common(3):
        print("  exception:", line)
    nvme = stats["nvme"]
    print(
        f"nvme: claimed_failed {counts['claimed_failed']}, protected "
        f"{nvme.get('protected', 'n/a')}, lease_expired {nvme.get('lease_expired', 'n/a')}, "
        f"blocks_stored {nvme['blocks_stored']}, failed_keys {nvme['failed_keys']}"
    )
    return 1 if counts["blocks_wrong"] or errors or leaked else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(TRACE))
    parser.add_argument("--requests", type=int, default=None, help="replay only the first N")
    parser.add_argument("--primary-share", type=float, default=0.005)
    parser.add_argument("--block-kib", type=int, default=64)
    parser.add_argument(
        "--promotion-wait",
        default=None,
        help="how long a load may wait for room (default: the config's)",
    )
    parser.add_argument(
        "--nvme-share",
        type=float,
        default=None,
        help="nvme capacity as a share of the distinct blocks (default: all of them)",
    )
    parser.add_argument(
        "--claim-lease", type=float, default=None, help="the nvme tier's claim_lease"
    )
    parser.add_argument(
        "--no-request-ids",
        action="store_true",
        help="lookups and loads without a ReqContext (claims taken per lookup)",
    )
    parser.add_argument("--progress", action="store_true")
    args = parser.parse_args()
    sys.exit(anyio.run(run, args))


if __name__ == "__main__":
    main()
