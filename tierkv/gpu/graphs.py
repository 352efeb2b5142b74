"""Small transfers of the bounded kernel replayed from captured CUDA graphs.

Why: a one-block load is 32 pages and ~2 MiB, ~40 us on a PCIe Gen5 link, but issuing
the Triton kernel from Python costs about as much again (the launcher binds and checks
its arguments, torch's stream context is entered around it, a pinned buffer is
allocated for the block ids). The kernel reads the block ids from host memory over
the bus (`tierkv.gpu.triton_pages`), so a launch whose only varying inputs are the
ids can be captured once and replayed: the host then writes the ids into the
captured buffer and makes one driver call, `cuGraphLaunch(exec, stream)`.

One graph per (group, direction, block count up to `GRAPH_MAX_BLOCKS`, slot): each slot
owns a pinned buffer of its block count's ids and rows, captured into its graph. A
replayed slot stays taken until the worker hands it the completion of the transfer it
moved (`Slot.release`: the transfer's end event, so no event of its own is recorded),
and is taken again only once that completion is done, so the host never overwrites
ids a queued kernel has yet to read (`SlotRing`). When every slot of a size is still
in flight, or a transfer is larger, the caller launches the kernel the ordinary way.

CUDA only; the ring's bookkeeping is plain Python and tested on CPU with fake events.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from tierkv.gpu.driver_calls import driver_entry

logger = logging.getLogger(__name__)

GRAPH_MAX_BLOCKS = 4
"""Block counts (per group) that get captured graphs: 1 to this. Decode-time and
short-prefix loads are one or a few blocks; larger transfers are long enough that the
launch's host cost no longer matters next to their bytes."""

GRAPH_SLOTS = 8
"""Graphs per (group, direction, block count): how many such transfers may be queued
at once before the next one falls back to an ordinary launch."""

_ABI_GRAPH_LAUNCH = 10000  # cuGraphLaunch exists since CUDA 10.0
GraphLaunch = Callable[[int, int], int]
"""`cuGraphLaunch(exec, stream) -> CUresult`."""


class Done(Protocol):
    """What a slot waits on before its ids may be overwritten: the completion of the
    transfer that last replayed it (its end event on CUDA)."""

    def query(self) -> bool: ...


@dataclass(eq=False)
class Slot:
    """One captured launch: its ids buffer (`view`: block ids then slab rows), how to
    replay it, and the completion of its last replay (`done`: None before the first;
    `taken`: from `SlotRing.take` until `release` hands it that completion)."""

    view: np.ndarray
    replay: Callable[[Any], None]
    done: Done | None = None
    taken: bool = False
    keep: tuple[object, ...] = ()  # the pinned buffer and the graph, alive with the slot

    def free(self) -> bool:
        return not self.taken and (self.done is None or self.done.query())

    def release(self, done: Done) -> None:
        """The transfer this slot's last replay belongs to ends with `done`: the slot
        may be taken again once it is."""
        self.done = done
        self.taken = False


class SlotRing:
    """Slots of one (group, direction, block count), taken in turn. `take` returns the
    next slot whose last replay has completed, or None when all are in flight."""

    def __init__(self, slots: Sequence[Slot]) -> None:
        if not slots:
            raise ValueError("a slot ring needs at least one slot")
        self._slots = list(slots)
        self._next = 0
        self._lock = threading.Lock()  # both a lane's caller and its submitter may launch

    def take(self) -> Slot | None:
        with self._lock:
            for step in range(len(self._slots)):
                i = (self._next + step) % len(self._slots)
                slot = self._slots[i]
                if slot.free():
                    slot.taken = True
                    self._next = (i + 1) % len(self._slots)
                    return slot
            return None

    def __len__(self) -> int:
        return len(self._slots)


