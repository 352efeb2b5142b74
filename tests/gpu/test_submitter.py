"""`TransferWorker.start` (and `transfer`, `KVCacheBlocks`, which use it): a transfer of
at least `thread_min_pages` pages is planned and issued on its direction's submitter
thread, so the event loop keeps serving while the driver calls run (a 512-block load
held the loop 9.8 ms on an H200). On CPU the copy itself runs there; the launch is
slowed on purpose to make the loop's freedom visible."""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio
import pytest
import torch

from tierkv.contract.errors import ConfigError
from tierkv.gpu import TransferSpec, TransferSpecError, TransferWorker
from tierkv.gpu.lanes import Launched
from tierkv.layout import GroupSpec, KVLayout

pytestmark = pytest.mark.anyio

PAGE = 64
LAYERS = 4
BLOCKS = 16


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make_worker(thread_min_pages: int) -> tuple[TransferWorker, list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    kv = [
        torch.randint(0, 256, (BLOCKS, PAGE), dtype=torch.uint8, generator=gen)
        for _ in range(LAYERS)
    ]
    slab = torch.zeros(BLOCKS, LAYERS * PAGE, dtype=torch.uint8)
    layout = KVLayout(block_bytes=LAYERS * PAGE, groups=(GroupSpec(block_size=4),))
    worker = TransferWorker([kv], slab, layout, gpu_block_size=4, thread_min_pages=thread_min_pages)
    return worker, kv, slab


def slowed(
    worker: TransferWorker, monkeypatch: pytest.MonkeyPatch, seconds: float
) -> list[tuple[int, list[int]]]:
    """Each launch sleeps `seconds` (a long driver call) and records (thread, gpu ids)."""
    launches: list[tuple[int, list[int]]] = []
    launch = worker._launch

    def slow(mapping: Any, lane: Any) -> Launched:
        launches.append((threading.get_ident(), mapping.gpu[0].tolist()))
        time.sleep(seconds)
        return launch(mapping, lane)

    monkeypatch.setattr(worker, "_launch", slow)
    return launches


def store(*ids: int) -> TransferSpec:
    return TransferSpec("store", [list(ids)], [list(ids)], [0])


async def test_a_large_transfer_is_issued_off_the_loop_which_keeps_serving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worker, kv, slab = make_worker(thread_min_pages=2 * LAYERS)
    launches = slowed(worker, monkeypatch, 0.3)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await anyio.sleep(0.01)
            ticks += 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        result = await worker.transfer(store(3, 7))
        tg.cancel_scope.cancel()
    assert launches[0][0] != threading.get_ident()  # the submitter thread issued it
    assert ticks >= 10  # the loop ran ~30 ticks meanwhile; on the loop thread: 0
    assert result.num_blocks == 2
    for layer in range(LAYERS):
        for block in (3, 7):
            assert torch.equal(slab[block, layer * PAGE : (layer + 1) * PAGE], kv[layer][block])


async def test_a_small_transfer_stays_on_the_calling_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worker, _kv, _slab = make_worker(thread_min_pages=2 * LAYERS + 1)
    launches = slowed(worker, monkeypatch, 0.0)
    await worker.transfer(store(3, 7))  # 8 pages, under the threshold
    handle = await worker.start(store(1))
    assert [thread for thread, _ in launches] == [threading.get_ident()] * 2
    assert handle.done() or worker.num_in_flight


async def test_concurrent_large_transfers_are_issued_in_call_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worker, kv, slab = make_worker(thread_min_pages=0)
    launches = slowed(worker, monkeypatch, 0.05)
    results: list[int] = []

    async def one(block: int) -> None:
        result = await worker.transfer(store(block))
        results.append(result.transfer_id)

    async with anyio.create_task_group() as tg:
        for block in (5, 1, 9, 2):
            tg.start_soon(one, block)
            await anyio.lowlevel.checkpoint()  # each call begins before the next
    assert [ids for _, ids in launches] == [[5], [1], [9], [2]]
    assert sorted(results) == results  # ids in issue order, results in that order
    for block in (5, 1, 9, 2):
        assert torch.equal(slab[block, :PAGE], kv[0][block])


async def test_a_sync_submit_beside_a_threaded_start_keeps_stream_and_flight_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worker, _kv, _slab = make_worker(thread_min_pages=2)
    slowed(worker, monkeypatch, 0.1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(worker.start, store(1, 2, 3))  # to the thread
        await anyio.sleep(0.02)  # the thread is inside its launch
        worker.submit(store(4))  # waits for the launch in progress, then goes
    finished = worker.get_finished()
    assert [r.num_blocks for r in finished] == [3, 1]
    assert finished[0].transfer_id < finished[1].transfer_id


async def test_start_checks_the_spec_before_anything_is_queued(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worker, _kv, slab = make_worker(thread_min_pages=0)
    launches = slowed(worker, monkeypatch, 0.0)
    with pytest.raises(TransferSpecError, match="out of range"):
        await worker.start(TransferSpec("store", [[1, BLOCKS]], [[1, 2]], [0]))
    assert launches == [] and worker.num_in_flight == 0 and not slab.any()


async def test_a_caller_cancelled_during_the_launch_still_queues_it_for_get_finished(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worker, kv, slab = make_worker(thread_min_pages=0)
    slowed(worker, monkeypatch, 0.2)
    with anyio.move_on_after(0.02) as scope:
        await worker.start(store(6))
    assert scope.cancel_called
    await worker.drain()
    assert [r.num_blocks for r in worker.get_finished()] == [1]
    assert torch.equal(slab[6, :PAGE], kv[0][6])


@pytest.mark.parametrize("bad", [-1, True, 2.5])
def test_a_bad_thread_min_pages_is_refused(bad: Any) -> None:
    with pytest.raises(ConfigError, match="thread_min_pages"):
        make_worker(thread_min_pages=bad)
