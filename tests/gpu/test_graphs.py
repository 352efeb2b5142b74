"""Small transfers replayed from captured launches (`tierkv.gpu.graphs`): the slot
ring's bookkeeping with fake events, and, on CPU, the whole path with each "graph" a
launch of the interpreted kernel bound to its slot's buffer, so the ids the host
writes into a slot are what the kernel reads. On a GPU the captured graphs run under
`-m cuda` (here and in test_worker.py, through `auto`)."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest
import torch

from tests.gpu.test_worker import Rig, need_triton, run
from tierkv.gpu import TransferSpec
from tierkv.gpu.bounded import BoundedKernelCopy
from tierkv.gpu.graphs import GRAPH_MAX_BLOCKS, GraphTable, Slot, SlotRing
from tierkv.gpu.options import Backends

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class FakeDone:
    """A transfer's completion stand-in: done when the test says so."""

    def __init__(self, done: bool = False) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def fake_slot(n: int, replayed: list[tuple[Any, list[int]]]) -> Slot:
    view = np.zeros(2 * n, np.int64)
    return Slot(view, lambda stream: replayed.append((stream, view.tolist())))


def test_a_ring_hands_out_its_slots_in_turn_and_skips_those_in_flight() -> None:
    slots = [fake_slot(1, []) for _ in range(3)]
    ring = SlotRing(slots)
    first = ring.take()
    assert first is slots[0]
    assert ring.take() is slots[1], "a taken slot is not handed out before its release"
    first_done = FakeDone()
    first.release(first_done)  # replayed, its transfer not finished
    slots[1].taken = False  # taken, never replayed
    assert ring.take() is slots[2]
    assert ring.take() is slots[1], "slot 0 is in flight, slot 2 taken: skipped"
    slots[1].release(FakeDone())
    slots[2].release(FakeDone())
    assert ring.take() is None, "all three in flight"
    first_done.done = True
    assert ring.take() is first


def test_an_empty_ring_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one slot"):
        SlotRing([])


def test_a_table_writes_ids_then_rows_replays_and_records() -> None:
    replayed: list[tuple[Any, list[int]]] = []
    slots = [fake_slot(2, replayed) for _ in range(2)]
    table = GraphTable({(0, False, 2): SlotRing(slots)})
    stream = object()
    assert table.launch(0, False, np.array([7, 3]), np.array([1, 0]), stream) is slots[0]
    assert replayed == [(stream, [7, 3, 1, 0])]
    assert slots[0].taken, "taken until the worker hands it the transfer's completion"
    slots[0].release(FakeDone())
    # no graph of that size, or of that direction: the caller launches itself
    assert table.launch(0, False, np.array([7]), np.array([1]), stream) is None
    assert table.launch(0, True, np.array([7, 3]), np.array([1, 0]), stream) is None
    assert table.launch(0, False, np.array([4, 5]), np.array([2, 3]), stream) is slots[1]
    assert table.launch(0, False, np.array([4, 5]), np.array([2, 3]), stream) is None
    assert (table.replays, table.busy) == (2, 1), "both slots in flight: the third is busy"
    assert len(replayed) == 2


def test_a_replay_that_fails_leaves_its_slot_free_and_raises() -> None:
    def broken(stream: Any) -> None:
        raise RuntimeError("cuGraphLaunch failed with CUresult 1")

    slot = Slot(np.zeros(2, np.int64), broken)
    table = GraphTable({(0, True, 1): SlotRing([slot])})
    with pytest.raises(RuntimeError, match="CUresult 1"):
        table.launch(0, True, np.array([1]), np.array([0]), None)
    assert slot.free() and slot.done is None


def bind_slots(backend: BoundedKernelCopy, groups: int, slots: int) -> GraphTable:
    """The CPU stand-in for `capture_small`: each slot's replay launches the
    interpreted kernel at the slot's own buffer, as a captured graph would."""
    rings = {}
    for g in range(groups):
        for store in (True, False):
            for n in range(1, GRAPH_MAX_BLOCKS + 1):
                ring = []
                for _ in range(slots):
                    buffer = torch.zeros(2 * n, dtype=torch.int64)

                    def replay(
                        stream: Any,
                        b: torch.Tensor = buffer,
                        n: int = n,
                        g: int = g,
                        s: bool = store,
                    ) -> None:
                        backend._capture(b.data_ptr(), n, g, s)

                    ring.append(Slot(buffer.numpy(), replay, keep=(buffer,)))
                rings[(g, store, n)] = SlotRing(ring)
    return GraphTable(rings)


