"""The nvme tier over several directories (`paths:`): blocks spread by key hash over
them, one capacity and one LRU across them, an index rebuilt from all of them, config
errors named, the shared conformance suite, and real faults of one directory mid-run
(made immutable, or its disk filled) that cost no stores and no bytes."""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tierkv_nvme import NvmeTier, NvmeTierConfig, StripedNvmeTier, disk_footprint
from tierkv_nvme.striped import split_capacity, stripe_hash

from tierkv.config import parse_config
from tierkv.contract.errors import ConfigError, TierUnavailable
from tierkv.contract.framing import header_bytes
from tierkv.contract.jobs import ReqContext
from tierkv.contract.keys import OffloadKey
from tierkv.primary import PrimaryView
from tierkv.testing import DiskFaultUnavailable, TierConformanceSuite, immutable, tiny_disk
from tierkv.tier import SecondaryTierManager

pytestmark = pytest.mark.anyio
CTX = ReqContext(request_id="nvme-striped")
BATCH = 16  # keys per job: slots 0-15 store, 16-31 load (the rig has 32)


@pytest.fixture
def dirs(tmp_path: Path) -> list[Path]:
    """Three directories, as on three drives."""
    return [tmp_path / f"drive{i}" / "tierkv" for i in range(3)]


def striped(rig: Any, paths: Sequence[Path], capacity_blocks: int = 1024, **fields: Any) -> Any:
    """A tier over `paths` on the rig's primary, sized in blocks of the rig's keys."""
    fields.setdefault("capacity", capacity_blocks * rig.footprint())
    fields.setdefault("io_engine", rig.io_engine)
    tier = NvmeTier(
        NvmeTierConfig(type="nvme", layout="files", paths=list(paths), **fields), rig.view
    )
    assert isinstance(tier, StripedNvmeTier)
    return tier


async def store_all(rig: Any, tier: Any, keys: Sequence[OffloadKey]) -> dict[OffloadKey, bytes]:
    """Store `keys` BATCH a job; every job must succeed. Their bytes by key."""
    stored: dict[OffloadKey, bytes] = {}
    for at in range(0, len(keys), BATCH):
        result, data = await rig.store(tier, keys[at : at + BATCH])
        assert result.ok, result.error
        stored.update(data)
    return stored


async def load_all(rig: Any, tier: Any, stored: dict[OffloadKey, bytes]) -> int:
    """Load every key of `stored` BATCH a job: all must load; how many bytes were wrong."""
    keys, wrong = list(stored), 0
    for at in range(0, len(keys), BATCH):
        result, loaded = await rig.load(tier, keys[at : at + BATCH])
        assert result.ok, result.error
        wrong += sum(
            sum(a != b for a, b in zip(loaded[k], stored[k])) for k in keys[at : at + BATCH]
        )
    return wrong


def held_by(tier: Any) -> list[set[str]]:
    """The block file names in each stripe's directory."""
    return [{p.name for p in stripe.directory.glob("*/*.blk")} for stripe in tier.stripes]


def spread(keys: Sequence[OffloadKey], stripes: int, each: int) -> list[OffloadKey]:
    """`each` of `keys` homed on every stripe, interleaved."""
    by_home: list[list[OffloadKey]] = [[] for _ in range(stripes)]
    for key in keys:
        by_home[stripe_hash(key) % stripes].append(key)
    assert all(len(home) >= each for home in by_home), "draw more keys"
    return [home[i] for i in range(each) for home in by_home]


# -- spreading and reading back ----------------------------------------------------
async def test_blocks_spread_over_three_directories_and_read_back(rig, dirs) -> None:
    tier = striped(rig, dirs)
    await tier.open()
    keys = rig.keys(96)
    stored = await store_all(rig, tier, keys)
    files = held_by(tier)
    assert [len(names) for names in files] == [len(stripe) for stripe in tier.stripes]
    assert all(len(names) >= 16 for names in files), files  # each its share (32 expected)
    assert sum(len(names) for names in files) == len(tier) == 96
    assert not set.intersection(*files)  # no block twice
    for key in keys:  # room everywhere: every block on its home stripe
        assert tier.stripes[tier.home(key)].path_of(key).exists()
    assert await tier.lookup([*keys, *rig.keys(2)], CTX) == [True] * 96 + [False] * 2
    assert await load_all(rig, tier, stored) == 0
    for i, stripe in enumerate(tier.stripes):
        assert stripe.directory.is_relative_to(dirs[i])
    about = tier.describe()
    assert about["paths"] == [str(d) for d in dirs] and about["blocks"] == 96
    assert [s["writable"] for s in about["stripes"]] == [True] * 3
    await tier.close()


