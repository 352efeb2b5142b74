"""One `capacity` per tier section across object sizes (issue 50, item 4).

With LMCache's `save_unfull_chunk: true` every partial-chunk length is an object size
of its own, and each size gets its own instance of every tier. These tests store
objects of 20 sizes through one adapter and measure the bytes under the nvme tier's
`path` against its `capacity`: after every store, and from another thread while
stores run (each sample taken with tierkv's event loop held still, so no tier work
starts or ends on the loop during the walk: worker threads may only finish writes the
budget reserved and deletions it counted, so a sample is a state the disk really had,
not a mix of two moments).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

SIZES = [3072 * tokens for tokens in range(4, 84, 4)]
"""20 object sizes, as partial chunks of 4..80 tokens of 3 KiB each (12-240 KiB)."""
CAPACITY = 2 << 20
SIZE = 64 << 10


def disk_bytes(root: Path) -> tuple[int, int]:
    """(bytes the blocks take on disk: `du`'s count of every `*.blk` and `*.tmp`
    file, st_blocks * 512, and of every slab file's slots (`*.kvslab` less its
    superblock page); the length of every regular file under `root`, block files,
    locks and notes)."""
    blocks = lengths = 0
    stack = [str(root)]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except FileNotFoundError:
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                    continue
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # deleted since the listing
                continue
            lengths += st.st_size
            if entry.name.endswith((".blk", ".tmp")):
                blocks += st.st_blocks * 512
            elif entry.name.endswith(".kvslab"):  # sparse: only written slots count
                blocks += st.st_blocks * 512 - min(st.st_blocks * 512, 4096)
    return blocks, lengths


class Sampler:
    """Samples `disk_bytes(root)` with the tier loop held still (see the module
    docstring): once on demand, or continuously from a thread."""

    def __init__(self, root: Path) -> None:
        from tierkv.driver.sync_chain import release_shared_loop, shared_loop

        self.root = root
        self._loop = shared_loop()
        self._release = release_shared_loop
        self.samples: list[tuple[int, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> tuple[int, int]:
        async def still() -> tuple[int, int]:
            return disk_bytes(self.root)  # no await: the loop runs nothing else meanwhile

        got = self._loop.run(still(), timeout=30.0)
        self.samples.append(got)
        return got

    def __enter__(self) -> Sampler:
        def run() -> None:
            while not self._stop.is_set():
                self.sample()
                time.sleep(0.0005)

        self._thread = threading.Thread(target=run, name="disk-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30.0)
        self._release(self._loop)

    @property
    def most(self) -> tuple[int, int]:
        return max(b for b, _ in self.samples), max(n for _, n in self.samples)


def store_at_once(adapter: Any, batches: list[tuple[list[Any], list[Any]]]) -> list[Any]:
    """Submit every batch as its own store task before waiting for any (the tasks run
    side by side); their results, in order."""
    import contextlib
    import select

    from lmcache.v1.platform import consume_fd

    fd = adapter.get_store_event_fd()
    tasks = [adapter.submit_store_task(keys, objs) for keys, objs in batches]
    results: dict[int, Any] = {}
    ends = time.monotonic() + 60.0
    while len(results) < len(tasks):
        assert time.monotonic() < ends, "store tasks did not finish"
        results.update(adapter.pop_completed_store_tasks())
        if len(results) < len(tasks) and select.select([fd], [], [], 0.5)[0]:
            with contextlib.suppress(BlockingIOError):
                consume_fd(fd)
    return [results[t] for t in tasks]


def listed(adapter: Any) -> list[Any]:
    found, cursor = [], None
    while True:
        page = adapter.list_l2_keys(page_size=500, cursor=cursor)
        found += [entry.key.to_object_key() for entry in page.entries]
        cursor = page.next_page_token
        if cursor is None:
            return found


def check_held(rig: Any, adapter: Any, l1: Any, made: dict[Any, tuple[int, str]]) -> list[Any]:
    """The keys some tier still holds, each loaded and compared byte for byte."""
    drive = rig.Driver(adapter)
    keys = list(made)
    flags = drive.lookup(keys)
    held = [k for k, flag in zip(keys, flags) if flag]
    outs = [l1.obj(made[k][0]) for k in held]
    assert drive.load(held, outs) == [True] * len(held)
    adapter.submit_unlock(keys)
    for k, out in zip(held, outs):
        size, seed = made[k]
        assert rig.content(out) == rig.pattern(seed, size), f"{size}-byte object differs"
    return held


def budget_of(adapter: Any, index: int = 0) -> Any:
    return adapter._chains.budgets[index]


# -- nvme ------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["files", "slab"])
def test_twenty_sizes_stay_within_the_nvme_capacity(rig: Any, tmp_path: Path, layout: str) -> None:
    """The proof of issue 50 item 4: objects of 20 sizes, stored one task after another
    and then many tasks at once; the bytes under the nvme path never pass `capacity`
    (every sample, after every store and from another thread meanwhile), and what is
    still held loads byte-identical. Slab files are sparse, sized to their slots: their
    lengths are each size's whole capacity, the disk bytes are the slots written (a
    slot the budget takes back is punched out)."""
    root = tmp_path / "nvme"
    l1 = rig.L1(48 << 20)
    adapter = rig.adapter([rig.nvme(capacity=CAPACITY, fsync="never", layout=layout)], l1)
    made: dict[Any, tuple[int, str]] = {}
    drive = rig.Driver(adapter)

    def new(size: int) -> tuple[Any, Any]:
        n = len(made)
        k = rig.key(n, group=SIZES.index(size))
        made[k] = (size, f"obj{n}")
        return k, l1.obj(size, f"obj{n}")

    after_each: list[int] = []
    with Sampler(root) as sampler:
        for _ in range(3):  # one object a task, every size in turn: ~4x the capacity
            for size in SIZES:
                k, obj = new(size)
                assert drive.store([k], [obj]).is_successful()
                after_each.append(sampler.sample()[0])
        for _ in range(2):  # 20 tasks at once, 3 sizes each
            batches = []
            for i in range(20):
                picked = [new(SIZES[(i + j * 7) % 20]) for j in range(3)]
                batches.append(([k for k, _ in picked], [o for _, o in picked]))
            results = store_at_once(adapter, batches)
            # a key finds no room only while the rest is in flight (20/20 here)
            assert sum(r.is_successful() for r in results) >= 10
            after_each.append(sampler.sample()[0])
    most_blocks, most_files = sampler.most
    stored_bytes = sum(size for size, _ in made.values())
    print(
        f"\n{len(sampler.samples)} samples; most bytes of block files on disk "
        f"{most_blocks} (all file lengths {most_files}) against capacity {CAPACITY}; "
        f"{stored_bytes} object bytes stored in {len(made)} objects of {len(SIZES)} sizes"
    )
    assert len(sampler.samples) > 50
    assert stored_bytes > 4 * CAPACITY
    assert max(after_each) <= CAPACITY
    assert most_blocks <= CAPACITY and (most_files <= CAPACITY or layout == "slab")
    budget = budget_of(adapter)
    assert budget.used <= CAPACITY and budget.evicted > 0
    assert budget.used > CAPACITY // 2  # evicts what it must, not everything
    assert disk_bytes(root)[0] == budget.used  # the count is the disk's

    held = check_held(rig, adapter, l1, made)
    assert held and len({made[k][0] for k in held}) > 1
    assert sorted(map(str, listed(adapter))) == sorted(map(str, held))
    usage = adapter.get_usage()
    assert usage.total_bytes_used == sum(made[k][0] for k in held)
    # the section is counted once: the capacity of one 2 MiB disk, not 20 of them
    assert usage.total_capacity_bytes <= CAPACITY
    assert 0.5 < usage.usage_fraction <= 1.0
    assert usage.usage_fraction == pytest.approx(budget.used / CAPACITY, abs=0.15)


def test_a_full_section_rewrites_its_own_slots_in_place(
    rig: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stores of one size into its full section evict that size's oldest blocks for
    their own room (`evict`): the slab slots are rewritten in place, none punched out
    and allocated again; another size's store removes them (punched out, their disk
    given back). Every step within the capacity, every object held loads whole."""
    from tierkv_nvme import slabfile

    punched: list[int] = []
    release = slabfile.release

    def counting(fds: Any, places: Any, room: int) -> None:
        punched.extend(places)
        release(fds, places, room)

    monkeypatch.setattr(slabfile, "release", counting)
    l1 = rig.L1(48 << 20)
    adapter = rig.adapter([rig.nvme(capacity="1MiB", fsync="never")], l1)
    drive = rig.Driver(adapter)
    made: dict[Any, tuple[int, str]] = {}
    for i in range(40):  # 40 x 64 KiB: 2.5x the capacity
        key = rig.key(i)
        assert drive.store([key], [l1.obj(SIZE, f"a{i}")]).is_successful()
        made[key] = (SIZE, f"a{i}")
        assert disk_bytes(tmp_path / "nvme")[0] <= 1 << 20
    assert budget_of(adapter).evicted > 20
    assert punched == []  # the evicted slots were the stores' own
    held = check_held(rig, adapter, l1, made)
    assert rig.key(39) in held and rig.key(0) not in held
    for i in range(10):  # another size: the first size's blocks are removed for it
        key = rig.key(100 + i, group=1)
        assert drive.store([key], [l1.obj(48 << 10, f"b{i}")]).is_successful()
        made[key] = (48 << 10, f"b{i}")
        assert disk_bytes(tmp_path / "nvme")[0] <= 1 << 20
    assert punched
    check_held(rig, adapter, l1, made)


