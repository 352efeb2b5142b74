"""`StoreRun`, the state of one store: how it sorts the keys when it starts, and its
steps (skip what others stored, settle what others were writing, reject the rest)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import torch

from tierkv.cache import TieredCache
from tierkv.cache.results import StoreResult
from tierkv.cache.store_run import StoreRun, store_window
from tierkv.cache.validate import checked_source
from tierkv.config import parse_config
from tierkv.contract.keys import OffloadKey, hash_token_blocks, make_offload_key

pytestmark = pytest.mark.anyio

BLOCK = 1024


def keys(n: int, tag: str = "k") -> list[OffloadKey]:
    return [
        make_offload_key(h, 0) for h in hash_token_blocks(list(range(16 * n)), 16, namespace=tag)
    ]


@asynccontextmanager
async def opened(blocks: int = 8, **top: Any) -> AsyncIterator[TieredCache]:
    config = {
        "namespace": "store-run",
        "layout": {"block_bytes": BLOCK, "groups": [{"block_size": 16}]},
        "primary": {"capacity": blocks * BLOCK, "pin_memory": False},
        "tiers": [],
        **top,
    }
    async with TieredCache(parse_config(config)) as cache:
        yield cache


def new_run(cache: TieredCache, ks: list[OffloadKey]) -> StoreRun:
    position = {k: i for i, k in enumerate(ks)}
    return StoreRun(cache.core, cache.writeback, cache.cascader, position, [])


def source(n: int) -> Any:
    return checked_source(torch.ones(n, BLOCK, dtype=torch.uint8), n, BLOCK)


async def run_while_the_other_write_ends(
    cache: TieredCache, run: StoreRun, key: OffloadKey, *, success: bool
) -> StoreResult:
    """Run `run` (a store of `len(run.position)` blocks) while another write of `key`,
    in flight when it started, ends soon after with `success`."""

    async def other_write_ends() -> None:
        await anyio.sleep(0.01)
        cache.primary.complete_store([key], success=success)

    async with anyio.create_task_group() as tg:
        tg.start_soon(other_write_ends)
        result = await run.run(source(len(run.position)))
    return result


def test_a_window_is_a_quarter_of_the_primary_and_never_empty() -> None:
    assert store_window(16) == 4 and store_window(3) == 1 and store_window(1) == 1


async def test_a_run_starts_from_where_each_key_stands_in_the_primary() -> None:
    async with opened() as cache:
        ks = keys(4)
        assert (await cache.store(ks[:1], torch.ones(1, BLOCK, dtype=torch.uint8))).ok
        writing = cache.primary.prepare_store([ks[1]])  # another store's copy, in flight
        assert writing is not None
        run = new_run(cache, ks)
        assert (run.already, run.pending, run.new, run.pos) == ([ks[0]], [ks[1]], ks[2:], 0)
        cache.primary.complete_store([ks[1]])


async def test_pending_keys_count_once_the_other_write_lands() -> None:
    async with opened() as cache:
        ks = keys(3)
        writing = cache.primary.prepare_store([ks[0]])
        assert writing is not None
        run = new_run(cache, ks)
        result = await run_while_the_other_write_ends(cache, run, ks[0], success=True)
        assert result.stored == tuple(ks[1:]) and result.already_present == (ks[0],)
        assert result.ok and run.pending == []


async def test_a_failed_write_of_a_pending_key_is_this_stores_to_place() -> None:
    async with opened() as cache:
        ks = keys(2)
        writing = cache.primary.prepare_store([ks[0]])
        assert writing is not None
        run = new_run(cache, ks)
        result = await run_while_the_other_write_ends(cache, run, ks[0], success=False)
        assert set(result.stored) == set(ks) and result.already_present == ()
        assert cache.primary.is_ready(ks[0])


async def test_keys_stored_by_someone_else_meanwhile_are_skipped() -> None:
    async with opened() as cache:
        ks = keys(4)
        run = new_run(cache, ks)
        for k in (ks[0], ks[2]):  # the next key, and one inside the next window
            assert (await cache.store([k], torch.ones(1, BLOCK, dtype=torch.uint8))).ok
        result = await run.run(source(4))
        assert result.stored == (ks[1], ks[3]) and result.already_present == (ks[0], ks[2])


async def test_what_finds_no_room_is_rejected_and_counted() -> None:
    async with opened(blocks=4) as cache:  # no tier below: a store cannot stream
        ks = keys(6)
        result = await new_run(cache, ks).run(source(6))
        assert result.stored == tuple(ks[:4]) and result.rejected == tuple(ks[4:])
        assert result.error is not None and "no room" in result.error
        stats = cache.stats().primary
        assert stats["store_rejected"] == 2 and stats["drops"] == 2


async def test_already_present_keys_come_back_in_key_order() -> None:
    """A key settled after the run started (another write landed) takes its place in
    key order among the keys that were resident from the start."""
    async with opened() as cache:
        ks = keys(3)
        assert (await cache.store([ks[1]], torch.ones(1, BLOCK, dtype=torch.uint8))).ok
        writing = cache.primary.prepare_store([ks[0]])
        assert writing is not None
        run = new_run(cache, ks)
        result = await run_while_the_other_write_ends(cache, run, ks[0], success=True)
        assert result.already_present == (ks[0], ks[1]) and result.stored == (ks[2],)


async def test_keys_rejected_as_late_keep_their_reason_after_a_later_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Settling rejects a key still written by another at the deadline; the run goes
    on to place a key whose other write failed, waits once for room and places it.
    The late key stays rejected with its reason, and is counted."""
    async with opened() as cache:
        ks = keys(2)
        writing = cache.primary.prepare_store([ks[0]])
        assert writing is not None
        run = new_run(cache, ks[:1])
        run.position = {k: i for i, k in enumerate(ks)}

        async def settle(keys: list[OffloadKey]) -> Any:
            return [], [ks[1]], [ks[0]]  # ks[0] late, ks[1] lost: to place

        reserve, tries = run._reserve, []

        def no_room_once(want: list[OffloadKey]) -> Any:
            tries.append(want)
            return ([], []) if len(tries) == 1 else reserve(want)

        async def room_came(want: Any) -> None:
            return None

        monkeypatch.setattr(run, "_settle", settle)
        monkeypatch.setattr(run, "_reserve", no_room_once)
        monkeypatch.setattr(run, "_await_room", room_came)
        result = await run.run(source(2))
        cache.primary.complete_store([ks[0]], success=False)
        assert result.stored == (ks[1],) and result.rejected == (ks[0],)
        assert result.error is not None and "still writing" in result.error
        assert cache.stats().primary["store_rejected"] == 1
