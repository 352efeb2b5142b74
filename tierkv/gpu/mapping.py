"""Checks transfer specs against the geometry and turns them into a `Mapping`: per
group, which GPU blocks go to (or come from) which slab sub-rows.

A *sub-row* is one sub-block chunk of a slot: `slot * block_size_factor + sub_block`.
GPU block `k` of a spec's group `g` maps to sub-row
`slots[g][(head + k) // factor] * factor + (head + k) % factor`, `head =
block_indices[g] % factor`. Several specs of one direction form one mapping (one
submission); every check runs over all of them before any byte moves. NumPy only: a
few vector operations per group, no per-block Python work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from tierkv.gpu.geometry import Geometry
from tierkv.gpu.spec import (
    BlockIds,
    Direction,
    TransferSpec,
    TransferSpecError,
    non_negative_int,
)

Ids = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Mapping:
    """Per group: GPU block ids and the slab sub-rows they pair with, in order."""

    direction: Direction
    gpu: tuple[Ids, ...]
    rows: tuple[Ids, ...]
    num_blocks: int
    num_bytes: int


_INT_TENSOR_DTYPES = frozenset(
    getattr(torch, name)
    for name in ("int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64")
    if hasattr(torch, name)
)


_FEW_IDS = 8
"""A host tensor of at most this many ids is read through `tolist` (a third of the
cost of `numpy` plus a cast for the one-block transfers of decode steps)."""


def as_ids(what: str, values: BlockIds, limit: int) -> Ids:
    """`values` as a 1-D int64 array of ids in `0..limit-1`, or TransferSpecError."""
    if isinstance(values, torch.Tensor):
        if not values.is_cpu:
            raise TransferSpecError(f"{what}: pass ids on the host, not on {values.device}")
        if values.dtype not in _INT_TENSOR_DTYPES:
            raise TransferSpecError(
                f"{what}: expected a 1-D sequence of ints, got dtype {values.dtype} "
                f"shape {tuple(values.shape)}"
            )
        if values.dim() == 1 and values.numel() <= _FEW_IDS:
            few: list[int] = values.tolist()
            if few and (min(few) < 0 or max(few) >= limit):
                bad = min(few) if min(few) < 0 else max(few)
                raise TransferSpecError(f"{what}: {bad} is out of range 0..{limit - 1}")
            return np.array(few, dtype=np.int64)
        array: npt.NDArray[Any] = values.numpy()  # integer tensors carry no grad
    elif not isinstance(values, np.ndarray) and len(values) == 0:
        return np.empty(0, dtype=np.int64)
    else:
        try:
            array = np.asarray(values)
        except (TypeError, ValueError) as exc:
            raise TransferSpecError(f"{what}: not a sequence of ints ({exc})") from None
    if array.dtype.kind not in "iub":
        if array.dtype.kind in "fc":
            raise TransferSpecError(
                f"{what}: expected a 1-D sequence of ints, got dtype {array.dtype} "
                f"shape {array.shape}"
            )
        raise TransferSpecError(f"{what}: not a sequence of ints (dtype {array.dtype})")
    if array.ndim != 1 or array.dtype.kind == "b":
        raise TransferSpecError(
            f"{what}: expected a 1-D sequence of ints, got dtype {array.dtype} shape {array.shape}"
        )
    size = array.size
    if size:
        # one block (what decode steps move) needs no reductions
        low, high = (int(array[0]),) * 2 if size == 1 else (int(array.min()), int(array.max()))
        if low < 0 or high >= limit:
            bad = low if low < 0 else high
            raise TransferSpecError(f"{what}: {bad} is out of range 0..{limit - 1}")
    return array.astype(np.int64, copy=False)


def map_specs(specs: Sequence[TransferSpec], geometry: Geometry) -> Mapping:
    """Check `specs` (one direction) against `geometry` and map them; raises
    TransferSpecError before anything is copied."""
    if not specs:
        raise TransferSpecError("nothing to transfer: give at least one TransferSpec")
    for spec in specs:
        if not isinstance(spec, TransferSpec):
            raise TransferSpecError(f"expected a TransferSpec, got {type(spec).__name__}")
    direction = specs[0].direction
    if len(specs) > 1 and any(spec.direction != direction for spec in specs):
        raise TransferSpecError("one submission moves one direction; split stores from loads")
    groups = geometry.num_groups
    factor = geometry.block_size_factor
    gpu_parts: list[list[Ids]] = [[] for _ in range(groups)]
    row_parts: list[list[Ids]] = [[] for _ in range(groups)]
    slot_parts: list[Ids] = []
    num_blocks = num_bytes = 0
    for spec in specs:
        if len(spec.gpu_blocks) != groups:
            raise TransferSpecError(
                f"the spec names {len(spec.gpu_blocks)} groups but the worker has "
                f"{groups}; give every group an entry (empty when it moves nothing)"
            )
        for g in range(groups):
            index = non_negative_int(spec.block_indices[g], f"block_indices[{g}]")
            gpu = as_ids(f"gpu_blocks[{g}]", spec.gpu_blocks[g], geometry.num_gpu_blocks[g])
            slots = as_ids(f"slots[{g}]", spec.slots[g], geometry.num_slots)
            n, head = gpu.size, index % factor
            spans = -(-(head + n) // factor) if n else 0
            if slots.size != spans:
                raise TransferSpecError(
                    f"group {g}: {n} GPU blocks starting at sub-block {head} "
                    f"(block_indices[{g}]={index} % block_size_factor {factor}) span {spans} "
                    f"offloaded blocks, but {slots.size} slots were given"
                )
            gpu_parts[g].append(gpu)
            row_parts[g].append(_rows(slots, head, n, factor))
            slot_parts.append(slots)
            num_blocks += n
            num_bytes += n * geometry.group_block_bytes(g)
    gpu_ids = tuple(_cat(parts) for parts in gpu_parts)
    rows = tuple(_cat(parts) for parts in row_parts)
    if direction == "load":
        for g, ids in enumerate(gpu_ids):
            if ids.size > 1 and np.unique(ids).size != ids.size:
                raise TransferSpecError(
                    f"gpu_blocks[{g}]: a GPU block appears twice; a load would write it twice"
                )
    else:
        every = _cat(slot_parts)
        if every.size > 1 and np.unique(every).size != every.size:
            raise TransferSpecError(
                "slots: a slot appears twice (within or across groups); a store would "
                "write it twice"
            )
    return Mapping(direction, gpu_ids, rows, int(num_blocks), int(num_bytes))


def _rows(slots: Ids, head: int, n: int, factor: int) -> Ids:
    """The sub-rows of `n` GPU blocks starting at sub-block `head` of `slots[0]`."""
    if factor == 1:  # one GPU block per offloaded block (head is 0): the slots are the rows
        return slots
    position = np.arange(head, head + n, dtype=np.int64)
    return slots[position // factor] * factor + position % factor


def _cat(parts: list[Ids]) -> Ids:
    if not parts:
        return np.empty(0, dtype=np.int64)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)
