"""`list_l2_keys` and `get_usage` of the tierkv adapter, as LMCache 0.5.6 builds and
calls it: from the `--l2-adapter` JSON through its plugin loader, over objects of an
L1 buffer, on real tiers (memory, nvme on disk, a real redis-server), with LMCache's
own `KeyListPage`, `EncodedObjectKey` and eviction controller."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

SIZE = 64 << 10


def stored(rig: Any, adapter: Any, l1: Any, keys: list[Any]) -> None:
    """Store `keys` (one object each), one task per 8."""
    drive = rig.Driver(adapter)
    for start in range(0, len(keys), 8):
        batch = keys[start : start + 8]
        objs = [l1.obj(SIZE, f"v{start + i}") for i in range(len(batch))]
        assert drive.store(batch, objs).is_successful()


def listing(adapter: Any, model: str | None = None, page_size: int = 500) -> list[Any]:
    """Every key the adapter lists, page by page, as LMCache's `ObjectKey`s."""
    found, cursor = [], None
    for _ in range(10_000):
        page = adapter.list_l2_keys(model_name=model, page_size=page_size, cursor=cursor)
        assert len(page.entries) <= page_size
        found += [entry.key.to_object_key() for entry in page.entries]
        cursor = page.next_page_token
        if cursor is None:
            return found
    raise AssertionError("the listing did not end")


def memory(blocks: int, **fields: Any) -> dict[str, Any]:
    """A memory tier holding `blocks` framed SIZE blocks."""
    return {"type": "memory", "capacity": blocks * (SIZE + 256), **fields}


def chain_of(adapter: Any, size: int = SIZE) -> Any:
    return adapter._chains.get(size)


# -- listing -----------------------------------------------------------------------------
def test_pages_list_every_stored_key_once_with_its_size(rig: Any) -> None:
    from lmcache.v1.distributed.api import KeyEntry, KeyListPage

    l1 = rig.L1(40 * SIZE)
    adapter = rig.adapter([rig.nvme()], l1)
    assert adapter.list_l2_keys() == KeyListPage(entries=(), next_page_token=None)
    keys = [rig.key(i) for i in range(25)]
    stored(rig, adapter, l1, keys)
    first = adapter.list_l2_keys(page_size=10)
    assert len(first.entries) == 10 and first.next_page_token is not None
    assert all(isinstance(e, KeyEntry) and e.size_bytes == SIZE for e in first.entries)
    assert [e.key.to_object_key() for e in first.entries] == keys[:10]  # oldest first
    assert listing(adapter, page_size=10) == keys
    assert listing(adapter, page_size=25) == keys
    whole = adapter.list_l2_keys(page_size=25)
    assert len(whole.entries) == 25 and whole.next_page_token is None  # none left: no token
    assert listing(adapter, page_size=1) == keys


def test_the_model_filter_lists_one_models_keys(rig: Any) -> None:
    l1 = rig.L1(40 * SIZE)
    adapter = rig.adapter([rig.nvme()], l1)
    mixed = [rig.key(i, model="org/a" if i % 3 else "org/b") for i in range(24)]
    stored(rig, adapter, l1, mixed)
    a = [k for k in mixed if k.model_name == "org/a"]
    b = [k for k in mixed if k.model_name == "org/b"]
    assert listing(adapter, model="org/a", page_size=5) == a
    assert listing(adapter, model="org/b", page_size=3) == b
    assert listing(adapter, model="org/none") == []
    assert sorted(listing(adapter), key=mixed.index) == mixed
    adapter.delete(b)
    assert listing(adapter, model="org/b") == []
    assert listing(adapter, model="org/a", page_size=7) == a


def test_bad_page_sizes_and_cursors_raise_value_error(rig: Any, tmp_path: Path) -> None:
    l1 = rig.L1(8 * SIZE)
    adapter = rig.adapter([rig.nvme()], l1)
    stored(rig, adapter, l1, [rig.key(i) for i in range(3)])
    for size in (0, -1):
        with pytest.raises(ValueError, match="page_size"):
            adapter.list_l2_keys(page_size=size)
    token = adapter.list_l2_keys(page_size=1).next_page_token
    assert token is not None
    for bad in ("", "garbage", token + "0x", token.replace("tkv1", "tkv2"), "tkv1.zz.1"):
        with pytest.raises(ValueError, match="cursor"):
            adapter.list_l2_keys(cursor=bad)
    other = rig.adapter([rig.nvme("other")], rig.L1(8 * SIZE))
    with pytest.raises(ValueError, match="another adapter"):
        other.list_l2_keys(cursor=token)  # a cursor is this adapter's own
    assert len(adapter.list_l2_keys(cursor=token).entries) == 2


