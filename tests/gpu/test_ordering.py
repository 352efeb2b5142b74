"""The ordering contract, driven on CPU by a fake CUDA device: streams are queues of
operations, events are recorded by them, and the device runs whatever is runnable,
preferring the streams a test names (an adversarial scheduler: a copy that is not
ordered after the engine's writes runs before them).

- A store submitted on the event loop thread, while the engine thread queued the new
  KV on its own stream, copies the new bytes when given `ready` (an event per call, or
  the engine stream per call or per worker), and stale bytes without it (the control).
- On CUDA a transfer without any `ready` is refused before anything is queued.
- A load hands back `done_event`: an engine stream that waits on it reads the loaded
  bytes, even when the model's work is queued before the copy ran.
- `KVCacheBlocks` passes its `ready` and keeps the last copy's `done_event`.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import pytest
import torch

from tierkv.gpu import TransferSpec, TransferSpecError, TransferWorker
from tierkv.gpu.kv_blocks import KVCacheBlocks
from tierkv.gpu.streams import Completion, is_stream
from tierkv.layout import GroupSpec, KVLayout
from tierkv.primary import PrimaryTier

pytestmark = pytest.mark.anyio

PAGE = 64


class FakeEvent:
    def __init__(self) -> None:
        self._done = threading.Event()
        self.pending = False  # recorded on a stream, not yet reached

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()


class FakeStream:
    def __init__(self, device: FakeDevice, name: str) -> None:
        self.device, self.name = device, name
        self.ops: deque[tuple[str, Any]] = deque()

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or FakeEvent()
        event.pending = True
        self.device.enqueue(self, ("record", event))
        return event

    def wait_event(self, event: FakeEvent) -> None:
        self.device.enqueue(self, ("wait", event))

    def wait_stream(self, other: FakeStream) -> None:
        self.wait_event(other.record_event())

    def run_later(self, fn: Callable[[], None]) -> None:
        self.device.enqueue(self, ("run", fn))


class FakeDevice:
    """Streams of queued operations; `run` executes them, respecting event waits."""

    def __init__(self) -> None:
        self.streams: list[FakeStream] = []
        self._lock = threading.Lock()

    def stream(self, name: str) -> FakeStream:
        stream = FakeStream(self, name)
        self.streams.append(stream)
        return stream

    def enqueue(self, stream: FakeStream, op: tuple[str, Any]) -> None:
        with self._lock:
            stream.ops.append(op)

    def run(self, prefer: Sequence[FakeStream] = ()) -> None:
        while True:
            with self._lock:
                order = [*prefer, *(s for s in self.streams if s not in prefer)]
                ready = [s for s in order if s.ops and self._runnable(s.ops[0])]
                if not ready:
                    assert not any(s.ops for s in self.streams), "fake device deadlocked"
                    return
                kind, payload = ready[0].ops.popleft()
            if kind == "record":
                payload.pending = False
                payload._done.set()
            elif kind == "run":
                payload()

    @staticmethod
    def _runnable(op: tuple[str, Any]) -> bool:
        kind, payload = op
        return kind != "wait" or payload.query() or not payload.pending


class FakeCompletion:
    def __init__(self, start: FakeEvent, end: FakeEvent) -> None:
        self._start = start
        self.event = end

    def query(self) -> bool:
        return self.event.query()

    def started(self) -> bool:
        return self._start.query()

    def wait(self) -> None:
        self.event.synchronize()

    def seconds(self) -> float:
        return 0.0


class FakeStreams:
    """The worker's `Streams` over the fake device."""

    asynchronous = True

    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.lanes: list[FakeStream] = []
        self.launches = 0

    def new_stream(self) -> FakeStream:
        self.lanes.append(self.device.stream(f"lane{len(self.lanes)}"))
        return self.lanes[-1]

    def order_after(self, stream: FakeStream, ready: Any) -> None:
        if is_stream(ready):
            stream.wait_stream(ready)
        else:
            stream.wait_event(ready)

    def launch(
        self, stream: FakeStream, work: Callable[[Any], None], *, current: bool = True
    ) -> Completion:
        self.launches += 1
        start = stream.record_event()
        stream.run_later(lambda: work(stream))
        return FakeCompletion(start, stream.record_event())