def graph_rig(slots: int = 2) -> tuple[Rig, BoundedKernelCopy, GraphTable]:
    need_triton()
    rig = Rig(torch.device("cpu"), [[64, 96], [32]], factor=2, copy=("bounded", "auto"))
    backend = rig.worker._backends.small
    assert isinstance(backend, BoundedKernelCopy)
    backend.graphs = bind_slots(backend, 2, slots)
    return rig, backend, backend.graphs


@pytest.mark.parametrize("direction", ["store", "load"])
async def test_small_transfers_move_through_their_slots_byte_for_byte(direction: str) -> None:
    rig, backend, graphs = graph_rig()
    assert not backend.uses_current_stream  # it is handed the stream
    for blocks, slots, other in (([5], [3], 7), ([2, 9, 4], [0, 1], 6), ([11], [6], 2)):
        spec = TransferSpec(direction, [blocks, blocks[:1]], [slots, [other]], [1, 0])  # type: ignore[arg-type]
        assert backend.replays(rig.worker._prepare(spec, None)[0])
        assert (await run(rig, spec)).backend == "bounded"
    assert graphs.replays == 6, "two groups per transfer, each from a graph"


async def test_a_transfer_larger_than_the_graphs_or_with_every_slot_busy_launches_directly() -> (
    None
):
    rig, backend, graphs = graph_rig(slots=1)
    blocks = list(range(GRAPH_MAX_BLOCKS + 1))
    spec = TransferSpec("load", [blocks, [0]], [[0, 1, 2], [4]], [0, 0])
    assert not backend.replays(rig.worker._prepare(spec, None)[0])
    await run(rig, spec)
    assert (graphs.replays, graphs.busy) == (1, 0), "group 1's one block is replayed"
    for ring in graphs.rings.values():  # every slot in flight: launched the usual way
        for slot in ring._slots:
            slot.release(FakeDone())
    await run(rig, TransferSpec("store", [[3], [1]], [[2], [5]], [1, 0]))
    assert (graphs.replays, graphs.busy) == (1, 2)


class Pending:
    """The CPU device's streams, but every copy's completion stays pending until the
    test finishes it: what a queued CUDA kernel looks like to the host."""

    asynchronous = False

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.completions: list[FakeDone] = []

    def new_stream(self) -> Any:
        return self.inner.new_stream()

    def order_after(self, stream: Any, ready: Any) -> None:
        return None

    def launch(self, stream: Any, work: Any, *, current: bool = True) -> Any:
        self.inner.launch(stream, work, current=current)
        done = FakeDone()
        done.event = None  # type: ignore[attr-defined]
        done.seconds = lambda: 0.0  # type: ignore[attr-defined]
        done.started = lambda: True  # type: ignore[attr-defined]
        self.completions.append(done)
        return done


def test_a_replayed_slot_waits_for_its_transfers_completion_not_an_event_of_its_own() -> None:
    """The worker hands each replayed slot the completion of the transfer that used
    it: until that copy is done the slot is not reused (the next transfer of the size
    falls back), and once it is, it is."""
    rig, _backend, graphs = graph_rig(slots=1)
    streams = Pending(rig.worker._streams)
    rig.worker._streams = streams  # type: ignore[assignment]
    spec = TransferSpec("load", [[5], []], [[3], []], [0, 0])
    rig.worker.submit(spec)
    slot = graphs.rings[(0, False, 1)]._slots[0]
    assert slot.done is streams.completions[0] and not slot.taken
    rig.worker.submit(spec)
    assert (graphs.replays, graphs.busy) == (1, 1), "its copy is pending: not reused"
    streams.completions[0].done = True
    rig.worker.submit(spec)
    assert (graphs.replays, graphs.busy) == (2, 1)
    assert slot.done is streams.completions[2]


