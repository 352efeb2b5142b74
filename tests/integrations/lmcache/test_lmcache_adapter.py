"""The tierkv adapter as LMCache 0.5.6 builds and drives it: from the `--l2-adapter`
JSON through its plugin loader, over objects of an L1 buffer, on real tiers (nvme on
disk, a real redis-server)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import threading
import time
from pathlib import Path
from typing import Any

import pytest

SIZE = 64 << 10


def tier_of(adapter: Any, size: int = SIZE, index: int = 0) -> Any:
    """The tier instance (below its driver) of the chain for `size`-byte objects."""
    return adapter._chains.get(size).chain.tiers[index].tier


def test_the_plugin_loader_builds_it_from_the_json(rig: Any) -> None:
    from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface

    from tierkv.integrations.lmcache import TierkvL2Adapter

    adapter = rig.adapter([rig.nvme()], rig.L1(1 << 20))
    assert isinstance(adapter, TierkvL2Adapter)
    assert isinstance(adapter, L2AdapterInterface)
    fds = {
        adapter.get_store_event_fd(),
        adapter.get_lookup_and_lock_event_fd(),
        adapter.get_load_event_fd(),
    }
    assert len(fds) == 3
    assert adapter.report_status()["is_healthy"]


@pytest.mark.parametrize("size", [SIZE, 1 << 20])
def test_round_trips_are_byte_identical_and_counted(rig: Any, size: int) -> None:
    l1 = rig.L1(24 * size)
    adapter = rig.adapter([rig.nvme()], l1)
    drive = rig.Driver(adapter)
    keys = [rig.key(i) for i in range(8)]
    sources = [l1.obj(size, f"v{i}") for i in range(8)]
    result = drive.store(keys, sources)
    assert result.is_successful() and result.bytes_transferred() == 8 * size
    assert drive.lookup([*keys, rig.key(99)]) == [True] * 8 + [False]
    targets = [l1.obj(size) for _ in range(8)]
    assert drive.load(keys, targets) == [True] * 8
    assert [rig.content(t) for t in targets] == [rig.pattern(f"v{i}", size) for i in range(8)]
    adapter.submit_unlock([*keys, rig.key(99)])
    usage = adapter.get_usage()
    assert usage.total_bytes_used == 8 * size
    assert dict(usage.bytes_by_cache_salt) == {"": 8 * size}
    adapter.delete(keys[:3])
    assert adapter.get_usage().total_bytes_used == 5 * size
    assert drive.lookup(keys) == [False] * 3 + [True] * 5


def test_objects_of_two_sizes_share_a_task_and_a_load_may_name_a_key_twice(rig: Any) -> None:
    l1 = rig.L1(1 << 20)
    adapter = rig.adapter([rig.nvme()], l1)
    drive = rig.Driver(adapter)
    small, big = rig.key(1, group=0), rig.key(1, group=1)  # same chunk, two object groups
    assert drive.store([small, big], [l1.obj(4096, "s"), l1.obj(SIZE, "b")]).is_successful()
    out = [l1.obj(4096), l1.obj(SIZE), l1.obj(4096)]
    assert drive.load([small, big, small], out) == [True, True, True]
    assert [rig.content(o) for o in out] == [
        rig.pattern("s", 4096),
        rig.pattern("b", SIZE),
        rig.pattern("s", 4096),
    ]


def test_salts_never_share_a_block(rig: Any) -> None:
    l1 = rig.L1(1 << 20)
    adapter = rig.adapter([rig.nvme()], l1)
    drive = rig.Driver(adapter)
    alice, bob = rig.key(7, salt="alice"), rig.key(7, salt="bob")
    assert drive.store([alice], [l1.obj(SIZE, "alice")]).is_successful()
    assert drive.lookup([bob, rig.key(7), alice]) == [False, False, True]
    assert drive.store([bob], [l1.obj(SIZE, "bob")]).is_successful()
    got = [l1.obj(SIZE), l1.obj(SIZE)]
    assert drive.load([alice, bob], got) == [True, True]
    assert [rig.content(g) for g in got] == [rig.pattern("alice", SIZE), rig.pattern("bob", SIZE)]
    assert dict(adapter.get_usage().bytes_by_cache_salt) == {"alice": SIZE, "bob": SIZE}
    # model, rank and group are in the key as well
    for other in (
        rig.key(7, model="other", salt="alice"),
        rig.key(7, rank=1, salt="alice"),
        rig.key(7, group=2, salt="alice"),
    ):
        assert drive.lookup([other]) == [False]


def memory(capacity_blocks: int, **fields: Any) -> dict[str, Any]:
    """A memory tier holding `capacity_blocks` framed SIZE blocks (and a bit)."""
    return {"type": "memory", "capacity": capacity_blocks * (SIZE + 256), **fields}


def test_a_locked_key_is_not_evicted_until_unlocked(rig: Any) -> None:
    l1 = rig.L1(64 * SIZE)
    adapter = rig.adapter([memory(3)], l1)
    drive = rig.Driver(adapter)
    held = rig.key(0)
    assert drive.store([held, rig.key(1), rig.key(2)], [l1.obj(SIZE, f"v{i}") for i in range(3)])
    assert drive.lookup([held]) == [True]  # locked
    for i in range(3, 9):
        drive.store([rig.key(i)], [l1.obj(SIZE, f"v{i}")])
    assert drive.lookup([held, rig.key(1), rig.key(2)]) == [True, False, False]
    out = l1.obj(SIZE)
    assert drive.load([held], [out]) == [True] and rig.content(out) == rig.pattern("v0", SIZE)
    adapter.submit_unlock([held])  # the lookup just above
    adapter.submit_unlock([held])  # the first one
    for i in range(9, 12):
        drive.store([rig.key(i)], [l1.obj(SIZE, f"v{i}")])
    assert drive.lookup([held]) == [False]
    adapter.submit_unlock([held])  # a miss: nothing to let go, no error


def test_a_lock_ends_with_its_lease(rig: Any) -> None:
    l1 = rig.L1(64 * SIZE)
    adapter = rig.adapter([memory(2, claim_lease="300ms")], l1)
    drive = rig.Driver(adapter)
    drive.store([rig.key(0)], [l1.obj(SIZE, "v0")])
    assert drive.lookup([rig.key(0)]) == [True]  # locked, never unlocked
    drive.store([rig.key(1), rig.key(2)], [l1.obj(SIZE, "v1"), l1.obj(SIZE, "v2")])
    assert drive.lookup([rig.key(0)]) == [True]
    time.sleep(0.4)
    drive.store([rig.key(3), rig.key(4)], [l1.obj(SIZE, "v3"), l1.obj(SIZE, "v4")])
    assert drive.lookup([rig.key(0)]) == [False]
    assert adapter.report_status()["tiers"][f"memory@{SIZE}"]["lease_expired"] >= 1


def test_an_evicted_key_stops_counting(rig: Any) -> None:
    l1 = rig.L1(64 * SIZE)
    adapter = rig.adapter([memory(2)], l1)
    drive = rig.Driver(adapter)
    for i in range(5):
        drive.store([rig.key(i)], [l1.obj(SIZE, f"v{i}")])
    assert adapter.get_usage().total_bytes_used == 2 * SIZE


def test_two_controller_threads_get_zero_wrong_bytes(rig: Any) -> None:
    n = 48
    l1 = rig.L1(4 * n * SIZE + (1 << 20))
    adapter = rig.adapter([rig.nvme()], l1)
    keys = [rig.key(i) for i in range(n)]
    sources = [l1.obj(SIZE, f"v{i}") for i in range(n)]
    stored = threading.Event()
    wrong, loaded, errors = [0], [0], []

    def storer() -> None:  # LMCache's store controller
        try:
            drive = rig.Driver(adapter)
            for start in range(0, n, 4):
                assert drive.store(keys[start : start + 4], sources[start : start + 4])
                if start >= n // 2:
                    stored.set()
        except BaseException as exc:
            errors.append(exc)
        stored.set()

    def prefetcher() -> None:  # LMCache's prefetch controller
        try:
            drive = rig.Driver(adapter)
            stored.wait()
            for round_ in range(6):
                batch = keys[round_ * 4 : round_ * 4 + 8]
                hits = drive.lookup(batch)  # locks what it finds
                out = [l1.obj(SIZE) for _ in batch]
                got = drive.load(batch, out)
                adapter.submit_unlock(batch)
                assert all(ok for ok, hit in zip(got, hits) if hit)  # a locked hit loads
                for i, ok in enumerate(got):
                    if ok:
                        loaded[0] += 1
                        want = rig.pattern(f"v{keys.index(batch[i])}", SIZE)
                        wrong[0] += sum(a != b for a, b in zip(rig.content(out[i]), want))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=storer), threading.Thread(target=prefetcher)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert loaded[0] >= 24 and wrong[0] == 0


def test_a_hung_tier_answers_failed_bits_within_the_deadline_then_serves_again(
    rig: Any, faulty_tier_type: str
) -> None:
    l1 = rig.L1(64 * SIZE)
    adapter = rig.adapter([{"type": faulty_tier_type, "job_timeout": "500ms"}], l1)
    drive = rig.Driver(adapter)
    keys = [rig.key(i) for i in range(4)]
    assert drive.store(keys, [l1.obj(SIZE, f"v{i}") for i in range(4)]).is_successful()
    chain = adapter._chains.get(SIZE).chain
    tier = tier_of(adapter)
    tier.hang = True  # mid-task: every job from now on waits for ever
    started = time.monotonic()
    out = [l1.obj(SIZE) for _ in keys]
    assert drive.load(keys, out) == [False] * 4
    assert time.monotonic() - started < chain.job_deadline + chain.margin + 0.5
    failed = drive.store([rig.key(9)], [l1.obj(SIZE, "v9")])
    assert not failed.is_successful() and failed.bytes_transferred() == 0
    tier.hang = False
    time.sleep(0.1)
    tier.down = True  # raises on every call
    assert drive.load(keys, out) == [False] * 4
    tier.down = False
    deadline = time.monotonic() + 15  # the breaker lets a probe through, then serves
    while drive.load(keys, out) != [True] * 4:
        assert time.monotonic() < deadline, "the tier was not served again"
        time.sleep(0.2)
    assert [rig.content(o) for o in out] == [rig.pattern(f"v{i}", SIZE) for i in range(4)]


def test_a_frozen_redis_is_a_miss_within_the_deadline_and_serves_after(
    rig: Any, tmp_path: Path
) -> None:
    try:
        from tierkv_redis.testing import RedisServer

        server = RedisServer(tmp_path)
    except Exception as exc:
        from tierkv.testing import missing_server

        missing_server("tierkv-cache-redis and a redis-server", exc)
    with server:
        l1 = rig.L1(64 * SIZE)
        adapter = rig.adapter([{"type": "redis", "url": server.url, "job_timeout": "1s"}], l1)
        drive = rig.Driver(adapter)
        keys = [rig.key(i) for i in range(6)]
        assert drive.store(keys, [l1.obj(SIZE, f"v{i}") for i in range(6)]).is_successful()
        out = [l1.obj(SIZE) for _ in keys]
        assert drive.load(keys, out) == [True] * 6
        for o in out:
            o.tensor.zero_()
        server.freeze()
        try:
            started = time.monotonic()
            assert drive.load(keys, out) == [False] * 6
            chain = adapter._chains.get(SIZE).chain
            assert time.monotonic() - started < chain.job_deadline + chain.margin + 0.5
        finally:
            server.thaw()
        deadline = time.monotonic() + 20
        while drive.load(keys, out) != [True] * 6:
            assert time.monotonic() < deadline, "redis was not served again"
            time.sleep(0.3)
        assert [rig.content(o) for o in out] == [rig.pattern(f"v{i}", SIZE) for i in range(6)]


def test_a_bad_call_is_a_failed_task_never_an_exception(rig: Any) -> None:
    l1 = rig.L1(1 << 20)
    adapter = rig.adapter([rig.nvme()], l1)
    drive = rig.Driver(adapter)
    result = drive.store([rig.key(1), rig.key(2)], [l1.obj(SIZE, "x")])  # one object short
    assert not result.is_successful()
    assert drive.load([rig.key(1)], [l1.obj(SIZE), l1.obj(SIZE)]) == [False]
    adapter.close()  # its event fds are closed: a late call still does not raise
    assert adapter.submit_store_task([rig.key(1)], [l1.obj(SIZE, "x")]) > 0
    assert adapter.submit_lookup_and_lock_task([rig.key(1)], {}) > 0
    adapter.submit_unlock([rig.key(1)])


def test_lmcache_own_check_mode_passes(rig: Any, tmp_path: Path) -> None:
    """LMCache's `test_l2_adapter` check mode (its offline adapter check) on our JSON."""
    from lmcache.v1.check.check_mode_test_l2_adapter import run_test_mode

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        asyncio.run(
            run_test_mode(
                "org/model",
                l2_adapter=[
                    rig.adapter_json([{"type": "nvme", "path": str(tmp_path), "capacity": "64MiB"}])
                ],
                num_keys=5,
            )
        )
    text = out.getvalue()
    assert "Validation (content): 5/5" in text, text
    assert "5/5 correctly absent" in text and "5/5 found" in text
