"""Pinned host memory of exactly the size asked for.

`torch.empty(..., pin_memory=True)` goes through torch's caching host allocator,
which rounds each allocation up to the next power of two: an 80 GiB primary pins
128 GiB (vLLM notes the same). Here the slab is ordinary page-aligned anonymous
memory (an `mmap`), registered with the driver (`cudaHostRegister`) in chunks of whole
blocks, so no copy ever spans two registrations, and unregistered at `close`. Pinned
bytes = requested bytes.

Where CUDA is absent nothing is registered (the CPU path is the same memory, unpinned).
A registration the driver refuses falls back to torch's pinned allocator, with a
warning naming the cost. Unproven on a GPU so far: the CPU tests cover the chunking.
"""

from __future__ import annotations

import logging
import mmap
from typing import Any

import torch

logger = logging.getLogger(__name__)

MAX_REGISTRATION_BYTES = 1 << 30
"""Bytes per `cudaHostRegister` call at most (rounded down to whole blocks; a block
larger than this is one registration of its own)."""


def registration_chunks(
    num_blocks: int, block_bytes: int, max_bytes: int | None = None
) -> list[tuple[int, int]]:
    """(offset, length) of each registration over a slab of `num_blocks` blocks: whole
    blocks each, in order, covering the slab exactly once (at most `max_bytes`,
    default MAX_REGISTRATION_BYTES, unless one block is larger)."""
    if max_bytes is None:
        max_bytes = MAX_REGISTRATION_BYTES
    if num_blocks < 1 or block_bytes < 1 or max_bytes < 1:
        raise ValueError("num_blocks, block_bytes and max_bytes must be positive")
    per_chunk = max(1, max_bytes // block_bytes)
    return [
        (first * block_bytes, min(per_chunk, num_blocks - first) * block_bytes)
        for first in range(0, num_blocks, per_chunk)
    ]


class HostMemory:
    """A `num_blocks x block_bytes` uint8 tensor over page-aligned host memory,
    registered with CUDA (pinned) when `pin` is true."""

    def __init__(self, num_blocks: int, block_bytes: int, *, pin: bool) -> None:
        self.num_bytes = num_blocks * block_bytes
        self._map: mmap.mmap | None = mmap.mmap(-1, self.num_bytes)
        flat = torch.frombuffer(self._map, dtype=torch.uint8)
        self.tensor = flat.view(num_blocks, block_bytes)
        self._registered: list[int] = []
        self._fallback: torch.Tensor | None = None
        if pin:
            self._pin(num_blocks, block_bytes)

    @property
    def pinned_bytes(self) -> int:
        """Bytes pinned for this slab (exactly the slab when registered)."""
        if self._fallback is not None:
            return self.num_bytes  # requested; torch's allocator may hold more
        return self.num_bytes if self._registered else 0

    def _pin(self, num_blocks: int, block_bytes: int) -> None:
        cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        base = self.tensor.data_ptr()
        try:
            for offset, length in registration_chunks(num_blocks, block_bytes):
                status = cudart.cudaHostRegister(base + offset, length, 0)
                if int(status) != 0:
                    raise RuntimeError(f"cudaHostRegister returned {status}")
                self._registered.append(base + offset)
        except Exception as exc:
            self._unregister()
            logger.warning(
                "primary: registering the slab with CUDA failed (%s); pinning it with "
                "torch's allocator instead, which may pin up to twice its size",
                exc,
            )
            self._fallback = torch.empty_like(self.tensor, pin_memory=True)
            self.tensor = self._fallback

    def _unregister(self) -> None:
        if self._registered:
            cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            for address in reversed(self._registered):
                cudart.cudaHostUnregister(address)
            self._registered.clear()

    def close(self) -> None:
        """Unregister; the memory itself goes with the last reference to `tensor`."""
        self._unregister()
