"""The serving engine for the hybrid demo model: two KV-cache groups, each with its own
GPU blocks, block table, GPU prefix cache and keys, through one `TieredCache`.

A request goes as in `DemoEngine` (`engine.py`), with the group rules of
`tierkv.hits` at every step instead of "the longest prefix":

1. the GPU prefix cache: each group says which of its blocks it still holds; the
   GPU hit is the longest length every group can serve (a window group needs only the
   blocks inside its window before that length, a state group only the state there),
   and only those blocks are held;
2. `lookup(keys_per_group, gpu_tokens=GPU hit)`: the tier hit, and per group the
   keys to load (the tiers' rule is the same);
3. fresh blocks for what is loaded and what is computed; every other table entry
   points at a *null* chunk filled with NaN, so a pass that read a block its group
   did not need would turn the logits into NaN and fail the correctness check;
4. `load`, then the hit narrowed again by the same rule over what did load (a failed
   key shortens it; the rest is recomputed), then prefill, decode;
5. `store`, per group, of the blocks the GPU prefix cache did not provide: computed
   and loaded ones (the cache keeps what its policy keeps), never a null block.

Counts of blocks loaded and stored per group are in the `Generation`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TypeVar

import anyio
import torch

from tierkv.cache import TieredCache
from tierkv.cache.results import LookupResult
from tierkv.contract.keys import (
    OffloadKey,
    get_offload_group_idx,
    hash_token_blocks,
    make_offload_key,
)
from tierkv.demo.engine import Generation
from tierkv.demo.hybrid_model import HybridDecoder
from tierkv.demo.model import PagedKVCache
from tierkv.demo.prefix_cache import ChunkAllocator
from tierkv.demo.recurrent import StateCache
from tierkv.gpu import TransferWorker, required_block_bytes
from tierkv.gpu.kv_blocks import KVCacheBlocks
from tierkv.hits import combine_group_hits
from tierkv.layout import GroupSpec, KVLayout

T = TypeVar("T")

Table = list[int | None]
"""A group's chunk per offloaded block of a request; None: not held (the null chunk)."""