def test_a_locked_object_outlives_other_sizes_stores(rig: Any) -> None:
    """A looked-up (locked) object is claimed in its tier: the shared budget passes
    over it however much another size stores, until it is unlocked."""
    l1 = rig.L1(48 << 20)
    adapter = rig.adapter([rig.nvme(capacity="1MiB", fsync="never")], l1)
    drive = rig.Driver(adapter)
    locked = rig.key(0)
    assert drive.store([locked], [l1.obj(SIZE, "locked")]).is_successful()
    assert drive.lookup([locked]) == [True]  # locks it
    others = [rig.key(i, group=1) for i in range(1, 41)]  # 40 x 40 KiB: 1.6x capacity
    for k in others:
        assert drive.store([k], [l1.obj(40 << 10, str(k))]).is_successful()
    assert budget_of(adapter).evicted > 0
    out = l1.obj(SIZE)
    assert drive.load([locked], [out]) == [True]
    assert rig.content(out) == rig.pattern("locked", SIZE)
    adapter.submit_unlock([locked])
    for k in others:  # unlocked, it is the least recently used: the next to go
        assert drive.store([k], [l1.obj(40 << 10, str(k))]).is_successful()
    more = [rig.key(i, group=1) for i in range(41, 61)]
    for k in more:
        assert drive.store([k], [l1.obj(40 << 10, str(k))]).is_successful()
    assert drive.lookup([locked]) == [False]
    assert budget_of(adapter).used <= 1 << 20


