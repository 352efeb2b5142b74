"""Pinned host memory of exactly the size asked for.

`torch.empty(..., pin_memory=True)` goes through torch's caching host allocator,
which rounds each allocation up to the next power of two: an 80 GiB primary pins
128 GiB (vLLM notes the same). Here the slab is ordinary page-aligned anonymous
memory (an `mmap`), registered with the driver (`cudaHostRegister`) in chunks of whole
blocks, so no copy ever spans two registrations, and unregistered at `close`. Pinned
bytes = requested bytes.

Where CUDA is absent nothing is registered (the CPU path is the same memory, unpinned).
A registration the driver refuses falls back to torch's pinned allocator, with a
warning naming the cost. Measured on an H200 (`benchmarks/gpu_pinning.py`): a 24 GiB
primary takes 24.5 GiB of `MemAvailable`, torch's `empty(24GiB, pin_memory=True)`
32.5 GiB; both copy 1 GiB to and from the GPU at 55 GB/s.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import weakref
from collections.abc import Callable
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
    registered with CUDA (pinned) when `pin` is true.

    The registration lives exactly as long as the memory: `close` ends it, and so does
    the last reference to `tensor` going away, before the memory is unmapped. A range
    unmapped while still registered stays registered in the driver, and the next
    mapping at that address (a later primary) could not be registered: measured on an
    H200, every later slab fell back to torch's allocator."""

    def __init__(self, num_blocks: int, block_bytes: int, *, pin: bool) -> None:
        self.num_bytes = num_blocks * block_bytes
        region = mmap.mmap(-1, self.num_bytes)
        # the tensor keeps `exporter` alive; when the last tensor goes, the finalizer
        # (which holds the region) unregisters first, then unmaps
        exporter = memoryview(region)
        self.tensor = torch.frombuffer(exporter, dtype=torch.uint8).view(num_blocks, block_bytes)
        self._registered: list[int] = []
        self._fallback: torch.Tensor | None = None
        finalizer = weakref.finalize(exporter, _release, region, self._registered)
        finalizer.atexit = False  # at exit the process's memory goes anyway
        del exporter
        if pin:
            self._pin(num_blocks, block_bytes)

    @property
    def pinned_bytes(self) -> int:
        """Bytes pinned for this slab (exactly the slab when registered)."""
        if self._fallback is not None:
            return self.num_bytes  # requested; torch's allocator may hold more
        return self.num_bytes if self._registered else 0

    @property
    def registered(self) -> bool:
        """Whether the slab is pinned by registration (not by torch's allocator)."""
        return bool(self._registered)

    def _pin(self, num_blocks: int, block_bytes: int) -> None:
        base = self.tensor.data_ptr()
        try:
            for offset, length in registration_chunks(num_blocks, block_bytes):
                register(base + offset, length)
                self._registered.append(base + offset)
        except Exception as exc:
            _unregister(self._registered)
            logger.warning(
                "primary: registering the slab with CUDA failed (%s); pinning it with "
                "torch's allocator instead, which may pin up to twice its size",
                exc,
            )
            self._fallback = torch.empty_like(self.tensor, pin_memory=True)
            self.tensor = self._fallback

    def close(self) -> None:
        """Unregister; the memory itself goes with the last reference to `tensor`."""
        _unregister(self._registered)


def register(address: int, length: int) -> None:
    """`cudaHostRegister` of `[address, address + length)`; raises RuntimeError naming
    the CUDA error, after clearing it (see `clear_last_error`)."""
    cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    status = cudart.cudaHostRegister(address, length, 0)
    if int(status) != 0:
        clear_last_error()
        raise RuntimeError(f"cudaHostRegister returned CUDA error {int(status)} ({status})")


def _unregister(registered: list[int]) -> None:
    if registered:
        cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        for address in reversed(registered):
            if int(cudart.cudaHostUnregister(address)) != 0:
                clear_last_error()
        registered.clear()


def _release(region: mmap.mmap, registered: list[int]) -> None:
    """The last tensor over `region` is gone: unregister, then unmap."""
    _unregister(registered)
    region.close()


def clear_last_error() -> None:
    """Reset the CUDA runtime's "last error" after a failed call we handled.

    A failed runtime call such as `cudaHostRegister` stays recorded as the thread's last
    error, and torch's check after its next kernel launch reports it as that kernel's
    failure (seen on an H200: "part or all of the requested memory range is already
    mapped" from an unrelated `fill_`). torch exposes no `cudaGetLastError`, so it is
    called in the runtime library torch loaded."""
    get_last_error = _runtime_get_last_error()
    if get_last_error is None:
        logger.warning("cannot reset the CUDA runtime's last error: libcudart not found")
        return
    get_last_error()


@functools.cache
def _runtime_get_last_error() -> Callable[[], int] | None:
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libcudart.so" in line})
    except OSError:
        return None
    for path in paths:
        try:
            function: Callable[[], int] = ctypes.CDLL(path).cudaGetLastError
        except (OSError, AttributeError):
            continue
        return function
    return None
