"""Copy backends: the three ways the worker moves a `Mapping`'s bytes, behind one
interface (`enqueue(mapping, stream, plan)`), chosen by `copy_backend`:

- `kernel`: one index gather plus one scatter per layer (`index_select` /
  `index_copy_`) against the slab's device alias. Fast for tiny pages, but the kernels
  occupy streaming multiprocessors: on an H200 a concurrent matmul stream ran 46-55 %
  slower beside kernel stores (33-81 % on an H100).
- `bounded`: one Triton kernel per group on a fixed grid of a few thread blocks
  (`tierkv.gpu.bounded`): small pages at the link's speed, the model keeps the other
  SMs. Needs Triton and CUDA.
- `dma`: the copy engines, one batched memcpy over the transfer's `CopyPlan` (one
  triple per page, contiguous runs merged). The model keeps the SMs (0-11 % slowdown
  on an H100, at most 9 % on an H200), but each descriptor costs the driver ~0.5 us
  to submit, so pages much smaller than ~28 KiB are submission-bound.
- `auto` (the default): `dma` when the plan's mean copy is at least
  `AUTO_MIN_DMA_COPY_BYTES`, else `bounded` (or `kernel` where Triton is missing); a
  geometry whose every page is that large gets DMA alone. On the CPU device always
  `kernel` (there are no copy engines; the CPU DMA executor exists to prove the plan).

`AUTO_MIN_DMA_COPY_BYTES` (32 KiB) was derived from the break-even of a ~0.5 us
descriptor against a 55 GB/s PCIe Gen5 link (~27.5 KiB) and confirmed on an H200 with
`tierkv bench --gpu` and `benchmarks/gpu_dma_calls.py`: DMA moved 32 KiB pages at 0.90
of one contiguous copy and 64 KiB at 0.93 with a concurrent matmul at most 9 % slower;
at 16 KiB it moved 0.51-0.60, where kernels moved 0.81 but slowed the matmul 49 %.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
import torch

from tierkv.gpu.cuda_batch import BatchMemcpy, BatchStats
from tierkv.gpu.executors import RunCopies, flat_bytes, memmove
from tierkv.gpu.geometry import Geometry
from tierkv.gpu.mapping import Mapping
from tierkv.gpu.plan import CopyPlan, GroupTable, Planner, SlabTable

CopyBackendName = Literal["auto", "dma", "bounded", "kernel"]
COPY_BACKENDS: tuple[CopyBackendName, ...] = ("auto", "dma", "bounded", "kernel")
DmaExecutorName = Literal["auto", "batched", "runs", "memmove"]
DMA_EXECUTORS: tuple[DmaExecutorName, ...] = ("auto", "batched", "runs", "memmove")

AUTO_MIN_DMA_COPY_BYTES = 32 * 1024
"""`auto` uses DMA when a transfer's mean copy (after merging runs) is at least this
many bytes (confirmed on an H200; see the module docstring)."""

# Copy words, widest first. complex128 serves only as a 16-byte container: the index
# kernels move it without arithmetic, so every bit pattern (NaN payloads included)
# survives; tests round-trip such patterns.
_WORDS = (
    (16, torch.complex128),
    (8, torch.int64),
    (4, torch.int32),
    (2, torch.int16),
    (1, torch.uint8),
)


class CopyBackend(Protocol):
    name: str

    @property
    def uses_current_stream(self) -> bool:
        """Whether `enqueue` works on the current stream (torch kernels, `copy_`,
        allocations), so the stream must be made current around it."""
        ...

    def enqueue(self, mapping: Mapping, stream: Any, plan: CopyPlan | None) -> tuple[object, ...]:
        """Issue the copy of `mapping` (on `stream` where the device has streams);
        return what must stay alive until it is done."""
        ...


def _word(*values: int) -> tuple[int, torch.dtype]:
    """The widest element (16, 8, 4, 2 or 1 bytes) every offset and size is a multiple
    of: index kernels move one element per step, so wider elements move bytes faster."""
    for size, dtype in _WORDS:
        if all(v % size == 0 for v in values):
            return size, dtype
    raise AssertionError("unreachable: every int is a multiple of 1")


def _rows(storage_owner: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor of `dtype` over the whole storage of `storage_owner`."""
    base = torch.empty(0, dtype=dtype, device=storage_owner.device)
    return base.set_(storage_owner.untyped_storage())


@dataclass(frozen=True)
class _LayerMove:
    gpu: torch.Tensor  # [num_gpu_blocks, page // word]
    slab: torch.Tensor  # [num_slots * factor, page // word], rows sub_block_stride apart


