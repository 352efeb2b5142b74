"""What the nvme tier promises beyond the shared contract: its files, its names, its
directory lock, its LRU under capacity, bounded I/O, and cancellation safety."""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from tierkv_nvme import NvmeTier, NvmeTierConfig, blockfile
from tierkv_nvme.layout import NAMESPACE_NOTE

from tierkv.contract.errors import TierUnavailable
from tierkv.contract.framing import encode_block
from tierkv.contract.jobs import JobMetadata, ReqContext
from tierkv.primary import PrimaryTier

pytestmark = pytest.mark.anyio
CTX = ReqContext(request_id="nvme-test")
_job_ids = itertools.count(1)


async def test_each_block_is_one_framed_file_under_a_hex_fanout(rig) -> None:
    tier = rig.tier()
    await tier.open()
    keys = rig.keys(3)
    result, stored = await rig.store(tier, keys)
    assert result.ok, result.error
    for key in keys:
        path = tier.path_of(key)
        hexkey = key.hex()
        assert path == tier.directory / hexkey[0:2] / f"{hexkey}.blk"
        assert path.read_bytes() == encode_block(key, stored[key], rig.view.namespace)
    assert rig.files(tier) == sorted(tier.path_of(k) for k in keys)
    assert not list(tier.directory.rglob("*.tmp"))
    note = (tier.directory / NAMESPACE_NOTE).read_text()
    assert note.strip() == rig.view.namespace
    await tier.close()


async def test_no_key_names_a_path_outside_the_directory(rig) -> None:
    keys = [b"../../../etc/passwd", b"/", b"a", b"\x00/..\x00", b"\xff" * 300]
    tier = rig.tier()
    await tier.open()
    result, stored = await rig.store(tier, keys)
    assert result.ok, result.error
    root = tier.directory.resolve()
    files = rig.files(tier)
    assert len(files) == len(keys)
    for path in files:
        assert path.resolve().is_relative_to(root)
        assert set(path.name) <= set("0123456789abcdefsh-.blk")
    assert len(tier.path_of(keys[-1]).name) < 255  # the long key is named by its hash
    result, loaded = await rig.load(tier, keys)
    assert result.ok, result.error
    assert loaded == stored
    await tier.close()


async def test_namespaces_sharing_a_path_never_see_each_others_blocks(tmp_path: Path) -> None:
    tiers = []
    for namespace in ("model-a", "model-b"):
        primary = PrimaryTier(4, 1024, pin_memory=False, namespace=namespace)
        config = NvmeTierConfig(type="nvme", layout="files", path=tmp_path, capacity="1MiB")
        tiers.append(NvmeTier(config, primary.view))
        await tiers[-1].open()
    a, b = tiers
    key = b"same-key-in-both-namespaces"
    a.primary.block(0)[:] = b"a" * 1024
    b.primary.block(0)[:] = b"b" * 1024
    assert (await a.store(_job(key, 0))).ok
    assert await b.lookup([key], CTX) == [False]
    assert (await b.store(_job(key, 0))).ok
    assert (await a.load(_job(key, 1))).ok
    assert (await b.load(_job(key, 1))).ok
    assert bytes(a.primary.block(1)) == b"a" * 1024
    assert bytes(b.primary.block(1)) == b"b" * 1024
    assert a.directory != b.directory
    for tier in tiers:
        await tier.close()


def _job(key: bytes, slot: int) -> JobMetadata:
    return JobMetadata(next(_job_ids), (key,), (slot,))


async def test_a_second_tier_on_the_same_directory_is_refused(rig) -> None:
    first = rig.tier()
    await first.open()
    keys = rig.keys(2)
    assert (await rig.store(first, keys))[0].ok
    second = rig.tier()
    with pytest.raises(TierUnavailable, match=f"in use by another tier \\(process {os.getpid()}"):
        await second.open()
    await first.close()
    third = rig.tier()
    await third.open()  # the lock went with the first tier
    assert await third.lookup(keys, CTX) == [True, True]
    await third.close()


