"""The primary's room: shares of stores and promotions, partitions, targeted wake-ups.

Capacity-8 primaries with one-letter keys; `tierkv.room.RoomWaiters` on its own and
through `PrimaryTier.wait_for_room`.
"""

from __future__ import annotations

import anyio
import pytest

from tierkv.primary import PrimaryTier
from tierkv.room import Kind, RoomWaiters

pytestmark = pytest.mark.anyio

KEYS = [bytes([c]) for c in b"ABCDEFGHIJKL"]


def make(blocks: int = 8, share: int = 4) -> PrimaryTier:
    p = PrimaryTier(blocks, 8, pin_memory=False)
    p.set_promotion_share(share)
    return p


def store(p: PrimaryTier, keys: list[bytes]) -> None:
    out = p.prepare_store(keys)
    assert out is not None
    p.complete_store(out.keys_to_store)


# -- partition and shares --------------------------------------------------------------
def test_partition_splits_a_request_into_resident_in_flight_and_absent() -> None:
    p = make()
    store(p, KEYS[:2])
    p.prepare_store(KEYS[2:3])  # being written
    part = p.partition([KEYS[3], KEYS[1], KEYS[2], KEYS[0]])
    assert part.resident == [KEYS[1], KEYS[0]]
    assert part.in_flight == [KEYS[2]]
    assert part.absent == [KEYS[3]]
    assert p.ready_keys(KEYS[:4]) == KEYS[:2]


def test_stores_leave_the_unheld_promotion_share_alone() -> None:
    p = make(blocks=8, share=4)
    assert p.store_room() == 4 and p.store_room(take_aside=True) == 8
    assert p.promotion_room() == 4
    promo = p.prepare_promotion(KEYS[:3])
    assert promo.keys_to_store == KEYS[:3] and p.num_staged == 3
    # the share no promotion holds is 1 slot now; stores may take the other 4 free
    assert p.store_room() == 4 and p.promotion_room() == 1
    p.complete_store(KEYS[:3])
    assert p.num_staged == 0 and p.store_room() == 4


def test_a_promotion_takes_no_more_than_its_share() -> None:
    p = make(blocks=8, share=2)
    promo = p.prepare_promotion(KEYS[:5])
    assert promo.keys_to_store == KEYS[:2]
    assert p.prepare_promotion(KEYS[2:5]).keys_to_store == []  # share used up
    p.complete_store(KEYS[:1], success=False)  # a failed promotion gives its slot back
    assert p.num_staged == 1 and KEYS[0] not in p
    assert p.prepare_promotion(KEYS[2:5]).keys_to_store == KEYS[2:3]


def test_the_aside_never_takes_more_than_three_quarters() -> None:
    p = make(blocks=8, share=8)
    assert p.store_room() == 2  # a store keeps a quarter of the primary


def test_no_share_means_no_aside_and_no_promotion() -> None:
    p = make(blocks=8, share=0)
    assert p.store_room() == 8 and p.promotion_room() == 0
    assert p.prepare_promotion(KEYS[:2]).keys_to_store == []


def test_held_counts_slots_being_written_or_read() -> None:
    p = make()
    store(p, KEYS[:3])
    p.prepare_load(KEYS[:1])
    p.prepare_store(KEYS[3:4])
    assert p.num_held == 2 and p.num_evictable == 2 and p.num_free == 4


# -- waiting for room --------------------------------------------------------------------
async def test_a_waiter_is_woken_once_per_release_it_can_use() -> None:
    p = make(blocks=4, share=4)
    store(p, KEYS[:4])
    p.prepare_load(KEYS[:4])  # every slot held: no room for anyone
    woken: list[str] = []

    async def promote(need: int, name: str) -> None:
        if await p.wait_for_room(Kind.PROMOTION, need, 5):
            woken.append(name)

    async with anyio.create_task_group() as tg:
        tg.start_soon(promote, 2, "two")
        await anyio.sleep(0.01)
        p.complete_load(KEYS[:1])  # one slot: not enough for a need of 2
        await anyio.sleep(0.01)
        assert woken == [] and p.wakeups == 0
        p.complete_load(KEYS[1:2])  # two slots now: woken, exactly once
        await anyio.sleep(0.01)
    assert woken == ["two"] and p.wakeups == 1
    p.complete_load(KEYS[2:4])  # nobody waits: nobody is woken
    assert p.wakeups == 1


async def test_one_release_wakes_only_as_many_waiters_as_it_has_room_for() -> None:
    p = make(blocks=4, share=4)
    store(p, KEYS[:4])
    p.prepare_load(KEYS[:4])
    woken: list[int] = []

    async def promote(n: int) -> None:
        if await p.wait_for_room(Kind.PROMOTION, 1, 0.2):
            woken.append(n)

    async with anyio.create_task_group() as tg:
        for n in range(3):
            tg.start_soon(promote, n)
        await anyio.sleep(0.01)
        p.complete_load(KEYS[:2])  # room for two of the three, first come first served
    assert woken == [0, 1] and p.wakeups == 2


def test_promotions_are_woken_before_stores_and_a_large_need_is_not_overtaken() -> None:
    waiters = RoomWaiters()
    order: list[str] = []

    async def main() -> None:
        async def wait(kind: Kind, need: int, name: str) -> None:
            if await waiters.wait(kind, need, 1):
                order.append(name)

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait, Kind.STORE, 1, "store")
            tg.start_soon(wait, Kind.PROMOTION, 3, "big")
            tg.start_soon(wait, Kind.PROMOTION, 1, "small")
            await anyio.sleep(0.01)
            waiters.wake({Kind.PROMOTION: 2, Kind.STORE: 1})  # big does not fit: small waits
            await anyio.sleep(0.01)
            assert order == ["store"]
            waiters.wake({Kind.PROMOTION: 4, Kind.STORE: 0})
        assert order == ["store", "big", "small"]

    anyio.run(main)


async def test_a_waiter_that_times_out_leaves_the_queue() -> None:
    p = make(blocks=2, share=2)
    store(p, KEYS[:2])
    p.prepare_load(KEYS[:2])
    assert not await p.wait_for_room(Kind.STORE, 1, 0.01)
    assert not await p.wait_for_room(Kind.PROMOTION, 1, 0)  # no time: no wait
    p.complete_load(KEYS[:2])
    assert p.wakeups == 0  # nobody was left queued to wake
