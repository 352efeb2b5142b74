"""The smallest complete custom tier, registered without packaging (for experiments).

    python examples/custom_tier.py

`DictTier` keeps framed blocks in a dict: it implements the whole contract of
`tierkv.tier.SecondaryTierManager` (lookup, store, load, remove, per-key partial
success, checked frames, removals reported) in about forty lines. `tierkv.register_tier` makes
`type: dict` usable in a chain in this process; the script then pushes blocks out of
a tiny primary and reads them back through the new tier.

To ship a tier, package it and register an entry point instead, so every process
(and `tierkv plugins`, `tierkv bench`) finds it:

    [project.entry-points."tierkv.tiers"]
    dict = "my_package:DictTier"

`plugins/tierkv-sqlite/` in this repository is a complete packaged example, with
the conformance suite (`tierkv.testing.TierConformanceSuite`) run in its tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch

from tierkv import (
    CorruptBlock,
    JobMetadata,
    JobResult,
    OffloadKey,
    ReqContext,
    TieredCache,
    hash_token_blocks,
    make_offload_key,
    parse_config,
    register_tier,
)
from tierkv.tier import SecondaryTierManager, TierConfig


class DictTierConfig(TierConfig):
    max_blocks: int = 1024  # a field of this tier's own YAML section


@register_tier
class DictTier(SecondaryTierManager):
    Config = DictTierConfig
    config: DictTierConfig

    def __init__(self, config: TierConfig, primary) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, primary)
        self.frames: dict[OffloadKey, bytes] = {}

    @staticmethod
    def get_tier_type() -> str:
        return "dict"

    async def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[bool]:
        return [key in self.frames for key in keys]

    async def store(self, job: JobMetadata) -> JobResult:
        failed = {}
        for key, slot in zip(job.keys, job.slots):
            if len(self.frames) >= self.config.max_blocks and key not in self.frames:
                failed[key] = f"dict tier is full ({self.config.max_blocks} blocks)"
                continue
            # a frame: header (version, namespace, key, length, checksum, and a MAC
            # when the tier's mac_key_env is set) + payload
            self.frames[key] = self.framer.encode(key, self.primary.block(slot))
        return JobResult.partial(job, failed)

    async def load(self, job: JobMetadata) -> JobResult:
        failed = {}
        for key, slot in zip(job.keys, job.slots):
            frame = self.frames.get(key)
            if frame is None:
                failed[key] = "not in the dict tier"
                continue
            try:  # checks the frame, then copies the payload into the slot
                self.framer.decode_into(key, frame, self.primary.block(slot))
            except CorruptBlock as exc:
                del self.frames[key]
                self.report_removed([key])  # the cache forgets it and emits `removed`
                failed[key] = f"corrupt block deleted: {exc}"
        return JobResult.partial(job, failed)

    async def remove(self, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            self.frames.pop(key, None)


CHAIN = """
namespace: custom-tier-example
layout: {block_bytes: 4KiB, groups: [{kind: full, block_size: 16}]}
primary: {capacity: 32KiB, pin_memory: false}     # 8 blocks: most blocks must leave it
tiers:
  - {type: dict, max_blocks: 256}
"""


async def main() -> None:
    config = parse_config(CHAIN, source="custom_tier.py")
    tokens = list(range(16 * 32))  # 32 blocks of 16 tokens
    hashes = hash_token_blocks(tokens, 16, namespace=config.namespace)
    keys = [make_offload_key(h, 0) for h in hashes]
    blocks = torch.randint(0, 256, (len(keys), 4096), dtype=torch.uint8)

    async with TieredCache(config) as cache:
        for start in range(0, len(keys), 4):  # a request's worth at a time
            result = await cache.store(keys[start : start + 4], blocks[start : start + 4])
            # back to back into an 8-block primary: blocks it cannot keep stream
            # through it to the tier; store returns once each is held somewhere
            assert result.ok, result.error

        out = torch.empty_like(blocks)
        served: dict[str, int] = {}
        for start in range(0, len(keys), 4):  # each request: lookup, then load the hit
            request = keys[start : start + 4]
            hit = await cache.lookup([request])
            assert hit.hit_tokens == 16 * len(request), "every block is in some tier"
            result = await cache.load(hit.keys_to_load, out[start : start + 4])
            assert result.ok, result.errors
            for medium in result.sources.values():
                served[medium] = served.get(medium, 0) + 1
        assert torch.equal(out, blocks), "a block came back different"
        print(f"loaded {len(keys)} blocks back byte-identical; served by {served}")
        print(f"dict tier stats: {cache.stats().tiers['dict']['blocks_stored']} blocks stored")


if __name__ == "__main__":
    asyncio.run(main())