async def test_open_fails_clearly_when_path_is_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    primary = PrimaryTier(2, 1024, pin_memory=False)
    config = NvmeTierConfig(type="nvme", layout="files", path=tmp_path / "file", capacity="1MiB")
    with pytest.raises(TierUnavailable, match=r"cannot use .*file.*check that `path`"):
        await NvmeTier(config, primary.view).open()


async def test_unopened_and_closed_tiers_refuse_work(rig) -> None:
    tier = rig.tier()
    keys = rig.keys(1)
    with pytest.raises(TierUnavailable, match="not open"):
        await tier.lookup(keys, CTX)
    await tier.open()
    await tier.close()
    await tier.close()  # idempotent
    with pytest.raises(TierUnavailable, match="not open"):
        await tier.store(rig.job(keys, [0]))
    with pytest.raises(TierUnavailable, match="not open"):
        await tier.remove(keys)


async def test_storing_a_held_key_refreshes_it_without_rewriting(rig) -> None:
    tier = rig.tier(capacity_blocks=2)
    await tier.open()
    a, b, c = rig.keys(3)
    assert (await rig.store(tier, [a]))[0].ok
    assert (await rig.store(tier, [b]))[0].ok
    inode = tier.path_of(a).stat().st_ino
    assert (await rig.store(tier, [a]))[0].ok  # a becomes the most recent
    assert tier.path_of(a).stat().st_ino == inode
    assert (await rig.store(tier, [c]))[0].ok  # evicts b, the least recent
    assert await tier.lookup([a, b, c], CTX) == [True, False, True]
    assert not tier.path_of(b).exists()
    assert tier.used_bytes == 2 * tier.footprint(a) == 2 * rig.footprint()
    await tier.close()


async def test_capacity_counts_whole_filesystem_blocks(rig) -> None:
    # a 4 KiB block plus its header is 4,152 bytes of file but takes 8 KiB of disk
    tier = rig.tier(capacity="24KiB")
    await tier.open()
    keys = rig.keys(4)
    for key in keys:
        assert (await rig.store(tier, [key]))[0].ok
    assert tier.fs_block == 4096
    assert await tier.lookup(keys, CTX) == [False, True, True, True]
    assert tier.used_bytes == 3 * 8192
    await tier.close()


async def test_block_bigger_than_capacity_fails_that_key_only(rig) -> None:
    tier = rig.tier(capacity="4KiB")
    await tier.open()
    keys = rig.keys(2)
    result, _ = await rig.store(tier, keys)
    assert set(result.failed_keys) == set(keys)
    assert "more than the nvme capacity of 4KiB; raise `capacity`" in (result.error or "")
    assert rig.files(tier) == []
    await tier.close()


@pytest.mark.parametrize("io_concurrency", [1, 2])
async def test_a_job_bigger_than_the_capacity_fails_what_does_not_fit(
    rig, io_concurrency: int
) -> None:
    """Not by evicting its own blocks: with one chunk at a time (what a busy machine
    makes of two), a later chunk found the first chunk's blocks written and evictable."""
    tier = rig.tier(capacity_blocks=4, io_concurrency=io_concurrency)
    await tier.open()
    keys = rig.keys(10)
    result, stored = await rig.store(tier, keys)
    assert sorted(result.ok_keys + result.failed_keys) == sorted(keys)
    assert 1 <= len(result.ok_keys) <= 4 and result.failed_keys
    assert "no room: the nvme capacity of" in (result.error or "")
    assert tier.used_bytes <= 4 * rig.footprint()
    held = [k for k, present in zip(keys, await tier.lookup(keys, CTX)) if present]
    assert set(held) <= set(result.ok_keys)
    result, loaded = await rig.load(tier, held)
    assert result.ok, result.error
    assert all(loaded[k] == stored[k] for k in held)
    await tier.close()


