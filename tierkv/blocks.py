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


class HostBlocks:
    """Blocks in host memory: a sequence of buffers, or one `[n, block_bytes]` tensor."""

    def __init__(
        self,
        blocks: Sequence[BufferLike] | torch.Tensor,
        block_bytes: int,
        *,
        writable: bool = False,
    ) -> None:
        items: Sequence[BufferLike]
        if isinstance(blocks, torch.Tensor):
            if blocks.dim() != 2:
                raise ValueError(
                    f"a block tensor must be 2-D [n, block_bytes]; got shape {tuple(blocks.shape)}"
                )
            items = list(blocks.unbind(0))
        else:
            items = blocks
        self._views = [_as_byte_view(b, i, block_bytes, writable) for i, b in enumerate(items)]
        # tensors are copied with torch (which releases the GIL), buffers with memoryview
        self._tensors = [
            b.view(torch.uint8).reshape(-1) if isinstance(b, torch.Tensor) else None for b in items
        ]
        self.block_bytes = block_bytes

    def __len__(self) -> int:
        return len(self._views)

    async def _run(self, fn: object, count: int) -> None:
        assert callable(fn)
        if count * self.block_bytes >= _THREAD_THRESHOLD:
            await anyio.to_thread.run_sync(fn)
        else:
            fn()

    async def copy_to_slots(
        self, view: HostSlab, indices: Sequence[int], slots: Sequence[int]
    ) -> None:
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
