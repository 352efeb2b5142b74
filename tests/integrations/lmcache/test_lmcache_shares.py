"""`SectionShares`, the quota rule of a section every object size shares, in bytes:
free room within a cap (or past it with `borrow`), others' blocks only while the
storing tenant grows within its quota (blocks of no named tenant, and named tenants'
excess), its own blocks for the rest; quotas of object bytes converted at a store's
footprint per object byte."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

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


def test_others_are_blocks_of_no_guarantee_and_whole_blocks_of_named_excess() -> None:
    book = shares(tenants={"g": "30%", "h": "20%"})  # 300 and 200 bytes
    book.add("g", [(b"g1", 200, 200), (b"g2", 200, 200), (b"g3", 80, 80)])  # 180 past it
    book.add("h", [(b"h1", 100, 100)])  # within
    book.add("u", [(b"u1", 100, 100)])  # no quota: no guarantee
    accept = book.others("s")
    assert accept(b"u1", 100)
    assert accept(b"left-by-an-earlier-process", 100)
    assert not accept(b"h1", 100)
    assert not accept(b"g1", 200)  # more than its excess: it would go below its quota
    assert accept(b"g3", 80)  # a whole block of its excess
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


# -- the rule, for any section --------------------------------------------------------

TENANTS = ("g", "h", "u", "v")  # g and h named (guaranteed), u and v not


@settings(max_examples=300, deadline=None)
@given(
    blocks=st.lists(
        st.tuples(st.sampled_from(TENANTS), st.integers(1, 120)), min_size=0, max_size=30
    ),
    storing=st.sampled_from(TENANTS),
    need=st.integers(1, 400),
    free=st.integers(0, 300),
    borrow=st.booleans(),
    quota_g=st.integers(1, 400),
    quota_h=st.integers(1, 400),
)
def test_a_store_never_takes_a_named_tenants_bytes_within_its_quota(
    blocks: list[tuple[str, int]],
    storing: str,
    need: int,
    free: int,
    borrow: bool,
    quota_g: int,
    quota_h: int,
) -> None:
    """Whatever the section holds and in whatever order its blocks would go: the
    blocks a store may take from others leave every other named tenant at or above
    its quota (or where it was, if below), and what the store may take from free room
    and others keeps its tenant within its own quota unless the section borrows."""
    book = shares(tenants={"g": str(quota_g), "h": str(quota_h)}, borrow=borrow)
    order = []
    for i, (tenant, cost) in enumerate(blocks):
        key = f"k{i}".encode()
        book.add(tenant, [(key, cost, cost)])
        order.append((key, tenant, cost))
    before = dict(book.held)
    took, grow = book.split(storing, need, free, ratio=1.0)
    assert 0 <= took <= min(need, free) and 0 <= grow <= need - took
    accept = book.others(storing)
    taken: dict[str, int] = {}
    freed = 0
    for key, tenant, cost in order:  # the section's eviction order
        if freed >= grow:
            break
        if accept(key, cost):
            assert tenant != storing
            taken[tenant] = taken.get(tenant, 0) + cost
            freed += cost
    for name, quota in (("g", quota_g), ("h", quota_h)):
        if name != storing and name in taken:
            assert before[name] - taken[name] >= quota
    if not borrow:
        cap = {"g": quota_g, "h": quota_h}.get(storing)
        if cap is not None:
            held = before.get(storing, 0)
            assert held + took + min(grow, freed) <= max(cap, held)
