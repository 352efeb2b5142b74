"""The primary slab as a tier sees it: fixed-size rows of writable host memory.

Part of the plugin contract, so it imports nothing heavy: a `PrimaryView` is built over
any writable, C-contiguous buffer (a `bytearray`, an `mmap`, a numpy array, the
`memoryview` vLLM hands its secondary tiers, the core's pinned torch slab). A tier
reads `block(slot)` on store and writes it on load; both are zero-copy views.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PrimaryView"]


class PrimaryView:
    """Slab geometry, the namespace, and a writable zero-copy `memoryview` per slot.

    The cache keeps a slot handed to a job protected until the job's result is taken;
    a tier never touches a slot after its job returned or was cancelled.
    """

    def __init__(self, buffer: Any, block_bytes: int, namespace: str) -> None:
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes <= 0:
            raise ValueError(f"block_bytes must be a positive int, got {block_bytes!r}")
        try:
            view = memoryview(buffer)
        except TypeError as exc:
            raise ValueError(
                f"the primary slab must be a buffer (bytearray, memoryview, array), "
                f"not {type(buffer).__name__}"
            ) from exc
        if view.readonly:
            raise ValueError("the primary slab must be writable")
        if not view.c_contiguous:
            raise ValueError("the primary slab must be C-contiguous")
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        if view.nbytes == 0 or view.nbytes % block_bytes:
            raise ValueError(
                f"the primary slab is {view.nbytes} bytes, not a positive multiple of "
                f"block_bytes={block_bytes}"
            )
        self._bytes = view
        self._block_bytes = block_bytes
        self._num_blocks = view.nbytes // block_bytes
        self.namespace = namespace

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    def block(self, slot: int) -> memoryview:
        """The bytes of `slot`, writable, without a copy."""
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self._num_blocks:
            raise IndexError(f"slot {slot!r} is out of range 0..{self._num_blocks - 1}")
        start = slot * self._block_bytes
        try:
            return self._bytes[start : start + self._block_bytes]
        except ValueError:
            raise ValueError(
                "the primary slab was released (its tier was shut down); "
                "no block of it can be read or written any more"
            ) from None

    def release(self) -> None:
        """Let go of the slab now, not when the last reference to this view dies.

        The owner of a slab it lends (vLLM unmaps its shared-memory primary at
        shutdown) can free it only once no view of it remains; an object that
        outlives the shutdown while holding this one (a tier, a test, a metrics
        exporter) must not keep it alive. Afterwards `block` raises ValueError.
        Idempotent. Views `block` handed out earlier stay valid until dropped: a tier
        never keeps one past its job."""
        try:
            self._bytes.release()
        except BufferError as exc:  # someone holds a buffer exported from our view
            raise BufferError(
                f"the primary slab cannot be released while a buffer taken from it is in use: {exc}"
            ) from None
