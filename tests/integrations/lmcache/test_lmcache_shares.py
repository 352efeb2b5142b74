"""`SectionShares`, the quota rule of a section every object size shares, in bytes:
free room within a cap (or past it with `borrow`), others' blocks only while the
storing tenant grows within its quota (blocks of no named tenant, and named tenants'
excess), its own blocks for the rest; quotas of object bytes converted at a store's
footprint per object byte."""

from __future__ import annotations

from tierkv.integrations.lmcache.shares import SectionShares
from tierkv.quotas.config import TierQuotas

CAPACITY = 1000


def shares(**quotas: object) -> SectionShares:
    return SectionShares(TierQuotas.model_validate(quotas), CAPACITY)


def test_an_uncapped_tenant_takes_free_room_then_anyones_blocks() -> None:
    book = shares(tenants={"a": "50%"})
    assert book.split("b", need=300, free=100, ratio=1.0) == (100, 200)


def test_a_tenant_within_its_quota_grows_into_others_blocks_up_to_it() -> None:
    book = shares(tenants={"a": "50%"})  # 500 bytes
    book.add("a", [(b"a1", 300, 300)])
    took, grow = book.split("a", need=400, free=100, ratio=1.0)
    assert (took, grow) == (100, 100)  # 300 held + 100 free + 100 others = its 500
    # the rest (200) can only come from its own blocks


def test_without_borrow_a_tenant_at_its_cap_takes_no_free_room() -> None:
    book = shares(default="200", borrow=False)
    book.add("x", [(b"x1", 200, 200)])
    assert book.split("x", need=100, free=800, ratio=1.0) == (0, 0)
    borrowing = shares(default="200", borrow=True)
    borrowing.add("x", [(b"x1", 200, 200)])
    assert borrowing.split("x", need=100, free=800, ratio=1.0) == (100, 0)


def test_others_are_blocks_of_no_guarantee_and_named_excess_only() -> None:
    book = shares(tenants={"g": "30%", "h": "20%"})  # 300 and 200 bytes
    book.add("g", [(b"g1", 200, 200), (b"g2", 200, 200)])  # 100 past its quota
    book.add("h", [(b"h1", 100, 100)])  # within
    book.add("u", [(b"u1", 100, 100)])  # no quota: no guarantee
    accept = book.others("s")
    assert accept(b"u1", 100)
    assert accept(b"left-by-an-earlier-process", 100)
    assert not accept(b"h1", 100)
    assert accept(b"g1", 200)  # its excess, 100, was left: now counted down
    assert not accept(b"g2", 200)
    assert not book.others("u")(b"u1", 100)  # never its own as "others"
    assert book.own("u")(b"u1", 100) and not book.own("u")(b"h1", 100)


def test_a_quota_of_object_bytes_is_converted_at_the_stores_footprint() -> None:
    book = shares(default="400", borrow=False)  # 400 object bytes
    book.add("x", [(b"x1", 250, 200)])  # footprint 1.25 x its object bytes
    assert book.headroom("x", ratio=1.25) == 250  # 200 object bytes left
    assert book.split("x", need=500, free=1000, ratio=1.25) == (250, 0)


def test_reservations_count_until_released_and_removal_gives_bytes_back() -> None:
    book = shares(tenants={"a": "50%"})
    book.reserve("a", 300, 300)
    assert book.headroom("a", 1.0) == 200
    book.release("a", 300, 300)
    book.add("a", [(b"k", 300, 300), (b"k", 300, 300)])  # a key placed twice counts once
    assert book.report()["a"] == {"held_bytes": 300, "held_object_bytes": 300, "quota_bytes": 500}
    book.remove([b"k", b"unknown"])
    assert book.report()["a"]["held_bytes"] == 0
