"""Ways to apply a DMA `CopyPlan`: each takes the same triples.

- `memmove` (CPU only): `ctypes.memmove` per copy. What the CPU tests run to prove the
  plan's address arithmetic byte for byte; not a fast path.
- `RunCopies`: one `copy_` per copy (a run of coalesced pages) between flat byte views
  of the memory regions the addresses fall in. The fallback where the batched CUDA
  call is missing; on CUDA each `copy_` between device and pinned host memory is an
  asynchronous DMA on the current stream.
- `tierkv.gpu.cuda_batch.BatchMemcpy`: the whole plan in one `cuMemcpyBatchAsync`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import torch

from tierkv.gpu.plan import CopyPlan


def memmove(plan: CopyPlan) -> None:
    """Apply `plan` on the host, copy by copy. Every address must be host memory."""
    for dst, src, size in zip(plan.dsts.tolist(), plan.srcs.tolist(), plan.sizes.tolist()):
        ctypes.memmove(dst, src, size)


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 tensor over the whole storage of `tensor`, on its device."""
    base = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return base.set_(tensor.untyped_storage())


class RunCopies:
    """Applies a plan with one `copy_` per copy, between flat byte views of `regions`
    (the KV caches' storages and the slab) that the plan's addresses fall in."""

    def __init__(self, regions: Sequence[torch.Tensor]) -> None:
        unique = {int(r.data_ptr()): r for r in regions}
        order = sorted(unique)
        self._regions = [unique[start] for start in order]
        self._starts = np.asarray(order, dtype=np.uint64)
        self._ends = np.asarray([start + unique[start].numel() for start in order], dtype=np.uint64)

    def _locate(self, addresses: np.ndarray, sizes: np.ndarray) -> tuple[list[int], list[int]]:
        which = np.searchsorted(self._starts, addresses, side="right") - 1
        if (which < 0).any() or (addresses + sizes > self._ends[which]).any():
            raise RuntimeError("a planned copy falls outside the KV caches and the slab")
        offsets = addresses - self._starts[which]
        return which.tolist(), offsets.tolist()

    def __call__(self, plan: CopyPlan) -> None:
        if not plan.count:
            return
        dst_region, dst_offset = self._locate(plan.dsts, plan.sizes)
        src_region, src_offset = self._locate(plan.srcs, plan.sizes)
        regions = self._regions
        for d, do, s, so, n in zip(
            dst_region, dst_offset, src_region, src_offset, plan.sizes.tolist()
        ):
            regions[d][do : do + n].copy_(regions[s][so : so + n], non_blocking=True)