class KernelCopy:
    """Gather/scatter kernels: per layer, `index_select` from the source rows and
    `index_copy_` into the destination rows; one index upload per transfer."""

    name = "kernel"
    uses_current_stream = True

    def __init__(
        self, groups: Sequence[Sequence[torch.Tensor]], slab: torch.Tensor, geometry: Geometry
    ) -> None:
        """`slab` is the primary slab itself on the CPU device, its device alias on
        CUDA."""
        self._device = slab.device
        self._moves = tuple(
            tuple(
                _layer_move(t, slab, offset, page, geometry)
                for t, offset, page in zip(
                    layers, geometry.layer_offsets(g), geometry.page_bytes[g]
                )
            )
            for g, layers in enumerate(groups)
        )

    def enqueue(self, mapping: Mapping, stream: Any, plan: CopyPlan | None) -> tuple[object, ...]:
        parts = [part for ids, rows in zip(mapping.gpu, mapping.rows) for part in (ids, rows)]
        host = torch.from_numpy(np.concatenate(parts) if parts else np.empty(0, np.int64))
        keep: tuple[object, ...] = ()
        indices = host
        if self._device.type == "cuda":  # CUDA only: one upload, on the lane's stream
            pinned = host.pin_memory()
            indices = pinned.to(self._device, non_blocking=True)
            keep = (pinned, indices)
        offset = 0
        for moves, ids in zip(self._moves, mapping.gpu):
            n = int(ids.size)
            gpu_ids = indices[offset : offset + n]
            slab_rows = indices[offset + n : offset + 2 * n]
            offset += 2 * n
            if not n:
                continue
            for move in moves:
                if mapping.direction == "store":
                    move.slab.index_copy_(0, slab_rows, move.gpu.index_select(0, gpu_ids))
                else:
                    move.gpu.index_copy_(0, gpu_ids, move.slab.index_select(0, slab_rows))
        return keep


def _layer_move(
    kv: torch.Tensor, slab: torch.Tensor, offset: int, page: int, geometry: Geometry
) -> _LayerMove:
    es = kv.element_size()
    gpu_offset = int(kv.storage_offset()) * es
    gpu_stride = int(kv.stride(0)) * es
    slab_offset = int(slab.storage_offset()) + offset
    stride = geometry.sub_block_stride
    word, dtype = _word(
        page,
        gpu_offset,
        gpu_stride,
        kv.untyped_storage().data_ptr(),
        slab_offset,
        stride,
        slab.untyped_storage().data_ptr(),
    )
    gpu = _rows(kv, dtype).as_strided(
        (int(kv.shape[0]), page // word), (gpu_stride // word, 1), gpu_offset // word
    )
    rows = geometry.num_slots * geometry.block_size_factor
    slab_rows = _rows(slab, dtype).as_strided(
        (rows, page // word), (stride // word, 1), slab_offset // word
    )
    return _LayerMove(gpu, slab_rows)


def group_tables(groups: Sequence[Sequence[torch.Tensor]], geometry: Geometry) -> list[GroupTable]:
    """Per group, each layer's page addresses: what the DMA plan is built from."""
    tables = []
    for g, layers in enumerate(groups):
        tables.append(
            GroupTable.of(
                gpu_base=[
                    t.untyped_storage().data_ptr() + int(t.storage_offset()) * t.element_size()
                    for t in layers
                ],
                gpu_stride=[int(t.stride(0)) * t.element_size() for t in layers],
                layer_offset=geometry.layer_offsets(g),
                page=geometry.page_bytes[g],
            )
        )
    return tables


class DmaCopy:
    """The copy engines: the transfer's `CopyPlan` in one batched memcpy (CUDA with
    cuda-bindings), else one `copy_` per run, else (CPU) `memmove` per copy."""

    name = "dma"

    def __init__(
        self,
        groups: Sequence[Sequence[torch.Tensor]],
        slab: torch.Tensor,
        geometry: Geometry,
        *,
        executor: DmaExecutorName,
        batch: BatchMemcpy | None,
    ) -> None:
        """`slab` is the host (pinned on CUDA) slab: DMA takes host addresses."""
        self._planner = Planner(
            group_tables(groups, geometry), SlabTable(slab.data_ptr(), geometry.sub_block_stride)
        )
        cuda = groups[0][0].device.type == "cuda"
        if executor == "auto":
            executor = ("batched" if batch is not None else "runs") if cuda else "memmove"
        if executor == "batched" and batch is None:
            raise ValueError("dma_executor='batched' needs cuda-bindings (tierkv[cuda])")
        if executor == "memmove" and cuda:
            raise ValueError("dma_executor='memmove' copies host memory only (CPU device)")
        self.executor: DmaExecutorName = executor
        self.uses_current_stream = executor != "batched"  # it is handed the stream
        self._batch = batch
        self._regions = [flat_bytes(t) for layers in groups for t in layers] + [flat_bytes(slab)]
        self._runs = RunCopies(self._regions) if executor == "runs" else None

    @property
    def batch_stats(self) -> BatchStats | None:
        return self._batch.stats if self.executor == "batched" and self._batch else None

    def plan(self, mapping: Mapping) -> CopyPlan:
        return self._planner.plan(mapping)

    def _by_runs(self, plan: CopyPlan) -> None:
        if self._runs is None:
            self._runs = RunCopies(self._regions)
        self._runs(plan)

    def enqueue(self, mapping: Mapping, stream: Any, plan: CopyPlan | None) -> tuple[object, ...]:
        plan = plan if plan is not None else self.plan(mapping)
        if self.executor == "batched":
            assert self._batch is not None
            # a driver call that fails is redone run by run for its copies only; the
            # next call, and the next transfer, are batched again
            return (*self._batch(plan, stream.cuda_stream, self._by_runs), plan)
        if self.executor == "runs":
            assert self._runs is not None
            self._runs(plan)
            return (plan,)
        memmove(plan)
        return ()