class Rig:
    def __init__(
        self, copy_backend: Any, *, worker_ready: str | None = None, **options: Any
    ) -> None:
        self.device = FakeDevice()
        self.streams = FakeStreams(self.device)
        self.engine = self.device.stream("engine")
        self.kv = [
            [torch.zeros(8, PAGE, dtype=torch.uint8), torch.zeros(8, PAGE, dtype=torch.uint8)]
        ]
        self.primary = PrimaryTier(4, 2 * PAGE, pin_memory=False)
        self.primary.view.tensor.zero_()
        layout = KVLayout(block_bytes=2 * PAGE, groups=(GroupSpec(block_size=4),))
        self.worker = TransferWorker(
            self.kv,
            self.primary.view,
            layout,
            gpu_block_size=4,
            copy_backend=copy_backend,
            streams=self.streams,
            ready=self.engine if worker_ready == "engine stream" else None,
            **options,
        )

    @property
    def slab(self) -> torch.Tensor:
        return self.primary.view.tensor

    def engine_writes(self, block: int, value: int) -> FakeEvent:
        """On another thread, as an engine would: queue the model's write of `block`
        on the engine stream and record an event after it."""
        made: list[FakeEvent] = []

        def engine_thread() -> None:
            for layer in self.kv[0]:
                self.engine.run_later(lambda layer=layer: layer[block].fill_(value))
            made.append(self.engine.record_event())

        thread = threading.Thread(target=engine_thread)
        thread.start()
        thread.join()
        return made[0]


BACKENDS = ["kernel", "dma"]


@pytest.mark.parametrize("copy_backend", BACKENDS)
@pytest.mark.parametrize("ready", ["event per call", "engine stream per call", "engine stream"])
async def test_a_store_from_the_loop_thread_copies_what_the_engine_stream_wrote(
    copy_backend: str, ready: str
) -> None:
    rig = Rig(copy_backend, worker_ready=ready)
    event = rig.engine_writes(block=3, value=7)
    per_call = {"event per call": event, "engine stream per call": rig.engine}.get(ready)
    handle = rig.worker.submit(TransferSpec("store", [[3]], [[1]], [0]), ready=per_call)
    assert rig.slab[1].sum() == 0  # nothing ran yet: the device has not moved
    rig.device.run(prefer=rig.streams.lanes)  # the copy runs first whenever it may
    with anyio.fail_after(5):
        result = await rig.worker.wait(handle)
    assert result.backend == copy_backend
    assert rig.slab[1].tolist() == [7] * (2 * PAGE)  # the new KV, not the stale zeros


@pytest.mark.parametrize("copy_backend", BACKENDS)
async def test_the_fake_device_catches_a_copy_ordered_after_the_wrong_stream(
    copy_backend: str,
) -> None:
    """The control: ordered after a stream the engine does not write on (what "the
    loop thread's current stream" is), the same store copies stale bytes."""
    rig = Rig(copy_backend)
    rig.engine_writes(block=3, value=7)
    other = rig.device.stream("loop thread's stream")
    handle = rig.worker.submit(TransferSpec("store", [[3]], [[1]], [0]), ready=other)
    rig.device.run(prefer=[*rig.streams.lanes, other])
    with anyio.fail_after(5):
        await rig.worker.wait(handle)
    assert rig.slab[1].tolist() == [0] * (2 * PAGE)


async def test_an_asynchronous_transfer_without_ready_is_refused_before_anything_moves() -> None:
    rig = Rig("kernel")
    with pytest.raises(TransferSpecError, match="pass ready="):
        rig.worker.submit(TransferSpec("store", [[3]], [[1]], [0]))
    with pytest.raises(TransferSpecError, match="pass ready="):
        await rig.worker.transfer(TransferSpec("load", [[3]], [[1]], [0]))
    assert rig.streams.launches == 0 and rig.worker.num_in_flight == 0


@pytest.mark.parametrize("copy_backend", BACKENDS)
async def test_a_load_hands_back_an_event_the_engine_stream_waits_on(copy_backend: str) -> None:
    rig = Rig(copy_backend, worker_ready="engine stream")
    rig.slab[2].fill_(9)
    handle = rig.worker.submit(TransferSpec("load", [[5]], [[2]], [0]))
    assert handle.done_event is not None
    seen: list[list[int]] = []
    # the model is enqueued before the copy ran: it waits on the load's event
    rig.engine.wait_event(handle.done_event)
    rig.engine.run_later(lambda: seen.append(rig.kv[0][1][5].tolist()))
    rig.device.run(prefer=[rig.engine])  # the model runs first whenever it may
    assert seen == [[9] * PAGE]
    with anyio.fail_after(5):
        await rig.worker.wait(handle)


async def test_kv_cache_blocks_pass_ready_and_keep_the_done_event() -> None:
    rig = Rig("dma")
    event = rig.engine_writes(block=6, value=5)
    blocks = KVCacheBlocks(rig.worker, [[6, 7]], ready=event)

    async def device_runs() -> None:
        await anyio.sleep(0.01)
        rig.device.run(prefer=rig.streams.lanes)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(device_runs)
            await blocks.copy_to_slots(rig.primary.view, [0, 1], [3, 0])
    assert rig.slab[3].tolist() == [5] * (2 * PAGE)
    assert rig.streams.launches == 1  # two keys, one submission
    assert blocks.done_event is not None and blocks.done_event.query()