class _Gate:
    """Holds worker threads inside a wrapped block function until released, counting
    how many are inside at once."""

    def __init__(self, func: Any) -> None:
        self.func = func
        self.open = threading.Event()
        self.inside = 0
        self.most_inside = 0
        self.calls = 0
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self.calls += 1
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        try:
            self.open.wait(5)
            return self.func(*args, **kwargs)
        finally:
            with self._lock:
                self.inside -= 1


@pytest.mark.python_io
async def test_a_block_being_read_is_not_evicted(rig, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = rig.tier(capacity_blocks=2)
    await tier.open()
    a, b, c = rig.keys(3)
    _, stored = await rig.store(tier, [a, b])  # a is the least recently used
    gate = _Gate(blockfile.read_blocks)
    monkeypatch.setattr(blockfile, "read_blocks", gate)
    loaded: list[Any] = []

    async def load_a() -> None:
        loaded.append(await rig.load(tier, [a]))

    async with anyio.create_task_group() as tg:
        tg.start_soon(load_a)
        while gate.calls == 0:  # the load holds a's file open in its thread
            await anyio.sleep(0.001)
        result, _ = await rig.store(tier, [c], first_slot=4)  # needs room: a is pinned
        assert result.ok, result.error
        gate.open.set()
    [(result, data)] = loaded
    assert result.ok, result.error
    assert data[a] == stored[a]
    assert await tier.lookup([a, b, c], CTX) == [True, False, True]
    await tier.close()


@pytest.mark.python_io
async def test_no_more_than_io_concurrency_block_operations_run_at_once(
    rig,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tier = rig.tier(io_concurrency=3)
    await tier.open()
    gate = _Gate(blockfile.write_block)
    monkeypatch.setattr(blockfile, "write_block", gate)
    keys = rig.keys(16)
    rig.fill(range(16))
    results: list[Any] = []

    async def store(part: list[bytes], first: int) -> None:
        results.append(await tier.store(rig.job(part, range(first, first + len(part)))))

    async with anyio.create_task_group() as tg:
        tg.start_soon(store, keys[:8], 0)
        tg.start_soon(store, keys[8:], 8)
        deadline = time.monotonic() + 5
        while gate.inside < 3 and time.monotonic() < deadline:
            await anyio.sleep(0.001)
        await anyio.sleep(0.05)  # would a fourth get in?
        assert gate.inside == 3
        gate.open.set()
    assert gate.most_inside == 3
    assert all(r.ok for r in results)
    assert len(rig.files(tier)) == 16
    await tier.close()


@pytest.mark.python_io
async def test_a_cancelled_store_leaves_disk_and_index_in_agreement(
    rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = rig.tier(io_concurrency=4)
    await tier.open()
    real_write = blockfile.write_block
    written = [0]

    def slow_write(*args: Any, **kwargs: Any) -> None:
        time.sleep(0.005)  # so the cancel lands while writes are in flight
        real_write(*args, **kwargs)
        written[0] += 1

    monkeypatch.setattr(blockfile, "write_block", slow_write)
    keys = rig.keys(32)
    rig.fill(range(32))
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:

            async def cancel_after_five() -> None:
                while written[0] < 5:
                    await anyio.sleep(0.001)
                scope.cancel()

            tg.start_soon(cancel_after_five)
            await tier.store(rig.job(keys, range(32)))
    assert scope.cancelled_caught
    assert not list(tier.directory.rglob("*.tmp")), "a cancelled write left a temporary file"
    present = await tier.lookup(keys, CTX)
    assert present == [tier.path_of(k).exists() for k in keys]
    assert 5 <= sum(present) == written[0] < len(keys)  # in-flight writes finished, indexed
    assert tier.used_bytes == sum(present) * rig.footprint()
    monkeypatch.setattr(blockfile, "write_block", real_write)
    result = await tier.store(rig.job(keys, range(32)))  # the tier goes on working
    assert result.ok, result.error
    assert all(await tier.lookup(keys, CTX))
    await tier.close()


async def test_describe_reports_what_the_tier_holds(rig) -> None:
    tier = rig.tier(fsync="never")
    await tier.open()
    await rig.store(tier, rig.keys(2))
    info = tier.describe()
    assert info["type"] == "nvme"
    assert info["blocks"] == 2
    assert info["used_bytes"] == 2 * rig.footprint()
    assert info["fsync"] == "never"
    await tier.close()


async def test_one_thread_call_reads_good_missing_and_corrupt_blocks_each_on_its_own(
    rig,
) -> None:
    """A load whose blocks share one worker-thread call (`blockfile.read_blocks` opens
    and prefetches them together): each key gets its own outcome, only the checked
    blocks count as loaded, the corrupt file goes, and no descriptor stays open."""
    tier = rig.tier(io_concurrency=1)  # one call reads the whole job
    await tier.open()
    keys = rig.keys(6)
    result, stored = await rig.store(tier, keys)
    assert result.ok, result.error
    gone, flipped, short = keys[1], keys[3], keys[4]
    tier.path_of(gone).unlink()
    frame = bytearray(tier.path_of(flipped).read_bytes())
    frame[-1] ^= 0xFF  # a payload bit: only the checksum can tell
    tier.path_of(flipped).write_bytes(frame)
    tier.path_of(short).write_bytes(tier.path_of(short).read_bytes()[:-1])
    fds_before = len(os.listdir("/proc/self/fd"))

    result, data = await rig.load(tier, keys)

    assert set(result.failed_keys) == {gone, flipped, short}
    for key in set(keys) - {gone, flipped, short}:
        assert data[key] == stored[key]
    assert "checksum" in (result.error or "") or "corrupt" in (result.error or "")
    assert not tier.path_of(flipped).exists() and not tier.path_of(short).exists()
    assert await tier.lookup(keys, CTX) == [k not in (gone, flipped, short) for k in keys]
    assert len(os.listdir("/proc/self/fd")) == fds_before
    await tier.close()


async def test_loads_and_unsynced_stores_of_small_blocks_go_in_one_thread_call(
    rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread call per block costs event-loop CPU and buys no depth for reads (one
    call keeps its chunk's reads in flight) or for writes without fsync (copies into
    the page cache): 16 small blocks go in one call; fsynced stores spread over
    io_concurrency calls so their fdatasyncs overlap. Every block still arrives whole."""
    calls: dict[str, list[int]] = {"read": [], "write": []}
    real_read, real_write = NvmeTier._read_chunk, NvmeTier._write_chunk

    async def counting_read(self: NvmeTier, keys: Any, *rest: Any) -> Any:
        calls["read"].append(len(keys))
        return await real_read(self, keys, *rest)

    async def counting_write(self: NvmeTier, keys: Any, *rest: Any) -> Any:
        calls["write"].append(len(keys))
        return await real_write(self, keys, *rest)

    monkeypatch.setattr(NvmeTier, "_read_chunk", counting_read)
    monkeypatch.setattr(NvmeTier, "_write_chunk", counting_write)
    for fsync, writes in (("never", [16]), ("always", [1] * 16)):
        calls["read"].clear()
        calls["write"].clear()
        tier = rig.tier(io_concurrency=16, fsync=fsync)
        await tier.open()
        keys = rig.keys(16)
        stored, data = await rig.store(tier, keys)
        assert stored.ok, stored.error
        assert sorted(calls["write"]) == writes
        loaded, got = await rig.load(tier, keys)
        assert loaded.ok, loaded.error
        assert got == data
        assert calls["read"] == [16]
        await tier.remove(keys)
        await tier.close()


@pytest.mark.parametrize("layout", ["slab", "files"])
async def test_a_job_alone_is_spread_over_the_cpus_one_beside_others_is_not(
    tmp_path: Path, make_rig: Any, monkeypatch: pytest.MonkeyPatch, layout: str, native_core: None
) -> None:
    """A job of small blocks running alone goes as one thread call per CPU (the event
    loop books one call while another copies); jobs side by side stay whole (they
    overlap already); large blocks, small jobs, fsynced stores and the Python path
    are as before."""
    from tierkv_nvme import tier as tier_module
    from tierkv_nvme.tier import SPREAD_MIN_BLOCKS

    monkeypatch.setattr(tier_module, "usable_cpus", lambda: 2)
    rig = make_rig(tmp_path / "nvme", slots=144, io_engine="native")  # loads land from 16
    tier = rig.tier(layout=layout, io_concurrency=8)
    calls: list[int] = []
    real_read = type(tier)._read_chunk

    async def counting_read(self: NvmeTier, keys: Any, *rest: Any) -> Any:
        calls.append(len(keys))
        return await real_read(self, keys, *rest)

    monkeypatch.setattr(type(tier), "_read_chunk", counting_read)
    await tier.open()
    keys = rig.keys(128)
    stored, data = await rig.store(tier, keys)
    assert stored.ok, stored.error

    loaded, got = await rig.load(tier, keys)
    assert loaded.ok and got == data
    assert sorted(calls) == [64, 64]

    calls.clear()
    halves = (keys[:64], keys[64:])
    async with anyio.create_task_group() as group:
        for part, first in zip(halves, (0, 64)):
            group.start_soon(tier.load, rig.job(part, range(first, first + 64)))
    assert sorted(calls) == [32, 32, 64]  # the first started alone, the second beside it

    calls.clear()
    loaded, got = await rig.load(tier, keys[: 2 * SPREAD_MIN_BLOCKS - 1])
    assert loaded.ok and calls == [2 * SPREAD_MIN_BLOCKS - 1]
    await tier.close()

    assert tier.spread_alone(128, 128, "load") == 64
    assert tier.spread_alone(128, 20, "store") == 128  # too few blocks to cut
    synced = rig.tier(layout=layout, fsync="always")
    assert synced.spread_alone(4, 128, "store") == 4
    monkeypatch.setattr(tier_module, "usable_cpus", lambda: 1)
    assert tier.spread_alone(128, 128, "load") == 128
    monkeypatch.setattr(tier_module, "usable_cpus", lambda: 2)
    large = make_rig(tmp_path / "large", block_bytes=1 << 20, slots=1, io_engine="native")
    assert large.tier().spread_alone(16, 128, "load") == 16
    python = make_rig(tmp_path / "python", slots=1, io_engine="python")
    assert python.tier().spread_alone(128, 128, "load") == 128


def test_chunk_size_per_direction_fsync_and_block_size(tmp_path: Path) -> None:
    """Small blocks go up to 8 MiB (loads) or 2 MiB (stores) to a call; fsynced stores
    and large blocks spread over io_concurrency calls, up to MAX_CHUNK blocks a call
    (stores) or LARGE_LOAD_BYTES (loads); large blocks go as many to a call as make
    4 MiB (MAX_CHUNK at most), or for a load as its share of io_concurrency calls."""
    from tierkv_nvme.tier import CHUNK_BYTES, LARGE_LOAD_BYTES, MAX_SMALL_CHUNK

    def tier(block_bytes: int, fsync: str) -> NvmeTier:
        primary = PrimaryTier(1, block_bytes, pin_memory=False, namespace="chunks")
        config = NvmeTierConfig(
            type="nvme",
            layout="files",
            path=tmp_path / "kv",
            capacity="1GiB",
            io_concurrency=8,
            fsync=fsync,
        )
        return NvmeTier(config, primary.view)

    synced, unsynced = tier(4096, "always"), tier(4096, "never")
    assert [synced.chunk_size(n, "store") for n in (1, 8, 9, 16, 32, 100)] == [1, 1, 2, 2, 4, 4]
    assert [unsynced.chunk_size(n, "store") for n in (1, 8, 100)] == [MAX_SMALL_CHUNK["store"]] * 3
    assert [synced.chunk_size(n, "load") for n in (1, 8, 100)] == [MAX_SMALL_CHUNK["load"]] * 3
    for block_kib, loads, stores in (
        (16, 256, 64),
        (32, 256, 64),
        (64, 128, 32),
        (256, 32, 8),
        (512, 32, 4),  # a load: 256 blocks over 8 calls, 16 MiB each at most
        (1024, 16, 4),
        (8192, 4, 4),  # 16 MiB is 2 blocks: MAX_CHUNK, as for stores
    ):
        sized = tier(block_kib << 10, "never")
        assert (sized.chunk_size(256, "load"), sized.chunk_size(256, "store")) == (loads, stores)
    for block_bytes, per_call in ((CHUNK_BYTES // 2, 2), (CHUNK_BYTES, 1), (2 * CHUNK_BYTES, 1)):
        big = tier(block_bytes, "never")
        most = max(4, LARGE_LOAD_BYTES // block_bytes)
        assert [big.chunk_size(n, "load") for n in (1, 8, 9, 100)] == [
            per_call,
            per_call,
            max(per_call, 2),
            min(most, 13),  # 100 blocks over 8 calls: 13 a call where 16 MiB holds them
        ]
        assert big.chunk_size(8, "store") == per_call


def test_a_load_of_many_large_blocks_runs_no_more_calls_than_cpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Calls that each read PREFETCH_BLOCKS large blocks keep their own reads in flight:
    such a load runs at most as many at once as the process has CPUs; any other job
    keeps `io_concurrency`."""
    from tierkv_nvme import tier as tier_module

    def tier(block_bytes: int) -> NvmeTier:
        primary = PrimaryTier(1, block_bytes, pin_memory=False, namespace="calls")
        config = NvmeTierConfig(
            type="nvme",
            layout="files",
            path=tmp_path / "kv",
            capacity="1GiB",
            io_concurrency=8,
            fsync="never",
        )
        return NvmeTier(config, primary.view)

    monkeypatch.setattr(tier_module, "usable_cpus", lambda: 2)
    large, small = tier(1 << 20), tier(64 << 10)
    many = large.chunk_size(128, "load")
    assert many >= blockfile.PREFETCH_BLOCKS
    assert large.calls_at_once(many, "load") == 2
    assert large.calls_at_once(large.chunk_size(8, "load"), "load") == 8  # 1 block a call
    assert large.calls_at_once(large.chunk_size(128, "store"), "store") == 8
    assert small.calls_at_once(small.chunk_size(128, "load"), "load") == 8
    monkeypatch.setattr(tier_module, "usable_cpus", lambda: 64)
    assert large.calls_at_once(many, "load") == 8


async def test_loads_that_overlap_or_miss_leave_no_pin_behind(rig) -> None:
    """Loads of the same keys at once, and a load with missing keys, each read what
    is held, fail what is not, and leave no pin."""
    tier = rig.tier(fsync="never")
    await tier.open()
    keys = rig.keys(8)
    stored, data = await rig.store(tier, keys)
    assert stored.ok, stored.error
    results = []

    async def load(slots: range) -> None:
        results.append(await tier.load(rig.job(keys, slots)))

    async with anyio.create_task_group() as tg:
        tg.start_soon(load, range(8, 16))
        tg.start_soon(load, range(16, 24))
    assert all(result.ok for result in results), [r.error for r in results]
    for first in (8, 16):
        assert [bytes(rig.view.block(first + i)) for i in range(8)] == [data[k] for k in keys]
    assert tier._pins == {}
    missing = rig.keys(2)
    mixed = await tier.load(rig.job([keys[0], missing[0], keys[1], missing[1]], range(24, 28)))
    assert set(mixed.failed_keys) == set(missing)
    assert "not in the nvme tier" in (mixed.error or "")
    assert bytes(rig.view.block(26)) == data[keys[1]]
    assert tier._pins == {}
    await tier.close()
