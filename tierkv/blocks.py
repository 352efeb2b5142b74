"""Where the bytes of a `store` come from and where a `load` puts them.

The cache moves blocks between the primary slab and the caller through two small
protocols. `HostBlocks` implements both over host memory (a list of buffers, or a
`[n, block_bytes]` uint8 tensor); the GPU transfer worker provides another
implementation for KV caches on the device. Shapes and sizes are checked when the
adapter is built, before any slot is reserved, so a bad buffer changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import anyio
import torch

from tierkv.primary import HostSlab

_THREAD_THRESHOLD = 8 << 20  # copy in a worker thread above this many bytes per call
_ROW_COPY_BYTES = 64 << 10  # rows this large scatter faster one copy_ at a time


@runtime_checkable
class BlockSource(Protocol):
    """Blocks a `store` copies into primary slots."""

    def __len__(self) -> int: ...

    async def copy_to_slots(
        self, view: HostSlab, indices: Sequence[int], slots: Sequence[int]
    ) -> None:
        """Copy source block `indices[i]` into primary slot `slots[i]`."""
        ...


@runtime_checkable
class BlockDestination(Protocol):
    """Where a `load` copies blocks out of primary slots."""

    def __len__(self) -> int: ...

    async def copy_from_slots(
        self, view: HostSlab, indices: Sequence[int], slots: Sequence[int]
    ) -> None:
        """Copy primary slot `slots[i]` into destination block `indices[i]`."""
        ...


BufferLike = bytes | bytearray | memoryview | torch.Tensor


def _as_byte_view(obj: BufferLike, index: int, block_bytes: int, writable: bool) -> memoryview:
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu":
            raise ValueError(
                f"block {index} is on {obj.device}; host blocks must be CPU tensors "
                "(GPU KV caches go through the transfer worker)"
            )
        if not obj.is_contiguous():
            raise ValueError(f"block {index} is not a contiguous tensor")
        view = memoryview(obj.view(torch.uint8).reshape(-1).numpy())  # type: ignore[arg-type]
    else:
        view = memoryview(obj)
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if view.nbytes != block_bytes:
        raise ValueError(f"block {index} is {view.nbytes} bytes; blocks are {block_bytes} bytes")
    if writable and view.readonly:
        raise ValueError(f"destination block {index} is read-only")
    return view


def _run_of(values: Sequence[int]) -> int | None:
    """The first value when `values` is a run `v, v+1, ...`, else None."""
    if not values:
        return None
    first = values[0]
    if values[-1] - first != len(values) - 1:
        return None
    for offset, v in enumerate(values):
        if v != first + offset:
            return None
    return first


class HostBlocks:
    """Blocks in host memory: a sequence of buffers, or one `[n, block_bytes]` tensor.

    A 2-D contiguous CPU tensor is kept whole (no per-block wrapping) and copied with
    one `index_copy_` / `index_select` per call, which costs about the same for one
    block as for a thousand; anything else is wrapped block by block."""

    def __init__(
        self,
        blocks: Sequence[BufferLike] | torch.Tensor,
        block_bytes: int,
        *,
        writable: bool = False,
    ) -> None:
        self.block_bytes = block_bytes
        self._matrix: torch.Tensor | None = None
        self._views: list[memoryview] = []
        self._tensors: list[torch.Tensor | None] = []
        if isinstance(blocks, torch.Tensor):
            if blocks.dim() != 2:
                raise ValueError(
                    f"a block tensor must be 2-D [n, block_bytes]; got shape {tuple(blocks.shape)}"
                )
            if blocks.is_contiguous() and blocks.device.type == "cpu":
                row = int(blocks.shape[1]) * blocks.element_size()
                if blocks.shape[0] and row != block_bytes:
                    raise ValueError(f"block 0 is {row} bytes; blocks are {block_bytes} bytes")
                self._matrix = blocks.view(torch.uint8).reshape(int(blocks.shape[0]), row)
                self._count = int(blocks.shape[0])
                return
            items: Sequence[BufferLike] = list(blocks.unbind(0))
        else:
            items = blocks
        self._views = [_as_byte_view(b, i, block_bytes, writable) for i, b in enumerate(items)]
        # tensors are copied with torch (which releases the GIL), buffers with memoryview
        self._tensors = [
            b.view(torch.uint8).reshape(-1) if isinstance(b, torch.Tensor) else None for b in items
        ]
        self._count = len(self._views)

    def __len__(self) -> int:
        return self._count

    async def _run(self, fn: object, count: int) -> None:
        assert callable(fn)
        if count * self.block_bytes >= _THREAD_THRESHOLD:
            await anyio.to_thread.run_sync(fn)
        else:
            fn()

    async def copy_to_slots(
        self, view: HostSlab, indices: Sequence[int], slots: Sequence[int]
    ) -> None:
        matrix = self._matrix
        if matrix is not None:

            def copy_matrix() -> None:
                start = _run_of(indices)
                src = (
                    matrix[start : start + len(indices)]
                    if start is not None
                    else matrix.index_select(0, torch.tensor(indices, dtype=torch.long))
                )
                first = _run_of(slots)
                if first is not None:
                    view.tensor[first : first + len(slots)].copy_(src)
                elif self.block_bytes >= _ROW_COPY_BYTES:  # index_copy_ is slow on big rows
                    slab = view.tensor
                    for row, slot in enumerate(slots):
                        slab[slot].copy_(src[row])
                else:
                    view.tensor.index_copy_(0, torch.tensor(slots, dtype=torch.long), src)

            await self._run(copy_matrix, len(slots))
            return

        def copy() -> None:
            for i, slot in zip(indices, slots):
                tensor = self._tensors[i]
                if tensor is not None:
                    view.tensor[slot].copy_(tensor)
                else:
                    view.block(slot)[:] = self._views[i]

        await self._run(copy, len(slots))

    async def copy_from_slots(
        self, view: HostSlab, indices: Sequence[int], slots: Sequence[int]
    ) -> None:
        matrix = self._matrix
        if matrix is not None:

            def copy_matrix() -> None:
                first = _run_of(slots)
                start = _run_of(indices)
                if first is not None and start is not None:
                    matrix[start : start + len(indices)].copy_(
                        view.tensor[first : first + len(slots)]
                    )
                    return
                slot_index = torch.tensor(slots, dtype=torch.long)
                if start is not None:
                    torch.index_select(
                        view.tensor, 0, slot_index, out=matrix[start : start + len(indices)]
                    )
                else:
                    matrix.index_copy_(
                        0,
                        torch.tensor(indices, dtype=torch.long),
                        view.tensor.index_select(0, slot_index),
                    )

            await self._run(copy_matrix, len(slots))
            return

        def copy() -> None:
            for i, slot in zip(indices, slots):
                tensor = self._tensors[i]
                if tensor is not None:
                    tensor.copy_(view.tensor[slot])
                else:
                    self._views[i][:] = view.block(slot)

        await self._run(copy, len(slots))


def as_source(obj: object, count: int, block_bytes: int) -> BlockSource:
    """`obj` as a `BlockSource` of exactly `count` blocks, or ValueError."""
    source: BlockSource = (
        obj if isinstance(obj, BlockSource) else HostBlocks(obj, block_bytes)  # type: ignore[arg-type]
    )
    if len(source) != count:
        raise ValueError(f"{count} keys but {len(source)} source blocks")
    return source


def as_destination(obj: object, count: int, block_bytes: int) -> BlockDestination:
    """`obj` as a `BlockDestination` of exactly `count` blocks, or ValueError."""
    dest: BlockDestination = (
        obj if isinstance(obj, BlockDestination) else HostBlocks(obj, block_bytes, writable=True)  # type: ignore[arg-type]
    )
    if len(dest) != count:
        raise ValueError(f"{count} keys but {len(dest)} destination blocks")
    return dest
