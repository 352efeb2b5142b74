"""`KVCacheBlocks`: a request's blocks in the engine's GPU KV caches, as the source of
a `TieredCache.store` or the destination of a `TieredCache.load`.

The cache speaks in keys (one per offloaded block per group, in group order: all keys
of group 0, then group 1, ... exactly like `LookupResult.keys_to_load`); the worker
speaks in GPU block ids. This adapter holds, per group, the request's GPU block ids in
token order and the position of the first one (`block_indices[g]`), and turns "copy
keys i, j, k to/from these slots" into worker transfers: one `TransferSpec` per
contiguous run of keys, all of them one submission (one copy, one event).

On CUDA the copies wait on `ready` (the engine's stream or an event; default: the
worker's), and `done_event` is the event that closed the last copy: an engine stream
that waits on it sees the loaded KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import numpy as np

from tierkv.gpu.spec import Direction, TransferSpec
from tierkv.gpu.worker import TransferWorker
from tierkv.primary import HostSlab


class KVCacheBlocks:
    """The GPU blocks of one request, per group, seen as a list of offloaded blocks.

    `gpu_blocks[g]` are group `g`'s GPU block ids in token order, starting at request
    block position `block_indices[g]`; offloaded block `j` of group `g` covers GPU
    blocks `k` with `(head + k) // factor == j`, `head = block_indices[g] % factor`.
    The key list given to `store`/`load` must have, for each group in order,
    `ceil((head + len(gpu_blocks[g])) / factor)` keys.
    """

    def __init__(
        self,
        worker: TransferWorker,
        gpu_blocks: Sequence[Sequence[int]],
        block_indices: Sequence[int] | None = None,
        *,
        ready: Any = None,
    ) -> None:
        if len(gpu_blocks) != worker.num_groups:
            raise ValueError(
                f"gpu_blocks has {len(gpu_blocks)} groups; the worker has {worker.num_groups}"
            )
        indices = list(block_indices) if block_indices is not None else [0] * len(gpu_blocks)
        if len(indices) != len(gpu_blocks):
            raise ValueError(
                f"block_indices has {len(indices)} entries for {len(gpu_blocks)} groups"
            )
        self.worker = worker
        self.ready = ready
        self.done_event: Any = None
        self.factor = worker.block_size_factor
        self.gpu_blocks = [
            np.asarray(list(map(int, blocks)), dtype=np.int64) for blocks in gpu_blocks
        ]
        self.heads = [int(i) % self.factor for i in indices]
        counts = [
            -(-(head + blocks.size) // self.factor) if blocks.size else 0
            for head, blocks in zip(self.heads, self.gpu_blocks)
        ]
        self._counts = counts
        # key position -> (group, offloaded block index within the group)
        self._key_group = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        self._key_block = (
            np.concatenate([np.arange(c, dtype=np.int64) for c in counts])
            if counts
            else np.empty(0, dtype=np.int64)
        )

    def __len__(self) -> int:
        return int(self._key_group.size)

    def keys_per_group(self) -> list[int]:
        """How many keys each group contributes, in order."""
        return list(self._counts)

    def validate(self, direction: Direction, indices: Sequence[int] | None = None) -> None:
        """Check a request before the cache reserves, evicts or promotes anything: GPU
        block ids in range, and for a store, that the keys at `indices` (all keys when
        None) cover whole offloaded blocks. Raises ValueError; changes nothing."""
        limits = self.worker.num_gpu_blocks
        for g, blocks in enumerate(self.gpu_blocks):
            bad = blocks[(blocks < 0) | (blocks >= limits[g])]
            if bad.size:
                raise ValueError(
                    f"group {g}: GPU block ids {bad[:5].tolist()} are out of range "
                    f"0..{limits[g] - 1}"
                )
        if direction != "store":
            return
        chosen = (
            np.arange(len(self), dtype=np.int64)
            if indices is None
            else np.asarray(indices, dtype=np.int64).reshape(-1)
        )
        if chosen.size and (chosen.min() < 0 or chosen.max() >= len(self)):
            raise ValueError(f"key indices must be in 0..{len(self) - 1}")
        for index in chosen.tolist():
            g, j = int(self._key_group[index]), int(self._key_block[index])
            head = self.heads[g]
            if j * self.factor - head < 0 or (j + 1) * self.factor - head > len(self.gpu_blocks[g]):
                raise ValueError(
                    f"group {g}: a store must cover whole offloaded blocks; offloaded block "
                    f"{j} is only partly among the GPU blocks given (block_indices head "
                    f"{head}, {len(self.gpu_blocks[g])} GPU blocks, factor {self.factor})"
                )

    def check_view(self, view: HostSlab) -> None:
        """The worker copies to and from its own slab: it must be `view`'s (a worker of
        another cache with the same shape would copy into that cache's slots)."""
        if not self.worker.serves(view):
            raise ValueError("this KVCacheBlocks' worker was built over another primary slab")

    def _specs(
        self, direction: Direction, indices: Sequence[int], slots: Sequence[int]
    ) -> list[TransferSpec]:
        """One spec per run of consecutive offloaded blocks of one group."""
        keys = np.asarray(indices, dtype=np.int64).reshape(-1)
        chosen = np.asarray(slots, dtype=np.int64).reshape(-1)
        if keys.size != chosen.size:
            raise ValueError(f"{keys.size} key indices but {chosen.size} slots")
        if keys.size and (keys.min() < 0 or keys.max() >= len(self)):
            raise ValueError(f"key indices must be in 0..{len(self) - 1}")
        groups, blocks = self._key_group[keys], self._key_block[keys]
        order = np.lexsort((blocks, groups))
        groups, blocks, chosen = groups[order], blocks[order], chosen[order]
        breaks = (groups[1:] != groups[:-1]) | (blocks[1:] != blocks[:-1] + 1)
        starts: list[int] = [0, *(np.flatnonzero(breaks) + 1).tolist()] if keys.size else []
        ends = [*starts[1:], int(keys.size)]
        empty: list[int] = []
        specs = []
        for start, end in zip(starts, ends):
            g = int(groups[start])
            first, last = int(blocks[start]), int(blocks[end - 1])
            head, ids = self.heads[g], self.gpu_blocks[g]
            if direction == "store" and (
                first * self.factor - head < 0 or (last + 1) * self.factor - head > ids.size
            ):
                # the rest of the slot would keep another key's bytes
                raise ValueError(
                    f"group {g}: a store must cover whole offloaded blocks; offloaded "
                    f"blocks {first}..{last} are only partly among the GPU blocks given "
                    f"(block_indices head {head}, {ids.size} GPU blocks, "
                    f"factor {self.factor})"
                )
            lo = max(0, first * self.factor - head)
            hi = min(ids.size, (last + 1) * self.factor - head)
            gpu: list[Any] = [empty] * len(self.gpu_blocks)
            run_slots: list[Any] = [empty] * len(self.gpu_blocks)
            block_indices = [0] * len(self.gpu_blocks)
            gpu[g], run_slots[g], block_indices[g] = ids[lo:hi], chosen[start:end], lo + head
            specs.append(TransferSpec(direction, gpu, run_slots, block_indices))
        return specs

    async def _move(
        self, direction: Direction, view: HostSlab, indices: Sequence[int], slots: Sequence[int]
    ) -> None:
        self.check_view(view)
        specs = self._specs(direction, indices, slots)
        if not specs:
            return
        # the caller frees or reuses the slots once this returns: queue the copy (a
        # large one from the worker's submitter thread, the loop free meanwhile) and
        # wait for it even if cancelled (copies are bounded)
        with anyio.CancelScope(shield=True):
            handle = await self.worker.start(specs, ready=self.ready)
            self.done_event = handle.done_event
            await self.worker.wait(handle)

    async def copy_to_slots(
        self, view: HostSlab, indices: Sequence[int], slots: Sequence[int]
    ) -> None:
        """GPU -> primary (a store)."""
        await self._move("store", view, indices, slots)

    async def copy_from_slots(
        self, view: HostSlab, indices: Sequence[int], slots: Sequence[int]
    ) -> None:
        """Primary -> GPU (stage 2 of a load)."""
        await self._move("load", view, indices, slots)