def test_a_store_finding_only_locked_blocks_fails_no_room(rig: Any, tmp_path: Path) -> None:
    """Everything held is locked: another size's store fails rather than evict it or
    pass the capacity."""
    l1 = rig.L1(8 << 20)
    adapter = rig.adapter([rig.nvme(capacity="256KiB", fsync="never")], l1)
    drive = rig.Driver(adapter)
    keys = [rig.key(i) for i in range(3)]
    assert drive.store(keys, [l1.obj(SIZE, f"k{i}") for i in range(3)]).is_successful()
    assert drive.lookup(keys) == [True] * 3
    result = drive.store([rig.key(9, group=1)], [l1.obj(100 << 10, "big")])
    assert not result.is_successful()
    assert drive.lookup(keys) == [True] * 3
    adapter.submit_unlock(keys + keys)
    assert disk_bytes(tmp_path / "nvme")[0] <= 256 << 10


def test_a_restart_counts_the_sizes_an_earlier_process_left(rig: Any, tmp_path: Path) -> None:
    """The nvme directories of every size an earlier process stored open with the
    adapter, so a new size's stores evict them rather than add to them."""
    l1 = rig.L1(16 << 20)
    first = rig.adapter([rig.nvme(capacity="1MiB", fsync="never")], l1)
    drive = rig.Driver(first)
    for i in range(20):
        assert drive.store([rig.key(i)], [l1.obj(SIZE, f"a{i}")]).is_successful()
    first.close()
    again = rig.adapter([rig.nvme(capacity="1MiB", fsync="never")], l1)
    assert SIZE in {one.size for one in again._chains.all()}
    assert budget_of(again).used > (1 << 20) // 2  # counted before any store
    drive = rig.Driver(again)
    for i in range(20):
        assert drive.store([rig.key(100 + i, group=1)], [l1.obj(48 << 10, f"b{i}")]).is_successful()
    assert disk_bytes(tmp_path / "nvme")[0] <= 1 << 20
    assert drive.lookup([rig.key(0)]) == [False]  # the earlier process's oldest went


