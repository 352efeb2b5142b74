"""What the engine asks the transfer worker to do (`TransferSpec`), what it gets back
(`TransferResult`), and the error for a request that does not fit (`TransferSpecError`).

Plain values with no device state, so the engine, the cache adapter (`KVCacheBlocks`) and
the tests build them without a worker.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, SupportsIndex, TypeAlias

import torch

from tierkv.contract.errors import TierKVError

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

Direction = Literal["store", "load"]
"""`store`: GPU -> primary slots. `load`: primary slots -> GPU."""

DIRECTIONS: tuple[Direction, ...] = ("store", "load")

BlockIds: TypeAlias = "Sequence[int] | torch.Tensor | npt.NDArray[np.integer[Any]]"
"""Block ids or slots: a sequence of ints, a 1-D integer tensor or a NumPy array (on
the host: ids on a GPU would force a synchronisation)."""


class TransferSpecError(TierKVError, ValueError):
    """A transfer spec does not fit the worker's geometry; nothing was copied."""


def non_negative_int(value: SupportsIndex, what: str) -> int:
    """`value` as an int >= 0 (bools and floats refused), or TransferSpecError."""
    try:
        number = operator.index(value)
    except TypeError:
        number = -1
    if isinstance(value, bool) or number < 0:
        raise TransferSpecError(f"{what} must be a non-negative int, got {value!r}")
    return number


@dataclass(frozen=True, eq=False)
class TransferSpec:
    """One job of the worker: per group, GPU block ids, primary slots, block index.

    `gpu_blocks[g]` are group `g`'s GPU block ids in token order; `slots[g]` the
    primary slots of the offloaded blocks they fall in, in order; `block_indices[g]`
    the position of `gpu_blocks[g][0]` in the request (or in its offloaded block),
    so `block_indices[g] % block_size_factor` leading sub-blocks of the first slot are
    skipped. A group with nothing to move has empty `gpu_blocks[g]` and `slots[g]`.
    """

    direction: Direction
    gpu_blocks: Sequence[BlockIds]
    slots: Sequence[BlockIds]
    block_indices: Sequence[SupportsIndex]

    def __post_init__(self) -> None:
        if self.direction not in DIRECTIONS:
            raise TransferSpecError(
                f"direction must be 'store' (GPU -> primary) or 'load' (primary -> GPU), "
                f"got {self.direction!r}"
            )
        for name in ("gpu_blocks", "slots", "block_indices"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes, torch.Tensor)) or not isinstance(value, Sequence):
                raise TransferSpecError(
                    f"{name} must be a sequence with one entry per group, "
                    f"got {type(value).__name__}"
                )
            object.__setattr__(self, name, tuple(value))
        lengths = {len(self.gpu_blocks), len(self.slots), len(self.block_indices)}
        if len(lengths) != 1:
            raise TransferSpecError(
                f"gpu_blocks, slots and block_indices must each have one entry per group; "
                f"got {len(self.gpu_blocks)}, {len(self.slots)} and "
                f"{len(self.block_indices)} entries"
            )


@dataclass(frozen=True)
class TransferResult:
    """What one submission did: GPU blocks and bytes moved, how long the copy took
    (device time between its start and end events on CUDA) and which copy backend
    moved the bytes (`kernel` or `dma`)."""

    transfer_id: int
    direction: Direction
    num_blocks: int
    num_bytes: int
    seconds: float
    backend: str = "kernel"

    @property
    def bytes_per_second(self) -> float:
        return self.num_bytes / self.seconds if self.seconds > 0 else math.inf
