"""The DMA copy plan: one (dst, src, size) triple per (GPU block, layer) page, as plain
address arithmetic on NumPy arrays.

Per group, the worker caches a `GroupTable` once: each layer's GPU base address and
block stride, the layer's offset within a slab chunk and its page size; its `Planner`
keeps what follows from them. A transfer's plan is then a few broadcast operations
over its `Mapping` (no per-page Python work):

    gpu address  = gpu_base[l] + gpu_block * gpu_stride[l]
    slab address = slab_base + sub_row * sub_block_stride + layer_offset[l]

Triples are ordered block by block, layers in order, so that where consecutive pages
are contiguous on both sides (a cross-layer cache `[blocks, layers, page]`, a single
layer with consecutive blocks and sub-rows) `coalesce` merges them into one copy: fewer
descriptors, each larger. The same triples are applied by every DMA executor: the CUDA
batched memcpy, the per-run `copy_` fallback and the CPU `memmove` executor the tests
use, so the arithmetic proven on CPU is the arithmetic the GPU runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tierkv.gpu.mapping import Mapping

Addresses = npt.NDArray[np.uint64]


@dataclass(frozen=True)
class GroupTable:
    """Per-layer address facts of one group, cached for the worker's lifetime."""

    gpu_base: Addresses  # [layers] address of block 0's page
    gpu_stride: Addresses  # [layers] bytes from one block to the next
    layer_offset: Addresses  # [layers] offset of the layer's page within a chunk
    page: Addresses  # [layers] page bytes

    @classmethod
    def of(
        cls,
        gpu_base: Sequence[int],
        gpu_stride: Sequence[int],
        layer_offset: Sequence[int],
        page: Sequence[int],
    ) -> GroupTable:
        def u64(values: Sequence[int]) -> Addresses:
            return np.asarray(values, dtype=np.uint64)

        return cls(u64(gpu_base), u64(gpu_stride), u64(layer_offset), u64(page))


@dataclass(frozen=True)
class SlabTable:
    """Where the slab's sub-rows are: `base + sub_row * sub_block_stride`."""

    base: int
    sub_block_stride: int


@dataclass(frozen=True)
class CopyPlan:
    """Copies to make: `sizes[i]` bytes from address `srcs[i]` to address `dsts[i]`.
    No two destinations overlap, so the copies may run in any order."""

    dsts: Addresses
    srcs: Addresses
    sizes: Addresses

    @property
    def count(self) -> int:
        return int(self.sizes.size)

    @property
    def num_bytes(self) -> int:
        return int(self.sizes.sum()) if self.sizes.size else 0

    @property
    def mean_copy_bytes(self) -> float:
        return self.num_bytes / self.count if self.count else 0.0


class Planner:
    """Builds the plans of one worker's transfers. Everything that does not depend on
    a transfer's block ids is worked out once, here: per group, each layer's GPU base
    and stride and the slab's per-layer address as int64 arrays (user-space addresses
    are below 2**63), the page sizes of 1..`SIZES_CACHED` blocks, and whether two
    layers of one block can ever be contiguous on both sides (if not, a one-block plan
    has nothing to merge and `coalesce` is skipped). A one-block plan is then four
    vector operations; small transfers are what engines issue at every decode step."""

    SIZES_CACHED = 64

    def __init__(self, groups: Sequence[GroupTable], slab: SlabTable) -> None:
        self._base = [t.gpu_base.astype(np.int64) for t in groups]
        self._stride = [t.gpu_stride.astype(np.int64) for t in groups]
        self._slab_layer = [slab.base + t.layer_offset.astype(np.int64) for t in groups]
        self._page = [t.page.astype(np.int64) for t in groups]
        self._sub_block_stride = slab.sub_block_stride
        self._sizes: dict[tuple[int, int], npt.NDArray[np.int64]] = {}
        self._layers_join = [_layers_may_join(t) for t in groups]

    def _group_sizes(self, group: int, blocks: int) -> npt.NDArray[np.int64]:
        key = (group, blocks)
        sizes = self._sizes.get(key)
        if sizes is None:
            sizes = np.tile(self._page[group], blocks)
            sizes.flags.writeable = False  # shared by every plan of this many blocks
            if blocks <= self.SIZES_CACHED:
                self._sizes[key] = sizes
        return sizes

    def plan(self, mapping: Mapping, *, coalesce_runs: bool = True) -> CopyPlan:
        """The triples of `mapping`: for a store slab <- GPU, for a load GPU <- slab."""
        gpu_parts: list[npt.NDArray[np.int64]] = []
        slab_parts: list[npt.NDArray[np.int64]] = []
        size_parts: list[npt.NDArray[np.int64]] = []
        may_join = False
        for g, (ids, rows) in enumerate(zip(mapping.gpu, mapping.rows)):
            if not ids.size:
                continue
            gpu = np.multiply.outer(ids, self._stride[g])
            gpu += self._base[g]
            gpu_parts.append(gpu.ravel())
            slab_parts.append(
                np.add.outer(rows * self._sub_block_stride, self._slab_layer[g]).ravel()
            )
            size_parts.append(self._group_sizes(g, ids.size))
            may_join = may_join or ids.size > 1 or self._layers_join[g]
        if not size_parts:
            empty = np.empty(0, dtype=np.uint64)
            return CopyPlan(empty, empty, empty)
        may_join = may_join or len(size_parts) > 1
        gpu_addr, slab_addr, sizes = (
            (p[0] if len(p) == 1 else np.concatenate(p)).view(np.uint64)
            for p in (gpu_parts, slab_parts, size_parts)
        )
        plan = (
            CopyPlan(slab_addr, gpu_addr, sizes)
            if mapping.direction == "store"
            else CopyPlan(gpu_addr, slab_addr, sizes)
        )
        return coalesce(plan) if coalesce_runs and may_join else plan


def _layers_may_join(table: GroupTable) -> bool:
    """Whether some layer's page of a block ends where the next layer's begins on both
    the GPU (same stride) and the slab: a cross-layer layout, where copies merge."""
    if table.page.size < 2:
        return False
    ends_gpu = table.gpu_base[:-1] + table.page[:-1]
    ends_slab = table.layer_offset[:-1] + table.page[:-1]
    joins = (
        (table.gpu_base[1:] == ends_gpu)
        & (table.gpu_stride[1:] == table.gpu_stride[:-1])
        & (table.layer_offset[1:] == ends_slab)
    )
    return bool(joins.any())


def build_plan(
    mapping: Mapping,
    groups: Sequence[GroupTable],
    slab: SlabTable,
    *,
    coalesce_runs: bool = True,
) -> CopyPlan:
    """The triples of `mapping` (a `Planner` made for this one call; workers keep
    theirs)."""
    return Planner(groups, slab).plan(mapping, coalesce_runs=coalesce_runs)


def coalesce(plan: CopyPlan) -> CopyPlan:
    """Merge each run of consecutive copies that are contiguous in both source and
    destination into one copy of the run's total size."""
    if plan.count < 2:
        return plan
    ends_dst = plan.dsts[:-1] + plan.sizes[:-1]
    ends_src = plan.srcs[:-1] + plan.sizes[:-1]
    joins = (plan.dsts[1:] == ends_dst) & (plan.srcs[1:] == ends_src)
    if not joins.any():
        return plan
    starts = np.concatenate(([0], np.flatnonzero(~joins) + 1))
    sizes = np.add.reduceat(plan.sizes, starts).astype(np.uint64)
    return CopyPlan(plan.dsts[starts], plan.srcs[starts], sizes)
