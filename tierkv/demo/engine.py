"""A minimal serving engine around `TinyDecoder`: one request at a time through the
model, any number of requests in flight, and tierkv in the request path.

A request goes: hash the prompt's blocks -> reuse the longest prefix still in the
engine's own GPU prefix cache (with `prefix_caching`, bounded by its KV blocks, as a
real engine's) -> with a `TieredCache`, `lookup` the blocks after that and `load` the
hit into fresh KV-cache blocks through the `TransferWorker` -> prefill only the rest
-> decode -> `store` the full blocks the GPU cache did not provide (GPU -> primary,
then down the chain). Without either, every prompt is prefilled from scratch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

import anyio
import torch

from tierkv.cache import TieredCache
from tierkv.contract.keys import OffloadKey, hash_token_blocks, make_offload_key
from tierkv.demo.model import ModelConfig, PagedKVCache, TinyDecoder
from tierkv.demo.prefix_cache import ChunkAllocator
from tierkv.gpu import TransferWorker, required_block_bytes
from tierkv.gpu.kv_blocks import KVCacheBlocks
from tierkv.layout import GroupSpec, KVLayout

T = TypeVar("T")


@dataclass
class Generation:
    """What one request did. `ttft` runs from the request's start to its first token
    (lookup, load and prefill included); `logits[i]` are the logits that chose
    `tokens[i]`."""

    tokens: list[int]
    logits: list[torch.Tensor]
    ttft: float
    total: float
    prompt_tokens: int
    reused_tokens: int = 0  # prompt tokens whose KV came from tierkv
    gpu_hit_tokens: int = 0  # prompt tokens whose KV was still in the GPU prefix cache
    looked_up_blocks: int = 0  # full prompt blocks the request could reuse
    sources: dict[str, int] = field(default_factory=dict)  # blocks loaded per medium
    load_failures: int = 0
    stored_blocks: int = 0
    rejected_blocks: int = 0  # the primary had no room (all its blocks in use)
    skipped_blocks: int = 0  # window blocks and states no checkpoint's hit needs (hybrid)
    earlier_blocks: int = 0  # blocks loaded that this engine never stored: an earlier run's
    group_loaded: list[int] = field(default_factory=list)  # blocks loaded, per KV group
    group_stored: list[int] = field(default_factory=list)  # blocks stored, per KV group


class DemoEngine:
    """`TinyDecoder` plus a paged KV cache of `gpu_blocks` blocks of `gpu_block_tokens`
    tokens (rounded up to whole chunks); `block_factor` KV blocks make one offloaded
    block. `prefix_caching` keeps finished requests' blocks as a GPU prefix cache.
    Several engines may share one model (each has its own KV cache)."""

    def __init__(
        self,
        model: TinyDecoder,
        *,
        gpu_blocks: int,
        gpu_block_tokens: int = 16,
        block_factor: int = 2,
        threaded: bool = True,
        prefix_caching: bool = False,
    ) -> None:
        if block_factor < 1:
            raise ValueError(f"block_factor must be >= 1, got {block_factor}")
        chunks = -(-gpu_blocks // block_factor)
        self.model = model
        self.kv = PagedKVCache(model.config, chunks * block_factor, gpu_block_tokens, model.device)
        self.chunks = ChunkAllocator(chunks, block_factor, prefix_caching=prefix_caching)
        self.block_factor = block_factor
        self.offload_tokens = gpu_block_tokens * block_factor
        self.threaded = threaded
        self._model_lock = anyio.Lock()
        self._blocks_freed = anyio.Condition()
        self.cache: TieredCache | None = None
        self.worker: TransferWorker | None = None
        # with a set (the demo's run sets one): every key passed to `store`, kept or not,
        # so that a load of any other key counts as an earlier run's block; None in a
        # long-running server, where it would only grow
        self.stored_keys: set[OffloadKey] | None = None
        self.namespace = f"tierkv-demo-{model.config.fingerprint()}-b{self.offload_tokens}"

    # -- wiring tierkv in ---------------------------------------------------------------
    @property
    def layout(self) -> KVLayout:
        """The cache layout this engine's KV cache needs: one full-attention group."""
        return KVLayout(
            block_bytes=required_block_bytes([self.kv.layers()], self.block_factor),
            groups=(GroupSpec(kind="full", block_size=self.offload_tokens),),
        )

    @property
    def layers_per_group(self) -> tuple[int, ...]:
        return (self.model.config.layers,)

    def payload_bytes(self) -> list[int]:
        """Bytes of data in one offloaded block per group: all of it, one group."""
        return [int(self.layout.block_bytes)]

    def attach(self, cache: TieredCache) -> None:
        """Serve through `cache` (open, built with `self.layout`)."""
        self.worker = TransferWorker(
            [self.kv.layers()],
            cache.primary.view,
            cache.config.layout,
            gpu_block_size=self.kv.block_tokens,
            # the model runs (in worker threads) on the device's default stream
            ready=torch.cuda.default_stream(self.model.device)
            if self.model.device.type == "cuda"
            else None,
        )
        self.cache = cache

    def detach(self) -> None:
        self.cache = None
        self.worker = None

    def block_keys(self, tokens: Sequence[int]) -> list[OffloadKey]:
        hashes = hash_token_blocks(tokens, self.offload_tokens, namespace=self.namespace)
        return [make_offload_key(h, 0) for h in hashes]

    # -- running the model --------------------------------------------------------------
    async def _compute(self, fn: Callable[[], T]) -> T:
        """Run one forward pass: one at a time, off the event loop when threaded."""
        async with self._model_lock:
            if self.threaded:
                return await anyio.to_thread.run_sync(fn)
            return fn()

    async def _allocate(self, count: int) -> list[int]:
        """`count` chunks, waiting while other requests hold them."""
        if count > self.chunks.num_chunks:
            raise ValueError(
                f"a request of {count * self.block_factor} KV blocks can never fit a KV "
                f"cache of {self.kv.num_blocks} blocks"
            )
        async with self._blocks_freed:
            while self.chunks.available < count:
                await self._blocks_freed.wait()
            return self.chunks.allocate(count)

    async def _release(self, chunks: list[int], keys: list[OffloadKey]) -> None:
        self.chunks.release(chunks, keys)
        async with self._blocks_freed:
            self._blocks_freed.notify_all()

    async def generate(
        self, prompt: Sequence[int], max_new_tokens: int, *, use_cache: bool = True
    ) -> Generation:
        """Greedy decoding of `max_new_tokens` tokens after `prompt`; `use_cache`: with
        the attached `TieredCache` (the GPU prefix cache is used either way when the
        engine has one)."""
        if not prompt or max_new_tokens < 1:
            raise ValueError("need a non-empty prompt and at least one new token")
        prompt = list(prompt)
        cache = self.cache if use_cache else None
        started = time.perf_counter()
        keys = self.block_keys(prompt)
        # the last prompt token is always computed: its logits pick the first token
        reusable = keys[: (len(prompt) - 1) // self.offload_tokens]
        needed = -(-(len(prompt) + max_new_tokens) // self.offload_tokens)
        if needed > self.chunks.num_chunks:
            raise ValueError(
                f"a request of {needed * self.block_factor} KV blocks can never fit a KV "
                f"cache of {self.kv.num_blocks} blocks"
            )
        hit = self.chunks.match(reusable)
        try:
            fresh = await self._allocate(needed - len(hit))
        except BaseException:
            self.chunks.release(hit, [])
            raise
        chunks = hit + fresh
        table = self.chunks.blocks(chunks)
        computed_keys: list[OffloadKey] = []
        try:
            result = Generation([], [], 0.0, 0.0, len(prompt))
            result.looked_up_blocks = len(reusable)
            result.gpu_hit_tokens = len(hit) * self.offload_tokens
            reused = result.gpu_hit_tokens
            if cache is not None:
                reused += await self._reuse(cache, reusable, len(hit), table, result)
            await self._decode(prompt, reused, max_new_tokens, table, started, result)
            # KV exists for every token but the last one generated
            computed_keys = self.block_keys(prompt + result.tokens[:-1])
            if cache is not None:
                await self._store(cache, computed_keys, len(hit), table, result)
            return result
        finally:
            await self._release(chunks, computed_keys)

    async def _decode(
        self,
        prompt: list[int],
        reused: int,
        max_new_tokens: int,
        table: list[int],
        started: float,
        result: Generation,
    ) -> None:
        """Prefill `prompt` after its first `reused` tokens (their KV is in `table`),
        then decode greedily into `result`; its `ttft` and `total` run from `started`."""
        logits = await self._compute(lambda: self.model(prompt[reused:], reused, table, self.kv))
        token = int(logits.argmax())
        result.ttft = time.perf_counter() - started
        result.tokens.append(token)
        result.logits.append(logits)
        for step in range(1, max_new_tokens):
            logits = await self._compute(
                partial(self.model, [token], len(prompt) + step - 1, table, self.kv)
            )
            token = int(logits.argmax())
            result.tokens.append(token)
            result.logits.append(logits)
        result.total = time.perf_counter() - started

    async def _store(
        self,
        cache: TieredCache,
        computed_keys: list[OffloadKey],
        gpu_hit: int,
        table: list[int],
        result: Generation,
    ) -> None:
        """Store the blocks the GPU prefix cache did not provide (those after its
        `gpu_hit` blocks): loaded ones are already present below, computed ones are new."""
        new = computed_keys[gpu_hit:]
        if self.stored_keys is not None:
            self.stored_keys.update(new)
        stored = await cache.store(new, self._blocks(table, gpu_hit, len(new)))
        result.stored_blocks = len(stored.stored)
        result.rejected_blocks = len(stored.rejected)
        result.group_stored = [result.stored_blocks]

    def _blocks(self, table: list[int], first: int, count: int) -> KVCacheBlocks:
        """Offloaded blocks `first .. first + count` of a request as GPU blocks."""
        assert self.worker is not None
        f = self.block_factor
        return KVCacheBlocks(self.worker, [table[first * f : (first + count) * f]])

    async def _reuse(
        self,
        cache: TieredCache,
        reusable: list[OffloadKey],
        first: int,
        table: list[int],
        result: Generation,
    ) -> int:
        """Load the blocks after the GPU hit (`reusable[first:]`) that tierkv holds into
        `table`; return how many tokens that adds."""
        wanted_all = reusable[first:]
        if not wanted_all:
            return 0
        hit = await cache.lookup([wanted_all])
        count = hit.hit_tokens // self.offload_tokens
        if not count:
            return 0
        wanted = wanted_all[:count]
        loaded = await cache.load(wanted, self._blocks(table, first, count))
        ok = set(loaded.ok_keys)
        usable = next((i for i, k in enumerate(wanted) if k not in ok), count)
        result.load_failures = len(loaded.failed_keys)
        result.group_loaded = [len(ok)]
        for key in wanted[:usable]:
            medium = loaded.sources[key]
            result.sources[medium] = result.sources.get(medium, 0) + 1
            if self.stored_keys is not None and key not in self.stored_keys:
                result.earlier_blocks += 1
        result.reused_tokens = usable * self.offload_tokens
        return result.reused_tokens


def resolve_device(device: str = "auto") -> torch.device:
    """`auto`: CUDA when available, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def build_engine(
    config: ModelConfig,
    *,
    device: str = "auto",
    gpu_blocks: int = 96,
    gpu_block_tokens: int = 16,
    block_factor: int = 2,
    threaded: bool = True,
    prefix_caching: bool = False,
    model: TinyDecoder | None = None,
) -> DemoEngine:
    """The demo model on `device` (`auto`: CUDA when available) inside an engine;
    `model` shares an already built one."""
    return DemoEngine(
        model if model is not None else TinyDecoder(config, resolve_device(device)),
        gpu_blocks=gpu_blocks,
        gpu_block_tokens=gpu_block_tokens,
        block_factor=block_factor,
        threaded=threaded,
        prefix_caching=prefix_caching,
    )