def test_auto_sends_what_a_graph_replays_to_the_bounded_kernel_and_the_rest_by_size() -> None:
    rig, backend, _graphs = graph_rig()
    dma_rig = Rig(torch.device("cpu"), [[64, 96], [32]], factor=2, copy=("dma", "memmove"))
    dma = dma_rig.worker._backends.dma
    assert dma is not None
    planned: list[int] = []
    plan = dma.plan

    def planning(mapping: Any) -> Any:
        planned.append(mapping.num_blocks)
        return plan(mapping)

    dma.plan = planning  # type: ignore[method-assign]
    backends = Backends(backend, dma)
    small = rig.worker._prepare(TransferSpec("load", [[1], [2]], [[0], [1]], [0, 0]), None)[0]
    assert backends.pick(small) == (backend, None)
    assert planned == [], "replayed: no DMA plan is built to decide"
    large = rig.worker._prepare(
        TransferSpec("load", [list(range(6)), [0]], [[0, 1, 2], [3]], [0, 0]), None
    )[0]
    assert backends.pick(large) == (backend, None), "64-byte pages: too small for DMA"
    assert planned == [7], "not replayed: decided by the plan's copy sizes"


# -- on a GPU: the captured graphs themselves ------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("copy_backend", ["bounded", "auto"])
def test_a_cuda_worker_captures_its_small_launches(copy_backend: str) -> None:
    need_triton()
    rig = Rig(
        torch.device("cuda"),
        [[64 << 10] * 4, [16 << 10] * 2],
        factor=1,
        copy=(copy_backend, "auto"),
    )
    backend = rig.worker._backends.small
    assert isinstance(backend, BoundedKernelCopy)
    assert backend.graphs is not None, "capturing failed (see the log)"
    assert len(backend.graphs.rings) == 2 * 2 * GRAPH_MAX_BLOCKS
    rig.worker.close()


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("copy_backend", ["bounded", "auto"])
async def test_back_to_back_small_transfers_reuse_slots_only_when_done(copy_backend: str) -> None:
    """Three rounds of every slot, submitted without waiting: a slot whose kernel has
    not read its ids yet is never overwritten (its transfer falls back instead), and
    every block lands byte for byte."""
    need_triton()
    rig = Rig(
        torch.device("cuda"),
        [[16 << 10] * 8],
        factor=1,
        num_gpu_blocks=64,
        num_slots=48,
        copy=(copy_backend, "auto"),
    )
    backend = rig.worker._backends.small
    assert isinstance(backend, BoundedKernelCopy) and backend.graphs is not None
    gen = torch.Generator().manual_seed(3)
    state = rig.snapshot()
    handles = []
    for i in range(3 * 8):
        n = 1 + i % 3
        direction = "load" if i % 2 else "store"
        gpu = torch.randperm(64, generator=gen)[:n].tolist()
        slots = torch.randperm(48, generator=gen)[:n].tolist()
        spec = TransferSpec(direction, [gpu], [slots], [0])  # type: ignore[arg-type]
        state = rig.expected(spec, state)
        handles.append(rig.worker.submit(spec))
    for handle in handles:
        await rig.worker.wait(handle)
    rig.assert_holds(state)
    assert backend.graphs.replays + backend.graphs.busy == 24
    assert backend.graphs.replays >= 8
    rig.worker.close()


@pytest.mark.cuda
@cuda
def test_capturing_survives_other_workers_graphs_collected_as_garbage() -> None:
    """`tierkv bench --gpu` builds worker after worker; a collection during a capture
    freed an old worker's graphs, which CUDA forbids while the thread captures, and
    the capture failed. With collections as often as possible, every capture holds."""
    need_triton()
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        for _ in range(3):
            rig = Rig(torch.device("cuda"), [[16 << 10] * 2], factor=1, copy=("bounded", "auto"))
            backend = rig.worker._backends.small
            assert isinstance(backend, BoundedKernelCopy) and backend.graphs is not None
            garbage: list[Any] = [rig]
            garbage.append(garbage)  # a cycle: freed only by a collection
            del rig, backend, garbage
    finally:
        gc.set_threshold(*threshold)