async def test_one_entry_in_paths_is_a_plain_tier_on_it(rig, tmp_path: Path) -> None:
    config = NvmeTierConfig(type="nvme", layout="files", paths=[tmp_path / "one"], capacity="1MiB")
    tier = NvmeTier(config, rig.view)
    assert type(tier) is NvmeTier
    assert tier.directory.parent == tmp_path / "one"


async def test_a_job_runs_its_stripes_parts_at_once(rig, dirs, monkeypatch) -> None:
    """Each stripe's part of a job starts before any has finished (none waits for
    another drive), and the parts' results make one."""
    tier = striped(rig, dirs)
    await tier.open()
    keys = spread(rig.keys(60), 3, 4)
    started: list[int] = []
    everyone = anyio.Event()
    for i, stripe in enumerate(tier.stripes):

        async def store(job: Any, real: Any = stripe.store, i: int = i) -> Any:
            started.append(i)
            if len(started) == len(tier.stripes):
                everyone.set()
            with anyio.fail_after(5):  # a sequential runner never gets here
                await everyone.wait()
            return await real(job)

        monkeypatch.setattr(stripe, "store", store)
    result, stored = await rig.store(tier, keys)
    assert result.ok, result.error
    assert result.ok_keys == tuple(keys)
    assert sorted(started) == [0, 1, 2]
    assert await load_all(rig, tier, stored) == 0
    await tier.close()


async def test_stores_of_one_key_at_once_keep_one_copy(rig, dirs) -> None:
    tier = striped(rig, dirs)
    await tier.open()
    keys = rig.keys(12)
    results = []

    async def store(first_slot: int) -> None:
        results.append((await rig.store(tier, keys, first_slot=first_slot))[0])

    async with anyio.create_task_group() as tg:
        tg.start_soon(store, 0)
        tg.start_soon(store, 12)
    assert all(r.ok for r in results), [r.error for r in results]
    assert sum(len(names) for names in held_by(tier)) == len(tier) == 12
    await tier.close()


# -- capacity and eviction ----------------------------------------------------------
async def test_the_capacity_bound_holds_across_stripes_as_one_lru(rig, dirs) -> None:
    """Capacity is the whole tier's; no stripe passes its share; the tier evicts its
    least recently used blocks wherever they lie, and reports each."""
    capacity = 12 * rig.footprint()
    tier = striped(rig, dirs, capacity_blocks=12)
    removed: list[OffloadKey] = []
    tier.set_removal_listener(removed.extend)
    await tier.open()
    assert [int(s.config.capacity) for s in tier.stripes] == [4 * rig.footprint()] * 3
    assert tier.room() == (12, 12)
    keys = rig.keys(40)
    contents: dict[OffloadKey, bytes] = {}
    for at in range(0, 40, 4):
        result, data = await rig.store(tier, keys[at : at + 4])
        assert result.ok, result.error
        contents.update(data)
        assert tier.used_bytes <= capacity
        for stripe in tier.stripes:
            assert stripe.used_bytes <= int(stripe.config.capacity)
        on_disk = sum(
            disk_footprint(p.stat().st_size) for d in tier.directories for p in d.glob("*/*")
        )
        assert on_disk == tier.used_bytes <= capacity
    held = await tier.lookup(keys, CTX)
    assert [k for k, h in zip(keys, held) if h] == keys[-12:]  # the 12 most recent
    assert sorted(removed) == sorted(keys[:-12])
    assert tier.room().free_blocks == 0
    candidates = list(tier.eviction_candidates())  # oldest job first (a job's blocks
    jobs = [set(candidates[at : at + 4]) for at in range(0, 12, 4)]  # in any order)
    assert jobs == [set(keys[at : at + 4]) for at in range(28, 40, 4)]

    await tier.touch(candidates[:1])  # reuse from above: the oldest is now the newest
    assert next(tier.eviction_candidates()) == candidates[1]
    result, _ = await rig.store(tier, rig.keys(1))
    assert result.ok, result.error
    assert removed[-1] == candidates[1]
    kept = {k: contents[k] for k in keys[-12:] if k != candidates[1]}
    assert await load_all(rig, tier, kept) == 0
    await tier.close()


def test_capacity_is_split_in_whole_blocks() -> None:
    assert split_capacity(4 * 8192, 3, 8192) == [2 * 8192, 8192, 8192]
    assert split_capacity(4 * 8192 + 100, 3, 8192) == [2 * 8192 + 100, 8192, 8192]
    assert split_capacity(12 * 8192, 4, 8192) == [3 * 8192] * 4
    assert split_capacity(1000, 3, 8192) == [334, 333, 333]  # under a block each
    for capacity in (1, 8191, 8192 * 7 + 5, 10**12):
        assert sum(split_capacity(capacity, 5, 8192)) == capacity


