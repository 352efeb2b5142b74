"""On a real GPU (`-m cuda`): the stale-KV scenario. The engine thread writes KV on its
own stream, kept busy first so that a copy not ordered after it would read the old
bytes; the event loop thread stores those blocks with `ready` and gets the new bytes.
A load's `done_event` orders an engine stream after the copy. Each copy backend."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from tierkv.gpu import TransferSpec, TransferSpecError, TransferWorker
from tierkv.layout import GroupSpec, KVLayout

HAS_CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.anyio,
    pytest.mark.cuda,
    pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device"),
]

PAGE = 64 * 1024  # large enough that `auto` picks DMA
BLOCKS = 16
BUSY_CYCLES = 200_000_000  # ~0.1 s of GPU time at ~2 GHz: the copy would win the race


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _worker(
    copy_backend: Any, ready: Any = None, threaded: bool = False
) -> tuple[TransferWorker, list[torch.Tensor], torch.Tensor]:
    device = torch.device("cuda")
    kv = [torch.zeros(BLOCKS, PAGE, dtype=torch.uint8, device=device) for _ in range(2)]
    slab = torch.zeros(BLOCKS, 2 * PAGE, dtype=torch.uint8, pin_memory=True)
    layout = KVLayout(block_bytes=2 * PAGE, groups=(GroupSpec(block_size=4),))
    torch.cuda.synchronize()
    worker = TransferWorker(
        [kv],
        slab,
        layout,
        gpu_block_size=4,
        copy_backend=copy_backend,
        ready=ready,
        thread_min_pages=0 if threaded else 10**9,  # from the submitter thread, or not
    )
    return worker, kv, slab


def _engine_writes(
    kv: list[torch.Tensor], stream: torch.cuda.Stream, value: int
) -> torch.cuda.Event:
    """On another thread: keep `stream` busy, then write every block, then record."""
    made: list[torch.cuda.Event] = []

    def engine() -> None:
        with torch.cuda.stream(stream):
            torch.cuda._sleep(BUSY_CYCLES)
            for layer in kv:
                layer.fill_(value)
            made.append(stream.record_event())

    thread = threading.Thread(target=engine)
    thread.start()
    thread.join()
    return made[0]


@pytest.mark.parametrize("count", [BLOCKS, 2], ids=["many blocks", "replayed from a graph"])
@pytest.mark.parametrize("threaded", [False, True], ids=["on the loop", "submitter thread"])
@pytest.mark.parametrize("copy_backend", ["kernel", "dma", "bounded", "auto"])
@pytest.mark.parametrize("how", ["event per call", "engine stream per worker"])
async def test_a_store_from_the_loop_thread_stores_the_engine_threads_new_kv(
    copy_backend: str, how: str, threaded: bool, count: int
) -> None:
    engine_stream = torch.cuda.Stream()
    worker, kv, slab = _worker(
        copy_backend,
        ready=engine_stream if how == "engine stream per worker" else None,
        threaded=threaded,
    )
    event = _engine_writes(kv, engine_stream, 7)
    ids = list(range(count))
    result = await worker.transfer(
        TransferSpec("store", [ids], [ids], [0]), ready=event if how == "event per call" else None
    )
    assert bool((slab[:count] == 7).all()), "the store copied stale KV"
    assert result.num_bytes == count * 2 * PAGE
    worker.close()


async def test_a_cuda_transfer_without_ready_is_refused() -> None:
    worker, _, _ = _worker("auto")
    with pytest.raises(TransferSpecError, match="pass ready="):
        await worker.transfer(TransferSpec("store", [[0]], [[0]], [0]))
    worker.close()


@pytest.mark.parametrize("count", [BLOCKS, 2], ids=["many blocks", "replayed from a graph"])
@pytest.mark.parametrize("threaded", [False, True], ids=["submit", "start on the thread"])
@pytest.mark.parametrize("copy_backend", ["kernel", "dma", "bounded", "auto"])
async def test_an_engine_stream_waiting_on_done_event_reads_the_loaded_kv(
    copy_backend: str, threaded: bool, count: int
) -> None:
    engine_stream = torch.cuda.Stream()
    worker, kv, slab = _worker(copy_backend, ready=engine_stream, threaded=threaded)
    slab.fill_(9)
    ids = list(range(count))
    spec = TransferSpec("load", [ids], [ids], [0])
    handle = await worker.start(spec) if threaded else worker.submit(spec)
    with torch.cuda.stream(engine_stream):  # enqueued before the copy is known to be done
        engine_stream.wait_event(handle.done_event)
        seen = kv[1].sum(dtype=torch.int64)
    await worker.wait(handle)
    engine_stream.synchronize()
    assert int(seen) == 9 * count * PAGE
    worker.close()
