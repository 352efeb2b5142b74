"""The core's queue (`native.CoreQueue`): with the compiled core, a chunk's batch call
(slab slots, or a file per block) is parsed on the event loop, run on one of the core's own threads
without the GIL, and answered through an eventfd the loop watches. These tests hold it
to the promises a worker thread kept: the same blocks, byte for byte; a cancelled
caller returns only once its call has run; bad arguments raise before anything is
queued; a loop the queue does not serve goes to the block threads."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import anyio
import pytest
from tierkv_nvme import NvmeTier, NvmeTierConfig, native

from tierkv.contract.jobs import JobMetadata
from tierkv.contract.keys import make_offload_key
from tierkv.contract.slab import PrimaryView

pytestmark = pytest.mark.anyio


def refuse_threads(monkeypatch: pytest.MonkeyPatch, tier: NvmeTier) -> None:
    """Fail the test if a chunk goes to a block thread instead of the queue."""

    def no(self: NvmeTier, *args: Any) -> Any:
        raise AssertionError("a chunk went to a block thread, not the core's queue")

    monkeypatch.setattr(type(tier), "_read_files", no)
    monkeypatch.setattr(type(tier), "_write_files", no)


@pytest.mark.parametrize("layout", ["slab", "files"])
async def test_chunks_go_through_the_queue_and_come_back_whole(
    native_rig: Any, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """Both layouts' batch calls (files: stores with no victim's file to delete
    first, which stay one block-thread hop)."""
    tier = native_rig.tier(layout=layout, fsync="never")
    await tier.open()
    assert tier._queue is not None and tier.describe()["core_queue"] is True
    refuse_threads(monkeypatch, tier)
    keys = native_rig.keys(16)
    stored, data = await native_rig.store(tier, keys)
    assert stored.ok, stored.error
    loaded, got = await native_rig.load(tier, keys)
    assert loaded.ok, loaded.error
    assert got == data
    assert tier._queue.in_flight == 0
    await tier.close()
    assert not tier._queue.serves()  # closed: nothing more goes in


async def test_a_cancelled_load_returns_only_once_its_queued_call_has_run(
    tmp_path: Path, make_rig: Any, native_core: None
) -> None:
    native_rig = make_rig(tmp_path / "nvme", slots=80, io_engine="native")
    tier = native_rig.tier(layout="slab", fsync="never", capacity_blocks=512)
    await tier.open()
    queue = tier._queue
    assert queue is not None
    keys = native_rig.keys(64)
    stored, _data = await native_rig.store(tier, keys)
    assert stored.ok, stored.error
    seen_in_flight = False
    for _ in range(20):  # until a cancel lands while the call is on the queue
        with anyio.CancelScope() as scope:

            async def cancel_once_queued() -> None:
                nonlocal seen_in_flight
                while queue.in_flight == 0:
                    await anyio.sleep(0)
                seen_in_flight = True
                scope.cancel()

            async with anyio.create_task_group() as tg:
                tg.start_soon(cancel_once_queued)
                await tier.load(native_rig.job(keys, range(64)))
                tg.cancel_scope.cancel()
        assert queue.in_flight == 0, "the caller returned while its call still ran"
        if seen_in_flight:
            break
    assert seen_in_flight
    loaded, _got = await native_rig.load(tier, keys)  # the tier goes on working
    assert loaded.ok, loaded.error
    await tier.close()


def test_bad_arguments_raise_and_queue_nothing(native_core: None) -> None:
    queue = native.CoreQueue(1)

    async def submit_nonsense() -> None:
        assert queue.serves()
        call = native.CoreCall(native._core_or_raise().SLAB_READ, ("not", "a", "call"), list)
        with pytest.raises(TypeError):
            await queue.run(call)
        assert queue.in_flight == 0

    anyio.run(submit_nonsense)
    queue.close()
    queue.close()  # idempotent


def test_a_queue_serves_the_loop_it_first_ran_on(native_core: None) -> None:
    queue = native.CoreQueue(1)

    async def serves() -> bool:
        return queue.serves()

    assert anyio.run(serves) is True
    assert anyio.run(serves) is False  # another loop: its calls go to the block threads
    queue.close()
    with pytest.raises(ValueError, match="closed"):
        queue._core.submit(0, 0, ())


class NoGeometry(PrimaryView):
    """A primary whose slots have no one geometry (as LMCache's lent objects): the
    core's items calls move its blocks."""

    @property
    def lanes(self) -> None:
        return None


async def test_blocks_lent_one_by_one_go_through_the_queue_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native_core: None
) -> None:
    block, n = 8192, 12
    view = NoGeometry(bytearray(block * 2 * n), block, "lent")
    config = NvmeTierConfig(
        type="nvme", path=tmp_path / "nvme", capacity=1 << 20, io_engine="native", fsync="never"
    )
    tier = NvmeTier(config, view)
    await tier.open()
    assert tier._queue is not None and tier._lanes is None
    refuse_threads(monkeypatch, tier)
    keys = [make_offload_key(f"lent-{i}".encode(), 0) for i in range(n)]
    for slot in range(n):
        view.block(slot)[:] = os.urandom(block)
    stored = await tier.store(JobMetadata(1, tuple(keys), tuple(range(n))))
    assert stored.ok, stored.error
    loaded = await tier.load(JobMetadata(2, tuple(keys), tuple(range(n, 2 * n))))
    assert loaded.ok, loaded.error
    for slot in range(n):
        assert bytes(view.block(n + slot)) == bytes(view.block(slot))
    await tier.close()


def test_a_forked_child_is_told_the_queue_is_not_its_own(native_core: None) -> None:
    """The queue's threads stay with the parent on fork: a child that submits gets an
    error naming why, not a call that never runs."""
    queue = native.CoreQueue(1)
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only on the error it must get
        try:
            queue._core.submit(0, 0, ())
        except RuntimeError as exc:
            os._exit(0 if "forked child" in str(exc) else 2)
        except BaseException:
            os._exit(3)
        os._exit(4)
    _pid, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    queue.close()
