"""LMCache's memory objects as the slots of a tierkv primary, without a copy.

A tier reads and writes a block through `PrimaryView.block(slot)`, a writable
`memoryview`. LMCache hands an L2 adapter its L1 objects (`MemoryObj`) for each store
and load, each one's bytes reachable in place through `byte_array`. `LentSlots` is a
`PrimaryView` whose slots are not rows of one slab but the objects of the tasks now
running: a task lends its objects (`lend` gives each a slot number), the tier jobs
read or write them in place, and the task takes them back when it ends, after which
`block` refuses those slots (a tier that ignored its deadline cannot reach LMCache's
memory through the view any more). One view per object size, since a tier's blocks
are all one size.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import Any

from tierkv.contract.slab import PrimaryView

__all__ = ["LentSlots", "object_bytes"]

SLOT_RANGE = 1 << 31
"""Slot numbers wrap after this many lends (far more than can be lent at once)."""


def object_bytes(obj: Any) -> memoryview:
    """The bytes of an LMCache `MemoryObj` (its logical size), writable, in place."""
    view = memoryview(obj.byte_array)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


class LentSlots(PrimaryView):
    """A primary of `block_bytes`-sized slots lent by running tasks."""

    def __init__(self, block_bytes: int, namespace: str) -> None:  # no slab to check
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes <= 0:
            raise ValueError(f"block_bytes must be a positive int, got {block_bytes!r}")
        self._block_bytes = block_bytes
        self._num_blocks = SLOT_RANGE
        self.namespace = namespace
        self._lent: dict[int, memoryview] = {}
        self._numbers = itertools.count()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Slots lent now."""
        return len(self._lent)

    def lend(self, views: Sequence[memoryview]) -> list[int]:
        """A slot for each of `views` (each exactly `block_bytes` long)."""
        for view in views:
            if view.nbytes != self._block_bytes:
                raise ValueError(
                    f"an object of {view.nbytes} bytes lent as a {self._block_bytes}-byte slot"
                )
        with self._lock:
            slots = [next(self._numbers) % SLOT_RANGE for _ in views]
            self._lent.update(zip(slots, views))
        return slots

    def take_back(self, slots: Sequence[int]) -> None:
        with self._lock:
            for slot in slots:
                self._lent.pop(slot, None)

    def block(self, slot: int) -> memoryview:
        """The lent object's bytes, writable, without a copy."""
        view = self._lent.get(slot)
        if view is None:
            raise ValueError(f"slot {slot!r} is not lent by a running task (its task ended)")
        return view

    def release(self) -> None:
        """Forget every lent slot (the adapter closed)."""
        with self._lock:
            self._lent.clear()