# -- restarts -------------------------------------------------------------------------
async def test_a_restart_rebuilds_the_index_from_every_directory(rig, dirs) -> None:
    tier = striped(rig, dirs)
    await tier.open()
    keys = rig.keys(48)
    stored = await store_all(rig, tier, keys)
    await tier.close()

    again = striped(rig, dirs)
    await again.open()
    assert again.recovery is not None and again.recovery.blocks == 48
    assert await again.lookup(keys, CTX) == [True] * 48
    assert await load_all(rig, again, stored) == 0
    await again.close()

    # the blocks are found wherever they lie, whatever the order of `paths`
    reordered = striped(rig, dirs[::-1])
    await reordered.open()
    assert await reordered.lookup(keys, CTX) == [True] * 48
    assert await load_all(rig, reordered, stored) == 0
    await reordered.close()


async def test_the_stripes_orders_merge_with_the_cycle_collector_paused(
    rig, dirs, monkeypatch
) -> None:
    """Merging the stripes' LRU orders at open makes objects by the block, as each
    stripe's rebuild does: the cycle collector waits (`recovery.cycles_uncollected`)
    and runs again once the open is done."""
    import gc
    import heapq

    from tierkv_nvme import striped as striped_module

    tier = striped(rig, dirs)
    await tier.open()
    await store_all(rig, tier, rig.keys(12))
    await tier.close()
    seen: list[bool] = []
    real_merge = heapq.merge

    def merge(*orders: Any) -> Any:
        seen.append(gc.isenabled())
        return real_merge(*orders)

    monkeypatch.setattr(striped_module.heapq, "merge", merge)
    again = striped(rig, dirs)
    await again.open()
    assert seen == [False] and gc.isenabled()
    assert len(again) == 12
    await again.close()


async def test_a_block_found_in_two_directories_keeps_one_copy(rig, dirs) -> None:
    tier = striped(rig, dirs)
    await tier.open()
    keys = rig.keys(6)
    stored = await store_all(rig, tier, keys)
    [key] = keys[:1]
    source = next(s.path_of(key) for s in tier.stripes if s.path_of(key).exists())
    other = next(s for s in tier.stripes if not s.path_of(key).exists())
    await tier.close()
    copy = other.path_of(key)
    copy.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, copy)

    again = striped(rig, dirs)
    await again.open()
    assert again.recovery is not None and again.recovery.removed_bad == 1
    assert sum(s.path_of(key).exists() for s in again.stripes) == 1
    assert len(again) == 6
    assert await load_all(rig, again, stored) == 0
    await again.close()


async def test_a_smaller_capacity_on_restart_is_kept_by_every_stripe(rig, dirs) -> None:
    tier = striped(rig, dirs)
    await tier.open()
    await store_all(rig, tier, rig.keys(48))
    await tier.close()
    smaller = striped(rig, dirs, capacity_blocks=9)
    await smaller.open()
    assert len(smaller) == 9 and smaller.used_bytes <= 9 * rig.footprint()
    assert smaller.recovery is not None and smaller.recovery.evicted_over_capacity == 39
    await smaller.close()


async def test_a_directory_that_cannot_be_taken_fails_the_open_naming_it(rig, dirs) -> None:
    dirs[2].parent.mkdir(parents=True)
    dirs[2].write_text("a file, not a directory")
    tier = striped(rig, dirs)
    with pytest.raises(TierUnavailable, match=f"cannot open 1 of them: .*{dirs[2]}"):
        await tier.open()
    dirs[2].unlink()
    plain = NvmeTier(
        NvmeTierConfig(type="nvme", layout="files", path=dirs[0], capacity="1MiB"), rig.view
    )
    await plain.open()  # the stripes that opened let their directories go again
    await plain.close()


# -- config ---------------------------------------------------------------------------
def _chain(tier: str) -> str:
    return f"""
namespace: nvme-striped-test
layout: {{block_bytes: 64KiB, groups: [{{kind: full, block_size: 16}}]}}
primary: {{capacity: 1MiB, eviction: lru, pin_memory: false}}
tiers:
  - {tier}
"""


