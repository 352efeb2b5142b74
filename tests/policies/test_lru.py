"""LRU policy rules."""

from __future__ import annotations

from tierkv.policies import LRUPolicy, make_policy

A, B, C, D, E = (bytes([c]) for c in b"ABCDE")


def always(_: bytes) -> bool:
    return True


def test_new_keys_enter_most_recent_and_oldest_goes_first() -> None:
    lru = LRUPolicy(4)
    assert lru.admit([A, B, C], 0, always) == []
    assert lru.eviction_order() == [A, B, C]
    assert lru.admit([D], 2, always) == [A, B]
    assert lru.eviction_order() == [C, D]


def test_touch_orders_first_key_most_recent_and_ignores_unknown() -> None:
    lru = LRUPolicy(4)
    lru.admit([A, B, C, D], 0, always)
    lru.touch([B, E, A])
    assert lru.eviction_order() == [C, D, A, B]


def test_only_evictable_keys_are_chosen_all_or_nothing() -> None:
    lru = LRUPolicy(4)
    lru.admit([A, B, C, D], 0, always)
    assert lru.admit([E], 1, lambda k: k in (C, D)) == [C]
    assert lru.admit([E], 3, lambda k: k in (D,)) is None
    assert lru.eviction_order() == [A, B, D, E]


def test_discard_forgets_without_trace() -> None:
    lru = LRUPolicy(2)
    lru.admit([A, B], 0, always)
    lru.discard(A)
    lru.discard(E)
    assert A not in lru and len(lru) == 1


def test_make_policy_names() -> None:
    assert make_policy("lru", 2).name == "lru"
    assert make_policy("arc", 2).name == "arc"
    import pytest

    with pytest.raises(ValueError, match="unknown eviction policy 'fifo'; choose one of arc, lru"):
        make_policy("fifo", 2)


def test_pinned_keys_are_never_walked_and_return_as_most_recent() -> None:
    lru = LRUPolicy(4)
    lru.admit([A, B, C, D], 0, always)
    lru.pin(A)
    lru.pin(B)
    seen: list[bytes] = []

    def spy(key: bytes) -> bool:
        seen.append(key)
        return True

    assert lru.candidates(1, spy) == [C] and seen == [C]  # A and B not even looked at
    assert lru.eviction_order() == [C, D, A, B] and len(lru) == 4 and A in lru
    lru.unpin(A)
    assert lru.eviction_order() == [C, D, A, B]
    assert lru.admit([E], 2, always) == [C, D]
    lru.discard(B)
    assert B not in lru and lru.candidates(5, always) == [A, E]


def test_evict_any_takes_the_oldest_like_a_predicate_that_allows_all() -> None:
    from tierkv.policies import evict_any

    lru = LRUPolicy(5)
    lru.admit([A, B, C, D, E], 0, always)
    lru.pin(B)
    assert lru.candidates(3, evict_any) == lru.candidates(3, always) == [A, C, D]
    assert lru.candidates(9, evict_any) == [A, C, D, E]
    assert lru.candidates(0, evict_any) == []


def test_touch_takes_any_iterable_and_unpin_many_skips_unpinned_keys() -> None:
    lru = LRUPolicy(4)
    lru.admit([A, B, C, D], 0, always)
    lru.touch(k for k in (B, A))  # a generator: first key ends most recent
    assert lru.eviction_order() == [C, D, A, B]
    lru.pin(C)
    lru.unpin_many([E, C, D])  # E unknown, D not pinned: only C moves, as most recent
    assert lru.eviction_order() == [D, A, B, C]