def test_a_huge_page_size_is_capped_with_a_cursor(
    rig: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tierkv.integrations.lmcache import adapter as module

    l1 = rig.L1(8 * SIZE)
    adapter = rig.adapter([rig.nvme()], l1)
    stored(rig, adapter, l1, [rig.key(i) for i in range(5)])
    assert len(adapter.list_l2_keys(page_size=10**9).entries) == 5
    monkeypatch.setattr(module, "PAGE_LIMIT", 2)
    page = adapter.list_l2_keys(page_size=10**9)
    assert len(page.entries) == 2 and page.next_page_token is not None
    assert listing(adapter, page_size=10**9) == [rig.key(i) for i in range(5)]


def test_a_deleted_key_leaves_the_listing_and_the_usage(rig: Any) -> None:
    l1 = rig.L1(16 * SIZE)
    adapter = rig.adapter([rig.nvme()], l1)
    keys = [rig.key(i) for i in range(6)]
    stored(rig, adapter, l1, keys)
    adapter.delete(keys[1:3])
    assert listing(adapter) == [keys[0], *keys[3:]]
    assert adapter.get_usage().total_bytes_used == 4 * SIZE
    adapter.delete(keys[1:3])  # again: nothing to uncount
    assert adapter.get_usage().total_bytes_used == 4 * SIZE


def test_a_key_the_tier_evicts_leaves_the_listing(rig: Any) -> None:
    l1 = rig.L1(16 * SIZE)
    adapter = rig.adapter([memory(3)], l1)
    keys = [rig.key(i) for i in range(7)]
    stored(rig, adapter, l1, keys[:2])
    for k in keys[2:]:
        stored(rig, adapter, l1, [k])
    assert listing(adapter) == keys[-3:]  # the tier's LRU kept the last three
    assert adapter.get_usage().total_bytes_used == 3 * SIZE


def test_a_key_listed_while_some_tier_of_the_chain_holds_it(rig: Any) -> None:
    """Every tier is written every key; a key leaves when the last tier lets it go."""
    l1 = rig.L1(24 * SIZE)
    adapter = rig.adapter([memory(2), rig.nvme(capacity="1MiB")], l1)
    nvme_blocks = chain_of(adapter).chain.tiers[1].tier.room().capacity_blocks
    assert 4 < nvme_blocks < 16
    keys = [rig.key(i) for i in range(nvme_blocks + 3)]
    for k in keys[:4]:
        stored(rig, adapter, l1, [k])
    assert listing(adapter) == keys[:4]  # two evicted by memory, still on disk
    assert adapter.get_usage().total_bytes_used == 4 * SIZE
    for k in keys[4:]:
        stored(rig, adapter, l1, [k])
    assert listing(adapter) == keys[3:]  # nvme (the larger) evicted the first three
    assert adapter.get_usage().total_bytes_used == nvme_blocks * SIZE
    assert rig.Driver(adapter).lookup(keys[:4]) == [False, False, False, True]


def test_two_ranks_and_two_salts_of_one_chunk_are_four_entries(rig: Any) -> None:
    l1 = rig.L1(16 * SIZE)
    adapter = rig.adapter([rig.nvme()], l1)
    keys = [rig.key(7, rank=r, salt=s) for r in (0, 1) for s in ("alice", "bob")]
    stored(rig, adapter, l1, keys)
    entries = [e for e in adapter.list_l2_keys().entries]
    # one task: the same age (each salt's keys are stored by a job of their own)
    got = [e.key.to_object_key() for e in entries]
    assert len(got) == len(keys) and set(got) == set(keys)
    assert {(e.key.kv_rank, e.key.cache_salt) for e in entries} == {
        (0, "alice"),
        (0, "bob"),
        (1, "alice"),
        (1, "bob"),
    }
    assert len({e.key.chunk_hash_hex for e in entries}) == 1
    usage = adapter.get_usage()
    assert dict(usage.bytes_by_cache_salt) == {"alice": 2 * SIZE, "bob": 2 * SIZE}
    adapter.delete([keys[0]])
    left = listing(adapter)
    assert len(left) == len(keys) - 1 and set(left) == set(keys[1:])
    assert dict(adapter.get_usage().bytes_by_cache_salt) == {"alice": SIZE, "bob": 2 * SIZE}


def test_a_cursor_stays_valid_while_keys_come_and_go(rig: Any) -> None:
    l1 = rig.L1(40 * SIZE)
    adapter = rig.adapter([rig.nvme()], l1)
    keys = [rig.key(i) for i in range(20)]
    stored(rig, adapter, l1, keys)
    page = adapter.list_l2_keys(page_size=5)
    seen = [e.key.to_object_key() for e in page.entries]
    adapter.delete([keys[2], keys[8], keys[9]])  # one listed already, two not yet
    late = [rig.key(100 + i) for i in range(3)]
    stored(rig, adapter, l1, late)
    cursor = page.next_page_token
    while cursor is not None:
        page = adapter.list_l2_keys(page_size=5, cursor=cursor)
        seen += [e.key.to_object_key() for e in page.entries]
        cursor = page.next_page_token
    assert seen == [k for i, k in enumerate(keys) if i not in (8, 9)] + late


def test_many_removals_keep_pages_right(rig: Any) -> None:
    """The record compacts its order once removed entries outnumber live ones."""
    l1 = rig.L1(8 * SIZE)
    adapter = rig.adapter([rig.nvme()], l1)
    drive = rig.Driver(adapter)
    kept: list[Any] = []
    obj = l1.obj(SIZE, "x")
    for i in range(300):
        k = rig.key(i, model="org/a" if i % 2 else "org/b")
        assert drive.store([k], [obj]).is_successful()
        if i % 5:
            adapter.delete([k])
        else:
            kept.append(k)
    assert listing(adapter, page_size=7) == kept
    kept_b = [k for k in kept if k.model_name == "org/b"]
    assert listing(adapter, model="org/b", page_size=4) == kept_b
    record = adapter._record
    orders = [record._all, *record._models.values()]
    assert all(order.dead < 64 or order.dead <= order.live for order in orders)


def test_the_record_is_bounded(rig: Any) -> None:
    l1 = rig.L1(16 * SIZE)
    adapter = rig.adapter([rig.nvme()], l1, record_keys=4)
    keys = [rig.key(i) for i in range(6)]
    stored(rig, adapter, l1, keys)
    assert listing(adapter) == keys[2:]  # the oldest forgotten, still on disk
    assert adapter.get_usage().total_bytes_used == 4 * SIZE
    status = adapter.report_status()
    assert status["recorded_keys"] == 4 and status["record_dropped"] == 2
    assert rig.Driver(adapter).lookup(keys[:2]) == [True, True]


def test_record_keys_must_be_positive(rig: Any) -> None:
    from tierkv.contract.errors import ConfigError
    from tierkv.integrations.lmcache import resolve

    for bad in (0, -3, "many", 1.5, True):
        with pytest.raises(ConfigError, match="record_keys"):
            resolve({"tiers": [rig.nvme()], "record_keys": bad})
    assert resolve({"tiers": [rig.nvme()]}).record_keys == 1 << 20


def test_after_a_restart_a_key_is_listed_once_loaded(rig: Any) -> None:
    """An nvme tier keeps its blocks across a restart; the new process cannot list
    them (their keys are hashed) until it stores or loads them."""
    l1 = rig.L1(16 * SIZE)
    first = rig.adapter([rig.nvme()], l1, object_bytes=[SIZE])
    keys = [rig.key(i) for i in range(4)]
    stored(rig, first, l1, keys)
    first.close()
    again = rig.adapter([rig.nvme()], l1, object_bytes=[SIZE])
    drive = rig.Driver(again)
    assert listing(again) == [] and again.get_usage().total_bytes_used == 0
    assert drive.lookup(keys) == [True] * 4  # still on disk
    out = [l1.obj(SIZE) for _ in range(2)]
    assert drive.load(keys[2:], out) == [True, True]
    assert [rig.content(o) for o in out] == [rig.pattern(f"v{i}", SIZE) for i in (2, 3)]
    again.submit_unlock(keys)
    assert listing(again) == keys[2:]
    assert again.get_usage().total_bytes_used == 2 * SIZE
    stored(rig, again, l1, keys[:1])
    assert listing(again) == [*keys[2:], keys[0]]


# -- usage -------------------------------------------------------------------------------
def test_usage_fraction_counts_stores_and_evictions(rig: Any) -> None:
    l1 = rig.L1(40 * SIZE)
    adapter = rig.adapter([rig.nvme(capacity="1MiB")], l1)
    assert adapter.supports_global_eviction
    empty = adapter.get_usage()
    assert empty.total_capacity_bytes == 1 << 20 and empty.usage_fraction == 0.0
    stored(rig, adapter, l1, [rig.key(0)])
    blocks = chain_of(adapter).capacity_blocks
    assert blocks == chain_of(adapter).chain.tiers[0].tier.room().capacity_blocks
    usage = adapter.get_usage()
    assert usage.total_capacity_bytes == blocks * SIZE
    assert usage.usage_fraction == pytest.approx(1 / blocks)
    keys = [rig.key(i) for i in range(1, blocks + 5)]
    for k in keys:
        stored(rig, adapter, l1, [k])
    assert adapter.get_usage().usage_fraction == pytest.approx(1.0)  # full: evicting
    adapter.delete(keys[-4:])
    assert adapter.get_usage().usage_fraction == pytest.approx((blocks - 4) / blocks)


def test_usage_capacity_is_the_largest_tier(rig: Any) -> None:
    """Of a chain, the largest tier bounds what it holds (not memory + nvme); the
    capacity shared by every object size is `test_lmcache_budget.py`'s."""
    l1 = rig.L1(8 * SIZE)
    adapter = rig.adapter([memory(2), rig.nvme(capacity="1MiB")], l1, object_bytes=[SIZE])
    nvme = chain_of(adapter).chain.tiers[1].tier.room().capacity_blocks
    assert adapter.get_usage().total_capacity_bytes == nvme * SIZE  # not memory + nvme
    assert adapter.supports_global_eviction


def test_a_tier_without_a_bound_gives_no_usage_fraction(rig: Any, tmp_path: Path) -> None:
    try:
        from tierkv_redis.testing import RedisServer

        server = RedisServer(tmp_path)
    except Exception as exc:
        from tierkv.testing import missing_server

        missing_server("tierkv-cache-redis and a redis-server", exc)
    with server:
        l1 = rig.L1(16 * SIZE)
        tiers = [rig.nvme(), {"type": "redis", "url": server.url, "job_timeout": "1s"}]
        adapter = rig.adapter(tiers, l1)
        assert not adapter.supports_global_eviction
        keys = [rig.key(i) for i in range(3)]
        stored(rig, adapter, l1, keys)
        usage = adapter.get_usage()
        assert usage.total_capacity_bytes == 0 and usage.usage_fraction == -1.0
        assert usage.total_bytes_used == 3 * SIZE
        assert listing(adapter) == keys
        adapter.delete(keys[:1])
        assert listing(adapter) == keys[1:]


def test_lmcache_eviction_controller_evicts_by_the_usage_fraction(rig: Any) -> None:
    """LMCache's own L2 eviction controller and LRU policy, wired as its storage
    manager wires them, evict through `delete` once the fraction passes the
    watermark."""
    from lmcache.v1.distributed.config import EvictionConfig
    from lmcache.v1.distributed.storage_controllers.eviction_controller import (
        L2AdapterEvictionState,
        L2EvictionController,
    )

    l1 = rig.L1(40 * SIZE)
    adapter = rig.adapter([rig.nvme(capacity="1MiB")], l1, object_bytes=[SIZE])
    state = L2AdapterEvictionState(0, adapter, EvictionConfig("LRU", 0.5, 0.5))
    controller = L2EvictionController([state])
    blocks = chain_of(adapter).capacity_blocks
    keys = [rig.key(i) for i in range(blocks * 3 // 4)]
    for k in keys:
        stored(rig, adapter, l1, [k])
    before = adapter.get_usage().usage_fraction
    assert before >= 0.5
    controller._check_and_evict(state)  # one pass of its loop
    after = adapter.get_usage().usage_fraction
    assert after < before
    left = listing(adapter)
    assert left == keys[len(keys) - len(left) :]  # the least recently stored went
    gone = keys[: len(keys) - len(left)]
    assert rig.Driver(adapter).lookup(gone) == [False] * len(gone)