def test_paths_in_yaml_read_expanded_and_dump_as_written(tmp_path: Path) -> None:
    config = parse_config(_chain(f"{{type: nvme, paths: [{tmp_path}/a, ~/b], capacity: 2GiB}}"))
    [tier] = config.tiers
    assert isinstance(tier, NvmeTierConfig)
    assert tier.paths == [tmp_path / "a", Path.home() / "b"]
    assert tier.path == tmp_path / "a"  # the first, for code that knows one directory
    assert tier.directories() == tier.paths
    dumped = tier.model_dump()
    assert "path" not in dumped and dumped["paths"] == tier.paths
    assert NvmeTierConfig.model_validate(dumped) == tier
    plain = NvmeTierConfig(type="nvme", layout="files", path=tmp_path, capacity="1GiB")
    assert plain.paths is None and plain.directories() == [tmp_path]
    assert plain.model_dump()["path"] == tmp_path


def test_a_config_whose_path_was_moved_without_its_paths_is_refused(rig, dirs) -> None:
    """A tool that knows only `path` (moving a tier's files into a scratch directory)
    must not leave the stripes on the real drives: the tier refuses to be built."""
    config = NvmeTierConfig(type="nvme", layout="files", paths=dirs, capacity="1MiB")
    moved = config.model_copy(update={"path": dirs[0].parent / "scratch"})
    with pytest.raises(ConfigError, match="must change both"):
        NvmeTier(moved, rig.view)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ("{type: nvme, capacity: 1GiB}", "tiers[0].path: is required"),
        (
            "{type: nvme, path: /x, paths: [/a, /b], capacity: 1GiB}",
            "tiers[0]: give `path` (one directory) or `paths` (several, one per drive), not both",
        ),
        ("{type: nvme, paths: [], capacity: 1GiB}", "paths must name at least one directory"),
        ("{type: nvme, paths: [/a, ''], capacity: 1GiB}", "entry 1 is an empty string"),
        ("{type: nvme, paths: /a, capacity: 1GiB}", "tiers[0].paths: '/a'"),
        ("{type: nvme, paths: [/a, /b, /a/], capacity: 1GiB}", "'/a' is listed twice"),
        ("{type: nvme, paths: [/a, /a/b], capacity: 1GiB}", "'/a/b' and '/a' nest"),
    ],
)
def test_bad_paths_are_named_by_their_yaml_path(section: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(_chain(section))
    assert message in str(caught.value)
    assert "tiers[0].path: is required" not in str(caught.value) or "paths" not in section


# -- faults -----------------------------------------------------------------------------
@pytest.fixture(params=["immutable", "full-disk"])
def fault(request: pytest.FixtureRequest, dirs: list[Path]) -> Iterator[Any]:
    """How the middle directory stops taking writes: `chattr +i` on it, or its own
    disk (a 2 MiB tmpfs mounted there) filled up. Yields a context manager factory:
    `with fault(tier):` the directory refuses writes. Skipped where not permitted."""
    if request.param == "immutable":

        @contextlib.contextmanager
        def unwritable(tier: Any) -> Iterator[None]:
            try:
                with immutable(tier.stripes[1].directory):
                    yield
            except DiskFaultUnavailable as exc:
                pytest.skip(str(exc))

        yield unwritable
        return
    try:
        with tiny_disk(dirs[1], 2 << 20) as disk:

            @contextlib.contextmanager
            def full(tier: Any) -> Iterator[None]:
                disk.fill()
                try:
                    yield
                finally:
                    disk.free()

            yield full
    except DiskFaultUnavailable as exc:
        pytest.skip(str(exc))


async def test_striping_over_three_directories_one_made_unwritable_mid_run(
    rig, dirs, fault
) -> None:
    """Stores keep succeeding on the other directories (in the very job that meets
    the fault, and after), blocks already on the unwritable one keep loading, no byte
    is wrong, and once it is writable again it takes its share again."""
    tier = striped(rig, dirs, recovery_after=0.2)
    await tier.open()
    before = await store_all(rig, tier, spread(rig.keys(120), 3, 10))
    on_middle = len(tier.stripes[1])
    assert on_middle == 10

    with fault(tier):
        during = await store_all(rig, tier, spread(rig.keys(120), 3, 10))
        assert len(tier.stripes[1]) == on_middle  # nothing new went there
        assert tier.failing() == [1]
        assert [s["writable"] for s in tier.describe()["stripes"]] == [True, False, True]
        more = await store_all(rig, tier, spread(rig.keys(120), 3, 10))  # still skipped
        assert len(tier) == 90 and len(tier.stripes[1]) == on_middle
        assert await load_all(rig, tier, {**before, **during, **more}) == 0
        assert not [p for d in tier.directories for p in d.rglob("*.tmp")]

    await anyio.sleep(0.25)  # recovery_after: the directory is tried again
    after = await store_all(rig, tier, spread(rig.keys(120), 3, 10))
    assert len(tier.stripes[1]) == on_middle + 10  # its share again
    assert tier.failing() == []
    everything = {**before, **during, **more, **after}
    assert await tier.lookup(list(everything), CTX) == [True] * 120
    assert await load_all(rig, tier, everything) == 0
    await tier.close()

    again = striped(rig, dirs)  # and a restart finds every block where it went
    await again.open()
    assert len(again) == 120
    assert await load_all(rig, again, everything) == 0
    await again.close()


# -- the invariant, property-based ---------------------------------------------------------
_tiers = itertools.count()


@pytest.mark.parametrize("io_engine", ["python"])  # striping is the same over any engine
@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["store", "load", "remove", "touch"]),
            st.lists(st.integers(0, 15), min_size=1, max_size=6, unique=True),
        ),
        min_size=1,
        max_size=25,
    )
)
def test_stored_keys_read_back_byte_identical_or_miss(rig, tmp_path: Path, ops: Any) -> None:
    """Whatever the jobs (several keys each, over a tier of 6 blocks, so stores evict),
    a key loads the exact bytes last stored under it or misses, the capacity holds, no
    key is held twice, and a removed key misses."""
    anyio.run(_run_ops, rig, tmp_path / f"t{next(_tiers)}", ops)


