"""The DMA copy plan: one (dst, src, size) triple per (GPU block, layer) page, as plain
address arithmetic on NumPy arrays.

Per group, the worker caches a `GroupTable` once: each layer's GPU base address and
block stride, the layer's offset within a slab chunk and its page size. A transfer's
plan is then a few broadcast operations over its `Mapping` (no per-page Python work):

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


def build_plan(
    mapping: Mapping,
    groups: Sequence[GroupTable],
    slab: SlabTable,
    *,
    coalesce_runs: bool = True,
) -> CopyPlan:
    """The triples of `mapping`: for a store slab <- GPU, for a load GPU <- slab."""
    gpu_parts: list[Addresses] = []
    slab_parts: list[Addresses] = []
    size_parts: list[Addresses] = []
    stride = np.uint64(slab.sub_block_stride)
    base = np.uint64(slab.base)
    for table, ids, rows in zip(groups, mapping.gpu, mapping.rows):
        if not ids.size:
            continue
        blocks = ids.astype(np.uint64)[:, None]
        sub_rows = rows.astype(np.uint64)[:, None]
        gpu_parts.append((table.gpu_base[None, :] + blocks * table.gpu_stride[None, :]).ravel())
        slab_parts.append((base + sub_rows * stride + table.layer_offset[None, :]).ravel())
        size_parts.append(np.broadcast_to(table.page[None, :], (ids.size, table.page.size)).ravel())
    if not size_parts:
        empty = np.empty(0, dtype=np.uint64)
        return CopyPlan(empty, empty, empty)
    gpu, slab_addr, sizes = (np.concatenate(p) for p in (gpu_parts, slab_parts, size_parts))
    plan = (
        CopyPlan(slab_addr, gpu, sizes)
        if mapping.direction == "store"
        else CopyPlan(gpu, slab_addr, sizes)
    )
    return coalesce(plan) if coalesce_runs else plan


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
