"""The quota rule in one tier's book: who may take which block."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tierkv.contract.errors import ConfigError
from tierkv.contract.keys import OffloadKey
from tierkv.quotas.book import CanEvict, QuotaBook, tenant_name
from tierkv.quotas.config import TierQuotas


def book(quotas: dict[str, object], capacity: int = 10) -> QuotaBook:
    return QuotaBook(TierQuotas.model_validate(quotas), capacity, 4096, tier="primary")


def key(i: int) -> OffloadKey:
    return OffloadKey(i.to_bytes(16, "big"))


def test_named_quotas_are_guarantees_and_caps() -> None:
    b = book({"tenants": {"a": "50%", "b": "8KiB"}, "default": "20%"})
    assert (b.cap("a"), b.cap("b"), b.cap("c")) == (5, 2, 2)
    b.add("a", [key(1), key(2)])
    assert b.headroom("a") == 3 and not b.over("a")


def test_without_a_default_unnamed_tenants_are_not_capped() -> None:
    b = book({"tenants": {"a": "50%"}})
    assert b.cap("c") is None and b.headroom("c") is None and not b.over("c")


def walker(order: list[OffloadKey]) -> Callable[[int, CanEvict], list[OffloadKey]]:
    """`candidates` over a fixed eviction order (as a policy's)."""

    def candidates(limit: int, may_take: CanEvict) -> list[OffloadKey]:
        found: list[OffloadKey] = []
        for k in order:
            if len(found) == limit:
                break
            if may_take(k):
                found.append(k)
        return found

    return candidates


def test_others_takeable_blocks_go_before_own_ones() -> None:
    """a is guaranteed 3 and holds 4 (one borrowed); c is unnamed; b, within its cap
    of 3, stores 4 blocks with no free room."""
    b = book({"tenants": {"a": "30%", "b": "30%"}})
    a_keys, c_keys, b_keys = [key(i) for i in range(4)], [key(10), key(11)], [key(20)]
    b.add("b", b_keys)  # b's own block is the oldest
    b.add("a", a_keys)
    b.add("c", c_keys)
    order = [*b_keys, *a_keys, *c_keys]
    chosen = b.choose_victims("b", 0, 4, walker(order), lambda k: True)
    # b may grow by 2: a's excess (its oldest) and one of c's; then its own
    assert chosen == [a_keys[0], c_keys[0], b_keys[0]]


def test_an_uncapped_tenant_takes_every_unguaranteed_block() -> None:
    b = book({"tenants": {"a": "30%"}})
    a_keys, c_keys = [key(i) for i in range(4)], [key(10), key(11)]
    b.add("a", a_keys)
    b.add("c", c_keys)
    chosen = b.choose_victims("d", 0, 9, walker([*a_keys, *c_keys]), lambda k: True)
    assert chosen == [a_keys[0], *c_keys]


def test_a_tenant_at_its_cap_takes_only_its_own() -> None:
    b = book({"tenants": {"a": "20%"}})
    b.add("c", [key(3)])
    b.add("a", [key(1), key(2)])
    chosen = b.choose_victims("a", 0, 1, walker([key(3), key(1), key(2)]), lambda k: True)
    assert chosen == [key(1)]


def test_the_callers_veto_holds() -> None:
    b = book({})
    b.add("a", [key(1)])
    b.add("c", [key(2)])
    assert b.choose_victims("a", 0, 2, walker([key(1), key(2)]), lambda k: False) == []


def test_borrowing_takes_free_room_past_the_cap_only_when_allowed() -> None:
    b = book({"tenants": {"a": "20%"}})
    b.add("a", [key(1), key(2)])
    assert b.usable_free("a", 5) == 5
    hard = book({"tenants": {"a": "20%"}, "borrow": False})
    hard.add("a", [key(1)])
    assert hard.usable_free("a", 5) == 1


def test_remove_forgets_owners_and_counts() -> None:
    b = book({})
    b.add("a", [key(1), key(2)])
    b.remove([key(1), key(9)])
    assert b.held == {"a": 1} and key(1) not in b.owner
    b.remove([key(2)])
    assert b.held == {}


def test_report_names_quotas_holders_and_declines() -> None:
    b = book({"tenants": {"a": "50%"}, "default": "10%"})
    b.add("c", [key(1)])
    b.note_declined("c", 3)
    assert b.report() == {
        "a": {"held_blocks": 0, "quota_blocks": 5, "declined_blocks": 0},
        "c": {"held_blocks": 1, "quota_blocks": 1, "declined_blocks": 3},
    }
    assert b.declined_total == 3


def test_named_quotas_must_fit_together() -> None:
    with pytest.raises(ConfigError, match=r"tenants.quotas.primary: the named quotas"):
        book({"tenants": {"a": "30KiB", "b": "20KiB"}})


def test_the_default_tenant_is_named_default() -> None:
    assert tenant_name(None) == tenant_name("") == "default"
    assert tenant_name("acme") == "acme"