async def _run_ops(rig: Any, root: Path, ops: Any) -> None:
    rng = random.Random(os.urandom(8))
    keys = rig.keys(16)
    content = {k: rng.randbytes(rig.block_bytes) for k in keys}
    removed: set[OffloadKey] = set()
    tier = striped(rig, [root / "a", root / "b", root / "c"], capacity_blocks=6)
    await tier.open()
    try:
        for op, picks in ops:
            chosen = [keys[i] for i in picks]
            if op == "store":
                for slot, key in enumerate(chosen):
                    rig.view.block(slot)[:] = content[key]
                result = await tier.store(rig.job(chosen, range(len(chosen))))
                removed -= set(result.ok_keys)
            elif op == "remove":
                await tier.remove(chosen)
                removed |= set(chosen)
            elif op == "touch":
                await tier.touch(chosen)
            else:
                slots = range(16, 16 + len(chosen))
                for slot in slots:
                    rig.view.block(slot)[:] = bytes(rig.block_bytes)
                result = await tier.load(rig.job(chosen, slots))
                for key, slot in zip(chosen, slots):
                    if key in result.ok_keys:
                        assert key not in removed
                        assert bytes(rig.view.block(slot)) == content[key]
            assert tier.used_bytes <= 6 * rig.footprint()
            names = held_by(tier)
            assert sum(len(n) for n in names) == len(set.union(*names)) == len(tier)
    finally:
        await tier.close()


# -- the shared contract ----------------------------------------------------------------
_dirs = itertools.count()


class TestStripedNvmeConformance(TierConformanceSuite):
    """The tier contract over three directories (one capacity, one LRU, claims, room
    and eviction candidates across them), once per I/O engine."""

    @pytest.fixture(autouse=True)
    def _root(self, tmp_path: Path, io_engine: str) -> None:
        self.root = tmp_path
        self.io_engine = io_engine

    def make_tier(
        self, primary: PrimaryView, *, capacity_blocks: int | None, **fields: Any
    ) -> SecondaryTierManager:
        block = disk_footprint(header_bytes(b"k" * 20) + primary.block_bytes)
        at = self.root / f"tier{next(_dirs)}"
        config = NvmeTierConfig(
            type="nvme",
            layout="files",
            paths=[at / "a", at / "b", at / "c"],
            capacity=(capacity_blocks or 1024) * block,
            io_concurrency=2,
            **{"io_engine": self.io_engine, **fields},
        )
        tier = NvmeTier(config, primary)
        assert isinstance(tier, StripedNvmeTier)
        return tier

    def _file_of(self, tier: SecondaryTierManager, key: OffloadKey) -> Path:
        assert isinstance(tier, StripedNvmeTier)
        [path] = [s.path_of(key) for s in tier.stripes if s.path_of(key).exists()]
        return path

    async def corrupt(self, tier: SecondaryTierManager, key: OffloadKey) -> None:
        with open(self._file_of(tier, key), "r+b") as f:
            f.seek(-1, os.SEEK_END)  # the last payload byte
            last = f.read(1)[0]
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last ^ 0xFF]))

    async def plant(self, tier: SecondaryTierManager, key: OffloadKey, frame: bytes) -> None:
        self._file_of(tier, key).write_bytes(frame)