class HybridEngine:
    """`HybridDecoder` plus per group `gpu_blocks` KV blocks of `gpu_block_tokens`
    (rounded up to whole chunks of `block_factor`; the state group one state per chunk),
    as `DemoEngine` takes them. `chunks` and `kv` are group 0's (the summary's sizes)."""

    def __init__(
        self,
        model: HybridDecoder,
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
        self.block_factor = block_factor
        self.offload_tokens = gpu_block_tokens * block_factor
        # one chunk more per group: the null chunk, never handed out
        self.caches = model.caches(
            (chunks + 1) * block_factor, gpu_block_tokens, block_factor, model.device
        )
        self.null = chunks
        self._poison_null()
        self.allocators = [
            ChunkAllocator(chunks, block_factor, prefix_caching=prefix_caching) for _ in range(2)
        ]
        self.kv: PagedKVCache = self.caches.full
        self.chunks = self.allocators[0]
        self.threaded = threaded
        self._model_lock = anyio.Lock()
        self._blocks_freed = anyio.Condition()
        self.cache: TieredCache | None = None
        self.worker: TransferWorker | None = None
        self.stored_keys: set[OffloadKey] | None = None  # as DemoEngine's
        fingerprint = f"{model.config.fingerprint()}-{model.hybrid.fingerprint()}"
        self.namespace = f"tierkv-demo-{fingerprint}-b{self.offload_tokens}"

    def _poison_null(self) -> None:
        """NaN in the null chunk of every group: reading it shows in the logits."""
        f, n = self.block_factor, self.null
        other = self.caches.other
        kv = [self.caches.full, *([other] if isinstance(other, PagedKVCache) else [])]
        for t in (t for cache in kv for t in cache.layers()):
            t[n * f : (n + 1) * f] = float("nan")
        if not isinstance(other, PagedKVCache):
            for s in other.states:
                s[n] = float("nan")

    # -- wiring tierkv in ---------------------------------------------------------------
    @property
    def groups(self) -> tuple[GroupSpec, ...]:
        ot = self.offload_tokens
        hybrid = self.model.hybrid
        other = (
            GroupSpec(kind="sliding_window", block_size=ot, window=hybrid.window)
            if hybrid.kind == "window"
            else GroupSpec(kind="state", block_size=ot)
        )
        return (GroupSpec(kind="full", block_size=ot), other)

    def _worker_layers(self) -> list[list[torch.Tensor]]:
        return [self.caches.full.layers(), self.caches.other.layers()]

    @property
    def layout(self) -> KVLayout:
        """Two groups; the block is sized for the larger (the other is padded)."""
        return KVLayout(
            block_bytes=required_block_bytes(self._worker_layers(), self.block_factor),
            groups=self.groups,
            checkpoint_every=self.model.hybrid.checkpoint_every,
        )

    @property
    def layers_per_group(self) -> tuple[int, ...]:
        return self.model.layers_per_group

    def payload_bytes(self) -> list[int]:
        """Bytes of one offloaded block's data per group (the rest of a row is padding)."""
        return [
            self.block_factor * sum(t[0].numel() * t.element_size() for t in layers)
            for layers in self._worker_layers()
        ]

    def attach(self, cache: TieredCache) -> None:
        """Serve through `cache` (open, built with `self.layout`)."""
        self.worker = TransferWorker(
            self._worker_layers(),
            cache.primary.view,
            cache.config.layout,
            gpu_block_size=self.kv.block_tokens,
            ready=torch.cuda.default_stream(self.model.device)
            if self.model.device.type == "cuda"
            else None,
        )
        self.cache = cache

    def detach(self) -> None:
        self.cache = None
        self.worker = None

    def block_keys(self, tokens: Sequence[int]) -> list[list[OffloadKey]]:
        """Per group, the keys of the full blocks of `tokens` (the group index in each)."""
        hashes = hash_token_blocks(tokens, self.offload_tokens, namespace=self.namespace)
        return [[make_offload_key(h, g) for h in hashes] for g in range(2)]

    # -- blocks -------------------------------------------------------------------------
    async def _compute(self, fn: Callable[[], T]) -> T:
        async with self._model_lock:
            if self.threaded:
                return await anyio.to_thread.run_sync(fn)
            return fn()

    async def _fill(self, g: int, table: Table, positions: Sequence[int]) -> None:
        """Fresh chunks of group `g` for the entries at `positions` not yet held."""
        empty = [j for j in positions if table[j] is None]
        if not empty:
            return
        alloc = self.allocators[g]
        async with self._blocks_freed:
            while alloc.available < len(empty):
                await self._blocks_freed.wait()
            for j, chunk in zip(empty, alloc.allocate(len(empty))):
                table[j] = chunk

    async def _release(self, tables: list[Table], keys: list[list[OffloadKey | None]]) -> None:
        for g, table in enumerate(tables):
            held = [(c, keys[g][j]) for j, c in enumerate(table) if c is not None]
            self.allocators[g].release([c for c, _ in held], [k for _, k in held])
        async with self._blocks_freed:
            self._blocks_freed.notify_all()

    def _gpu_blocks(self, g: int, chunks: Sequence[int]) -> list[int]:
        """Group `g`'s GPU blocks of `chunks`: KV blocks, or a state's sub-blocks."""
        return self.allocators[g].blocks(chunks)

    def _model_tables(self, tables: list[Table]) -> list[list[int]]:
        """What the model reads: KV block ids per group; the state group's slots."""
        full = self.allocators[0].blocks([self.null if c is None else c for c in tables[0]])
        other = [self.null if c is None else c for c in tables[1]]
        if self.model.hybrid.kind == "window":
            return [full, self.allocators[1].blocks(other)]
        return [full, other]

    def _transfer(self, tables: list[Table], ranges: list[tuple[int, int]]) -> KVCacheBlocks:
        """Blocks `[first, end)` of each group's table as a load or store target."""
        assert self.worker is not None
        gpu = []
        for g, (first, end) in enumerate(ranges):
            chunks = tables[g][first:end]
            assert all(c is not None for c in chunks)
            gpu.append(self._gpu_blocks(g, [c for c in chunks if c is not None]))
        indices = [first * self.block_factor for first, _ in ranges]
        return KVCacheBlocks(self.worker, gpu, indices)

    # -- a request ----------------------------------------------------------------------
    async def generate(
        self, prompt: Sequence[int], max_new_tokens: int, *, use_cache: bool = True
    ) -> Generation:
        """Greedy decoding of `max_new_tokens` tokens after `prompt`, as
        `DemoEngine.generate`; `use_cache`: with the attached `TieredCache`."""
        if not prompt or max_new_tokens < 1:
            raise ValueError("need a non-empty prompt and at least one new token")
        prompt = list(prompt)
        cache = self.cache if use_cache else None
        started = time.perf_counter()
        ot = self.offload_tokens
        reusable = [keys[: (len(prompt) - 1) // ot] for keys in self.block_keys(prompt)]
        needed = -(-(len(prompt) + max_new_tokens) // ot)
        if needed > self.chunks.num_chunks:
            raise ValueError(
                f"a request of {needed} chunks can never fit a KV cache of "
                f"{self.chunks.num_chunks} chunks per group"
            )
        groups = self.groups
        tables: list[Table] = [[None] * needed for _ in groups]
        gpu_tokens, valid = self._hold_gpu_hit(reusable, tables)
        release_keys: list[list[OffloadKey | None]] = [[None] * needed for _ in groups]
        try:
            result = Generation([], [], 0.0, 0.0, len(prompt))
            result.looked_up_blocks = len(reusable[0])
            result.gpu_hit_tokens = gpu_tokens
            result.group_loaded = [0] * len(groups)
            result.group_stored = [0] * len(groups)
            reuse = gpu_tokens
            if cache is not None and len(reusable[0]) * ot > gpu_tokens:
                reuse = await self._reuse(cache, reusable, gpu_tokens, tables, valid, result)
            for g, table in enumerate(tables):  # what the passes write
                await self._fill(g, table, range(reuse // ot, needed))
            await self._decode(prompt, reuse, max_new_tokens, tables, started, result)
            computed = self.block_keys(prompt + result.tokens[:-1])
            _keep_known_content(computed, reuse // ot, valid, release_keys)
            if cache is not None:
                await self._store(cache, computed, gpu_tokens // ot, tables, release_keys, result)
            result.reused_tokens = reuse - gpu_tokens
            return result
        finally:
            await self._release(tables, release_keys)

    def _hold_gpu_hit(
        self, reusable: list[list[OffloadKey]], tables: list[Table]
    ) -> tuple[int, list[set[int]]]:
        """Step 1, the GPU prefix cache by the group rules: hold in `tables` the blocks
        each group needs for the longest hit every group can serve; return that hit in
        tokens and, per group, the blocks whose content is now valid."""
        flags = [[a.is_cached(k) for k in keys] for a, keys in zip(self.allocators, reusable)]
        gpu_tokens, ranges = combine_group_hits(self.groups, flags)
        valid: list[set[int]] = []
        for g, r in enumerate(ranges):
            held = self.allocators[g].hold(reusable[g][r.first : r.end])
            tables[g][r.first : r.end] = held
            valid.append(set(range(r.first, r.end)))
        return gpu_tokens, valid

    async def _decode(
        self,
        prompt: list[int],
        reuse: int,
        max_new_tokens: int,
        tables: list[Table],
        started: float,
        result: Generation,
    ) -> None:
        """Prefill `prompt` after its first `reuse` tokens, then decode greedily into
        `result`, as `DemoEngine._decode`; a state model carries its running state
        from pass to pass."""
        model_tables = self._model_tables(tables)
        other = self.caches.other
        running = other.running() if isinstance(other, StateCache) else None
        caches = self.caches
        logits = await self._compute(
            lambda: self.model(prompt[reuse:], reuse, model_tables, caches, running)
        )
        token = int(logits.argmax())
        result.ttft = time.perf_counter() - started
        result.tokens.append(token)
        result.logits.append(logits)
        for step in range(1, max_new_tokens):
            position = len(prompt) + step - 1
            logits = await self._compute(
                partial(self.model, [token], position, model_tables, caches, running)
            )
            token = int(logits.argmax())
            result.tokens.append(token)
            result.logits.append(logits)
        result.total = time.perf_counter() - started

    async def _reuse(
        self,
        cache: TieredCache,
        reusable: list[list[OffloadKey]],
        gpu_tokens: int,
        tables: list[Table],
        valid: list[set[int]],
        result: Generation,
    ) -> int:
        """Look up and load what the tiers hold beyond the GPU hit; return the hit in
        tokens that every group can serve from what is now in its blocks."""
        ot = self.offload_tokens
        hit = await cache.lookup(reusable, gpu_tokens=gpu_tokens)
        if hit.hit_tokens <= gpu_tokens:
            return gpu_tokens
        spans = self._load_spans(hit, reusable, tables)
        for g, (first, end) in enumerate(spans):
            await self._fill(g, tables[g], range(first, end))
        keys = [k for g, (first, end) in enumerate(spans) for k in reusable[g][first:end]]
        if keys:
            loaded = await cache.load(keys, self._transfer(tables, spans))
            ok = set(loaded.ok_keys)
            result.load_failures = len(loaded.failed_keys)
            for g, (first, end) in enumerate(spans):
                done = [j for j in range(first, end) if reusable[g][j] in ok]
                valid[g].update(done)
                result.group_loaded[g] = len(done)
        else:
            loaded = None
        flags = [[j in valid[g] for j in range(hit.hit_tokens // ot)] for g in range(len(tables))]
        reuse, _ = combine_group_hits(self.groups, flags)
        if loaded is not None:
            for key in reusable[0][gpu_tokens // ot : reuse // ot]:
                medium = loaded.sources.get(key)
                if medium is None:
                    continue
                result.sources[medium] = result.sources.get(medium, 0) + 1
                if self.stored_keys is not None and key not in self.stored_keys:
                    result.earlier_blocks += 1
        return reuse

    @staticmethod
    def _load_spans(
        hit: LookupResult, reusable: list[list[OffloadKey]], tables: list[Table]
    ) -> list[tuple[int, int]]:
        """Per group, the blocks `[first, end)` to load: the lookup's keys for the
        group, less blocks the GPU holds, their first run of consecutive blocks (a
        transfer covers one run per group; narrowing drops what is not loaded)."""
        spans = []
        for g, keys in enumerate(hit.group_keys):
            where = {k: j for j, k in enumerate(reusable[g])}
            blocks = [where[k] for k in keys if k in where and tables[g][where[k]] is None]
            end = blocks[0] if blocks else 0
            for j in blocks:
                if j != end:
                    break
                end += 1
            spans.append((blocks[0] if blocks else 0, end))
        return spans

    async def _store(
        self,
        cache: TieredCache,
        computed: list[list[OffloadKey]],
        gpu_blocks: int,
        tables: list[Table],
        content: list[list[OffloadKey | None]],
        result: Generation,
    ) -> None:
        """Store, per group, the run of blocks with known content that ends at the last
        full block and starts no earlier than the GPU hit (which is not stored again)."""
        spans = []
        for g, keys in enumerate(computed):
            first = len(keys)
            while first > gpu_blocks and tables[g][first - 1] is not None and content[g][first - 1]:
                first -= 1
            spans.append((first, len(keys)))
        keys = [k for g, (first, end) in enumerate(spans) for k in computed[g][first:end]]
        if not keys:  # the GPU prefix cache provided every full block
            return
        if self.stored_keys is not None:
            self.stored_keys.update(keys)
        # each key's block index: the cache keeps only the window blocks and states a
        # hit at a checkpoint (or at the end of this request) can use
        positions = [i for first, end in spans for i in range(first, end)]
        stored = await cache.store(keys, self._transfer(tables, spans), positions=positions)
        result.skipped_blocks += len(stored.skipped)
        result.stored_blocks = len(stored.stored)
        result.rejected_blocks = len(stored.rejected)
        for key in stored.stored:
            result.group_stored[get_offload_group_idx(key)] += 1


def _keep_known_content(
    computed: list[list[OffloadKey]],
    first_computed: int,
    valid: list[set[int]],
    content: list[list[OffloadKey | None]],
) -> None:
    """Set `content[g][j]` to the key of each block whose content is what the key
    says: computed by this request (from block `first_computed` on), or valid from
    the GPU hit or a load. The others stay None: a null block, or one whose load
    failed, is released without a key."""
    for g, keys in enumerate(computed):
        for j, key in enumerate(keys):
            if j >= first_computed or j in valid[g]:
                content[g][j] = key
