"""`KVCacheBlocks`: a request's blocks in the engine's GPU KV caches, as the source of
a `TieredCache.store` or the destination of a `TieredCache.load`.

The cache speaks in keys (one per offloaded block per group, in group order: all keys
of group 0, then group 1, ... exactly like `LookupResult.keys_to_load`); the worker
speaks in GPU block ids. This adapter holds, per group, the request's GPU block ids in
token order and the position of the first one (`block_indices[g]`), and turns "copy
keys i, j, k to/from these slots" into worker transfers: one `TransferSpec` per
contiguous run of keys, all groups in one spec, one batched copy per layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tierkv.primary import HostSlab
from tierkv.worker import Direction, TransferSpec, TransferWorker


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
        self.factor = worker.block_size_factor
        self.gpu_blocks = [list(map(int, blocks)) for blocks in gpu_blocks]
        self.heads = [int(i) % self.factor for i in indices]
        # key position -> (group, offloaded block index within the group)
        self._keys: list[tuple[int, int]] = []
        for g, blocks in enumerate(self.gpu_blocks):
            count = math.ceil((self.heads[g] + len(blocks)) / self.factor) if blocks else 0
            self._keys.extend((g, j) for j in range(count))

    def __len__(self) -> int:
        return len(self._keys)

    def keys_per_group(self) -> list[int]:
        """How many keys each group contributes, in order."""
        counts = [0] * len(self.gpu_blocks)
        for g, _ in self._keys:
            counts[g] += 1
        return counts

    def validate(self, direction: Direction, indices: Sequence[int] | None = None) -> None:
        """Check a request before the cache reserves, evicts or promotes anything: GPU
        block ids in range, and for a store, that the keys at `indices` (all keys when
        None) cover whole offloaded blocks. Raises ValueError; changes nothing."""
        limits = getattr(self.worker, "num_gpu_blocks", None)
        if limits is not None:
            for g, blocks in enumerate(self.gpu_blocks):
                bad = [b for b in blocks if not 0 <= b < limits[g]]
                if bad:
                    raise ValueError(
                        f"group {g}: GPU block ids {bad[:5]} are out of range 0..{limits[g] - 1}"
                    )
        if direction != "store":
            return
        chosen = range(len(self._keys)) if indices is None else indices
        for index in chosen:
            g, j = self._keys[index]
            head = self.heads[g]
            if j * self.factor - head < 0 or (j + 1) * self.factor - head > len(self.gpu_blocks[g]):
                raise ValueError(
                    f"group {g}: a store must cover whole offloaded blocks; offloaded block "
                    f"{j} is only partly among the GPU blocks given (block_indices head "
                    f"{head}, {len(self.gpu_blocks[g])} GPU blocks, factor {self.factor})"
                )

    def _check_view(self, view: HostSlab) -> None:
        if view.num_blocks != self.worker.num_slots or view.block_bytes != self.worker.block_bytes:
            raise ValueError("this KVCacheBlocks' worker was built over another primary slab")

    async def _move(
        self, direction: Direction, view: HostSlab, indices: Sequence[int], slots: Sequence[int]
    ) -> None:
        self._check_view(view)
        groups = len(self.gpu_blocks)
        # per group: offloaded block index -> slot, for the selected keys
        chosen: list[dict[int, int]] = [{} for _ in range(groups)]
        for index, slot in zip(indices, slots):
            g, j = self._keys[index]
            chosen[g][j] = slot
        runs: list[list[tuple[list[int], list[int], int]]] = []
        for g in range(groups):
            group_runs = []
            for run in _contiguous(sorted(chosen[g])):
                first, last = run[0], run[-1]
                head = self.heads[g]
                if direction == "store" and (
                    first * self.factor - head < 0
                    or (last + 1) * self.factor - head > len(self.gpu_blocks[g])
                ):
                    # the rest of the slot would keep another key's bytes
                    raise ValueError(
                        f"group {g}: a store must cover whole offloaded blocks; offloaded "
                        f"blocks {first}..{last} are only partly among the GPU blocks given "
                        f"(block_indices head {head}, {len(self.gpu_blocks[g])} GPU blocks, "
                        f"factor {self.factor})"
                    )
                start = max(0, first * self.factor - head)
                end = min(len(self.gpu_blocks[g]), (last + 1) * self.factor - head)
                group_runs.append(
                    (self.gpu_blocks[g][start:end], [chosen[g][j] for j in run], (start + head))
                )
            runs.append(group_runs)
        for r in range(max((len(x) for x in runs), default=0)):
            spec = TransferSpec(
                direction,
                [runs[g][r][0] if r < len(runs[g]) else [] for g in range(groups)],
                [runs[g][r][1] if r < len(runs[g]) else [] for g in range(groups)],
                [runs[g][r][2] if r < len(runs[g]) else 0 for g in range(groups)],
            )
            await self.worker.transfer(spec)

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


def _contiguous(values: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for v in values:
        if runs and runs[-1][-1] + 1 == v:
            runs[-1].append(v)
        else:
            runs.append([v])
    return runs