class GraphTable:
    """Every captured small launch of one worker: `launch` replays the one for a
    group's ids on `stream` and returns its slot (taken until `Slot.release`), or
    returns None (no graph of that size, or every slot of it in flight) and the caller
    launches the kernel itself. `rings[(group, store, n)]` holds the slots; `replays`
    and `busy` count what happened."""

    def __init__(self, rings: dict[tuple[int, bool, int], SlotRing]) -> None:
        self.rings = rings
        self.replays = 0
        self.busy = 0  # a graph of the size existed, but every slot was in flight

    def covers(self, group: int, store: bool, n: int) -> bool:
        return (group, store, n) in self.rings

    def launch(
        self, group: int, store: bool, ids: np.ndarray, rows: np.ndarray, stream: Any
    ) -> Slot | None:
        n = int(ids.size)
        ring = self.rings.get((group, store, n))
        if ring is None:
            return None
        slot = ring.take()
        if slot is None:
            self.busy += 1
            return None
        try:
            slot.view[:n] = ids
            slot.view[n:] = rows
            slot.replay(stream)
        except BaseException:
            slot.taken = False  # nothing was queued: the ids may be overwritten
            raise
        self.replays += 1
        return slot


def load_graph_launch() -> GraphLaunch | None:
    """The driver's `cuGraphLaunch` called through ctypes (about a microsecond), or
    None where cuda-bindings or the entry point is missing (then graphs replay through
    torch, inside a stream context)."""
    signature = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
    function: GraphLaunch | None = driver_entry("cuGraphLaunch", signature, _ABI_GRAPH_LAUNCH)
    return function


Capture = Callable[[int, int, int, bool], None]
"""`capture(ids_address, n_blocks, group, store)`: launch the kernel once, on the
current (capturing) stream, reading `n_blocks` ids and rows at `ids_address`."""


def capture_graphs(
    capture: Capture,
    num_groups: int,
    device: torch.device,
    *,
    max_blocks: int = GRAPH_MAX_BLOCKS,
    slots: int = GRAPH_SLOTS,
) -> GraphTable | None:
    """Capture every small launch of a worker (CUDA). Returns None, logged, where
    capturing fails (an old driver, a Triton that cannot be captured): the worker then
    launches every transfer the ordinary way."""
    launch = load_graph_launch()
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    rings: dict[tuple[int, bool, int], SlotRing] = {}
    # A garbage collection inside a capture may free another worker's graphs, and
    # destroying a graph is not permitted while this thread captures: the capture is
    # invalidated (seen in `tierkv bench --gpu`, which builds worker after worker).
    # Collect first, then keep the collector off until every graph is captured.
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        pool = torch.cuda.graph_pool_handle()  # one (empty: nothing allocates) for all
        torch.cuda.synchronize(device)
        for group in range(num_groups):
            for store in (True, False):
                for n in range(1, max_blocks + 1):
                    ring = [
                        _captured(capture, group, store, n, side, pool, launch)
                        for _ in range(slots)
                    ]
                    rings[(group, store, n)] = SlotRing(ring)
        torch.cuda.synchronize(device)
    except Exception as exc:
        logger.warning(
            "capturing the bounded kernel's small launches failed (%s); "
            "small transfers launch it directly",
            exc,
        )
        return None
    finally:
        if collecting:
            gc.enable()
    return GraphTable(rings)


def _captured(
    capture: Capture,
    group: int,
    store: bool,
    n: int,
    side: Any,
    pool: Any,
    launch: GraphLaunch | None,
) -> Slot:
    ids = torch.zeros(2 * n, dtype=torch.int64, pin_memory=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            capture(ids.data_ptr(), n, group, store)
        finally:
            graph.capture_end()
    handle = int(graph.raw_cuda_graph_exec()) if hasattr(graph, "raw_cuda_graph_exec") else 0
    if launch is not None and handle:

        def replay(stream: Any) -> None:
            status = launch(handle, stream.cuda_stream)
            if status != 0:
                raise RuntimeError(f"cuGraphLaunch failed with CUresult {status}")

    else:

        def replay(stream: Any) -> None:
            with torch.cuda.stream(stream):
                graph.replay()

    return Slot(ids.numpy(), replay, keep=(ids, graph))
