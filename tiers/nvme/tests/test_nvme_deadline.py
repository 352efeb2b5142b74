"""A job past its deadline starts no further block: a thread call of the tier that is
still running when `job_timeout` passes (a slow or stalled disk, a call queued behind
others) leaves the rest of its blocks untouched, on every I/O engine and both layouts.

Under an engine the pages are the engine's: the adapter answers a miss at the deadline
and may hand the page out again, so a call that went on reading into it afterwards
would put another block's bytes into a page in use."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from tierkv_nvme import NvmeTier, NvmeTierConfig
from tierkv_nvme.blockfile import PastDeadline

from tierkv.contract.jobs import ReqContext
from tierkv.contract.keys import make_offload_key
from tierkv.contract.slab import PrimaryView
from tierkv.driver.sync_chain import SyncChain

pytestmark = pytest.mark.anyio

TIMEOUT = 0.3
SENTINEL = 0xA5
CTX = ReqContext(request_id="deadline-test")


def slow(real: Any, calls: list[float]) -> Any:
    """`real` (`_read_chunk` / `_write_chunk`: a block thread's call, or the core's
    queue), made only once the deadline it is given (its last argument) has passed: a
    call that waited behind a stalled disk. The wait is shielded, as the call is."""

    async def late(self: NvmeTier, *args: Any) -> Any:
        deadline = args[-1]
        calls.append(deadline)
        with anyio.CancelScope(shield=True):
            await anyio.sleep(max(0.0, deadline - time.monotonic()) + 0.02)
        return await real(self, *args)

    return late


@pytest.mark.parametrize("layout", ["files", "slab"])
async def test_a_load_past_its_deadline_leaves_the_slots_alone_and_the_blocks_kept(
    rig: Any, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    tier = rig.tier(layout=layout, job_timeout=TIMEOUT)
    await tier.open()
    keys = rig.keys(8)
    stored, data = await rig.store(tier, keys)
    assert stored.ok, stored.error
    calls: list[float] = []
    with monkeypatch.context() as m:
        m.setattr(type(tier), "_read_chunk", slow(type(tier)._read_chunk, calls))
        for _ in range(4):  # more than READ_ERRORS_BEFORE_DELETE: no read error counted
            slots = list(range(16, 24))
            for slot in slots:
                rig.view.block(slot)[:] = bytes([SENTINEL]) * rig.block_bytes
            result = await tier.load(rig.job(keys, slots))
            assert result.ok_keys == ()
            assert set(result.failed_keys) == set(keys)
            assert "not started" in result.error or "job_timeout" in result.error
            for slot in slots:  # not one byte written into them
                assert bytes(rig.view.block(slot)) == bytes([SENTINEL]) * rig.block_bytes
    assert calls and all(deadline > 0 for deadline in calls)
    assert await tier.lookup(keys, CTX) == [True] * len(keys)
    loaded, got = await rig.load(tier, keys)  # on time: every block, whole
    assert loaded.ok, loaded.error
    assert got == data
    await tier.close()


@pytest.mark.parametrize("layout", ["files", "slab"])
async def test_a_store_past_its_deadline_writes_nothing_and_keeps_no_room(
    rig: Any, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    tier = rig.tier(layout=layout, job_timeout=TIMEOUT)
    await tier.open()
    keys = rig.keys(8)
    calls: list[float] = []
    with monkeypatch.context() as m:
        m.setattr(type(tier), "_write_chunk", slow(type(tier)._write_chunk, calls))
        stored, _data = await rig.store(tier, keys)
    assert calls
    assert stored.ok_keys == ()
    assert set(stored.failed_keys) == set(keys)
    assert len(tier) == 0 and tier.used_bytes == 0
    assert await tier.lookup(keys, CTX) == [False] * len(keys)
    if layout == "files":
        assert rig.files(tier) == []
    stored, data = await rig.store(tier, keys)  # on time: the room was given back
    assert stored.ok, stored.error
    loaded, got = await rig.load(tier, keys)
    assert loaded.ok, loaded.error
    assert got == data
    await tier.close()


def test_the_core_starts_no_block_of_a_call_whose_deadline_passed(
    tmp_path: Path, make_rig: Any, native_core: None
) -> None:
    """Straight at the core: a deadline already past fails every block of the call
    (PastDeadline) and touches none; one ahead changes nothing."""
    rig = make_rig(tmp_path / "nvme", io_engine="native")
    tier = rig.tier(layout="slab")

    async def fill() -> dict[bytes, bytes]:
        await tier.open()
        stored, data = await rig.store(tier, rig.keys(6))
        assert stored.ok, stored.error
        return dict(data)

    data = anyio.run(fill)
    keys = list(data)
    entries = [tier._index[key] for key in keys]
    slots = list(range(16, 22))
    for slot in slots:
        rig.view.block(slot)[:] = bytes([SENTINEL]) * rig.block_bytes
    before = time.monotonic() - 1.0
    outcomes = tier._read_files(keys, slots, bytes(len(keys)), entries, before)
    assert all(isinstance(outcome, PastDeadline) for outcome in outcomes)
    assert all(bytes(rig.view.block(s)) == bytes([SENTINEL]) * rig.block_bytes for s in slots)
    ahead = time.monotonic() + 60.0
    assert tier._read_files(keys, slots, bytes(len(keys)), entries, ahead) == [None] * 6
    assert [bytes(rig.view.block(s)) for s in slots] == [data[k] for k in keys]
    anyio.run(tier.close)


def test_an_engine_page_answered_as_a_miss_is_not_written_afterwards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native_core: None
) -> None:
    """Through `SyncChain`, as SGLang and LMCache call it: a load whose thread call is
    held up past the chain's answer (deadline + margin) gets misses, and the pages it
    named stay as they were after that call finally runs: the engine may have reused
    them by then."""
    block, slots = 4096, 16
    buffer = bytearray(block * slots)
    view = PrimaryView(buffer, block, "engine")
    config = NvmeTierConfig(
        type="nvme", path=tmp_path / "nvme", capacity=1 << 20, job_timeout=TIMEOUT
    )
    chain = SyncChain([config], ["nvme"], view, margin=0.1)
    try:
        keys = [make_offload_key(f"page-{i}".encode(), 0) for i in range(4)]
        for slot in range(4):
            view.block(slot)[:] = bytes([slot + 1]) * block
        assert chain.store(keys, [0, 1, 2, 3]) == set(keys)
        tier = chain.tiers[0].tier
        assert isinstance(tier, NvmeTier)
        real = type(tier)._read_chunk
        ended = threading.Event()

        async def held_up(self: NvmeTier, *args: Any) -> Any:
            # past the chain's answer: job deadline + the driver's grace + margin (the
            # wait shielded, as the call is: on the core's queue or in a block thread)
            try:
                with anyio.CancelScope(shield=True):
                    await anyio.sleep(chain.job_deadline + chain.margin + 0.3)
                return await real(self, *args)
            finally:
                ended.set()

        monkeypatch.setattr(type(tier), "_read_chunk", held_up)
        for slot in range(8, 12):
            view.block(slot)[:] = bytes([SENTINEL]) * block
        started = time.monotonic()
        assert chain.load(keys, [8, 9, 10, 11]) == set()  # misses, by the deadline
        assert time.monotonic() - started < chain.job_deadline + chain.margin + 0.25
        assert ended.wait(10)
        time.sleep(0.05)
        for slot in range(8, 12):  # the engine's pages: untouched after the answer
            assert bytes(view.block(slot)) == bytes([SENTINEL]) * block
        monkeypatch.setattr(type(tier), "_read_chunk", real)
        assert chain.load(keys, [8, 9, 10, 11]) == set(keys)
        assert bytes(view.block(9)) == bytes([2]) * block
    finally:
        chain.close()
