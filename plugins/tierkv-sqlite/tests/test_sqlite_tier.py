"""The sqlite tier keeps the tier contract (tierkv's conformance suite) and what it
adds: blocks and their recency survive a restart, capacity is enforced on open."""

from __future__ import annotations

import itertools
import random
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from tierkv_sqlite import SqliteTier, SqliteTierConfig

from tierkv import JobMetadata, OffloadKey, PrimaryView, ReqContext, TierUnavailable
from tierkv.contract.framing import header_bytes
from tierkv.primary import PrimaryTier
from tierkv.testing import TierConformanceSuite, fill_slots, random_keys
from tierkv.tier import SecondaryTierManager

pytestmark = pytest.mark.anyio
CTX = ReqContext(request_id="sqlite-test")
_ids = itertools.count(1)


class TestSqliteTierConformance(TierConformanceSuite):
    @pytest.fixture(autouse=True)
    def _root(self, tmp_path: Path) -> None:
        self.root = tmp_path

    def make_tier(
        self, primary: PrimaryView, *, capacity_blocks: int | None, **fields: Any
    ) -> SecondaryTierManager:
        frame = header_bytes(b"k" * 20) + primary.block_bytes
        config = SqliteTierConfig(
            type="sqlite",
            path=self.root / f"tier{next(_ids)}.db",  # a fresh database per tier
            capacity=(capacity_blocks or 1024) * frame,
            **fields,
        )
        return SqliteTier(config, primary)

    async def corrupt(self, tier: SecondaryTierManager, key: OffloadKey) -> None:
        assert isinstance(tier, SqliteTier)
        row = tier._row(key)  # the stored key: namespace prefix + key
        with sqlite3.connect(tier.config.path) as db:
            [(frame,)] = db.execute("SELECT frame FROM blocks WHERE key = ?", (row,))
            damaged = frame[:-1] + bytes([frame[-1] ^ 0xFF])
            db.execute("UPDATE blocks SET frame = ? WHERE key = ?", (damaged, row))

    async def plant(self, tier: SecondaryTierManager, key: OffloadKey, frame: bytes) -> None:
        assert isinstance(tier, SqliteTier)
        with sqlite3.connect(tier.config.path) as db:
            db.execute("UPDATE blocks SET frame = ? WHERE key = ?", (frame, tier._row(key)))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _tier(path: Path, primary: PrimaryTier, capacity_blocks: int = 64) -> SqliteTier:
    frame = header_bytes(b"k" * 20) + primary.view.block_bytes
    config = SqliteTierConfig(type="sqlite", path=path, capacity=capacity_blocks * frame)
    return SqliteTier(config, primary.view)


def _job(keys: list[OffloadKey], first_slot: int) -> JobMetadata:
    return JobMetadata(next(_ids), tuple(keys), tuple(range(first_slot, first_slot + len(keys))))


async def test_blocks_and_recency_survive_a_restart(tmp_path: Path) -> None:
    primary = PrimaryTier(16, 1024, pin_memory=False, namespace="sqlite-test")
    rng = random.Random(1)
    keys = random_keys(4, rng)
    written = fill_slots(primary.view, range(4), rng)
    tier = _tier(tmp_path / "sub" / "kv.db", primary)
    await tier.open()
    assert (await tier.store(_job(keys, 0))).ok
    assert (await tier.load(_job(keys[:1], 8))).ok  # keys[0] becomes the most recent
    await tier.close()

    smaller = _tier(tmp_path / "sub" / "kv.db", primary, capacity_blocks=2)
    await smaller.open()  # capacity shrank: the two least recently used go
    assert await smaller.lookup(keys, CTX) == [True, False, False, True]
    result = await smaller.load(_job([keys[0], keys[3]], 10))
    assert result.ok, result.error
    assert bytes(primary.view.block(10)) == written[0]
    assert bytes(primary.view.block(11)) == written[3]
    await smaller.close()


async def test_a_path_that_cannot_be_a_database_fails_open_clearly(tmp_path: Path) -> None:
    primary = PrimaryTier(2, 1024, pin_memory=False)
    (tmp_path / "dir.db").mkdir()
    with pytest.raises(TierUnavailable, match=r"sqlite tier cannot open .*dir\.db"):
        await _tier(tmp_path / "dir.db", primary).open()


async def test_a_closed_tier_refuses_work(tmp_path: Path) -> None:
    primary = PrimaryTier(2, 1024, pin_memory=False)
    tier = _tier(tmp_path / "kv.db", primary)
    await tier.open()
    await tier.close()
    with pytest.raises(TierUnavailable, match="not open"):
        await tier.lookup(random_keys(1), CTX)


async def test_namespaces_sharing_a_database_never_see_each_other(tmp_path: Path) -> None:
    """Two caches of different namespaces on one database file: the same key in each
    is two blocks; neither sees, overwrites nor deletes the other's."""
    first = PrimaryTier(4, 1024, pin_memory=False, namespace="model-a")
    second = PrimaryTier(4, 1024, pin_memory=False, namespace="model-b")
    keys = random_keys(1, random.Random(3))
    data_a = fill_slots(first.view, [0], random.Random(4))[0]
    data_b = fill_slots(second.view, [0], random.Random(5))[0]
    tier_a = _tier(tmp_path / "shared.db", first)
    tier_b = _tier(tmp_path / "shared.db", second)
    await tier_a.open()
    await tier_b.open()
    try:
        assert (await tier_a.store(_job(keys, 0))).ok
        assert await tier_b.lookup(keys, CTX) == [False]
        assert not (await tier_b.load(_job(keys, 1))).ok
        assert await tier_a.lookup(keys, CTX) == [True], "b's miss must not delete a's block"
        assert (await tier_b.store(_job(keys, 0))).ok
        result = await tier_a.load(_job(keys, 1))
        assert result.ok, result.error
        assert bytes(first.view.block(1)) == data_a
        result = await tier_b.load(_job(keys, 1))
        assert result.ok, result.error
        assert bytes(second.view.block(1)) == data_b
    finally:
        await tier_a.close()
        await tier_b.close()


async def test_the_database_is_private_whatever_the_umask(tmp_path: Path) -> None:
    """Blocks encode prompts: under umask 0000 the database and its WAL files are 0600
    and the directories made for them 0700; a database left 0644 is tightened."""
    import os
    import stat

    primary = PrimaryTier(4, 1024, pin_memory=False)
    path = tmp_path / "made" / "kv.db"
    old = os.umask(0)
    try:
        tier = _tier(path, primary)
        await tier.open()
        assert (await tier.store(_job(random_keys(2), 0))).ok
        files = [p for p in path.parent.iterdir() if p.name.startswith("kv.db")]
        assert {p.name for p in files} >= {"kv.db", "kv.db-wal"}
        assert {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o600}
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        await tier.close()
        path.chmod(0o644)
        again = _tier(path, primary)
        await again.open()
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        await again.close()
    finally:
        os.umask(old)


async def test_a_directory_others_may_write_is_refused(tmp_path: Path) -> None:
    primary = PrimaryTier(2, 1024, pin_memory=False)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(TierUnavailable, match=r"can be written by every user .*chmod go-w"):
        await _tier(shared / "kv.db", primary).open()
    assert not (shared / "kv.db").exists()