def test_usage_counts_the_shared_capacity_once(rig: Any) -> None:
    """`get_usage`'s capacity is the largest section's, in object bytes, whatever the
    number of sizes open: one size alone reads as its tier's `room`."""
    l1 = rig.L1(8 << 20)
    memory = {"type": "memory", "capacity": 2 * (SIZE + 256)}
    adapter = rig.adapter([memory, rig.nvme(capacity="1MiB")], l1, object_bytes=SIZES)
    nvme = adapter._chains.get(SIZE).chain.tiers[1].tier
    best = max(
        one.chain.tiers[1].tier.room().capacity_blocks * one.size for one in adapter._chains.all()
    )
    # the best-packed size's, not 20 sizes' worth (nor memory + nvme)
    assert adapter.get_usage().total_capacity_bytes == best <= 1 << 20
    drive = rig.Driver(adapter)
    assert drive.store([rig.key(0)], [l1.obj(SIZE, "x")]).is_successful()
    blocks = nvme.room().capacity_blocks
    usage = adapter.get_usage()
    assert usage.total_capacity_bytes == blocks * SIZE
    assert usage.usage_fraction == pytest.approx(1 / blocks)
    assert drive.store([rig.key(1, group=1)], [l1.obj(4096, "small")]).is_successful()
    usage = adapter.get_usage()
    assert usage.total_capacity_bytes < blocks * SIZE + (1 << 20)  # not a sum
    assert usage.usage_fraction == pytest.approx(budget_of(adapter, 1).used / (1 << 20), abs=0.01)


# -- memory ----------------------------------------------------------------------------------
def test_twenty_sizes_stay_within_a_memory_tier_capacity(rig: Any) -> None:
    l1 = rig.L1(24 << 20)
    adapter = rig.adapter([{"type": "memory", "capacity": CAPACITY}], l1)
    drive = rig.Driver(adapter)
    made: dict[Any, tuple[int, str]] = {}
    most = 0
    for _ in range(3):
        for size in SIZES:
            n = len(made)
            k = rig.key(n, group=SIZES.index(size))
            made[k] = (size, f"m{n}")
            assert drive.store([k], [l1.obj(size, f"m{n}")]).is_successful()
            held = sum(one.chain.tiers[0].tier.used_bytes for one in adapter._chains.all())
            most = max(most, held)
    assert most <= CAPACITY and budget_of(adapter).evicted > 0
    held_keys = check_held(rig, adapter, l1, made)
    assert len({made[k][0] for k in held_keys}) > 1
    assert adapter.get_usage().usage_fraction <= 1.0
