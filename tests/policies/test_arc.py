"""ARC policy rules, step by step on a capacity-4 cache."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tierkv.policies import ARCPolicy

A, B, C, D, E, F, G = (bytes([c]) for c in b"ABCDEFG")


def always(_: bytes) -> bool:
    return True


def state(arc: ARCPolicy) -> tuple[list[bytes], list[bytes], list[bytes], list[bytes], float]:
    return arc.t1, arc.t2, arc.b1, arc.b2, arc.target


def test_arc_walkthrough() -> None:
    arc = ARCPolicy(4)
    assert arc.admit([A, B, C, D], 0, always) == []
    assert state(arc) == ([A, B, C, D], [], [], [], 0.0)

    arc.touch([A])  # seen again: T1 -> T2
    assert state(arc) == ([B, C, D], [A], [], [], 0.0)

    assert arc.admit([E], 1, always) == [B]  # T1 larger than target: its LRU goes
    assert state(arc) == ([C, D, E], [A], [B], [], 0.0)

    assert arc.admit([B], 1, always) == [C]  # ghost hit in B1: target grows, B -> T2
    assert state(arc) == ([D, E], [A, B], [C], [], 1.0)

    assert arc.admit([F], 1, always) == [D]
    assert arc.admit([G], 1, always) == [E]
    # |T1| + |B1| <= c: the oldest ghost C was dropped
    assert state(arc) == ([F, G], [A, B], [D, E], [], 1.0)

    assert arc.admit([D], 1, always) == [A]  # ghost hit: p=2, |T1| == p -> evict from T2
    assert state(arc) == ([F, G], [B, D], [E], [A], 2.0)

    assert arc.admit([A], 1, always) == [F]  # ghost hit in B2: target shrinks
    assert state(arc) == ([G], [B, D, A], [E, F], [], 1.0)


def test_touch_in_t2_moves_to_most_recent_first_key_last() -> None:
    arc = ARCPolicy(4)
    arc.admit([A, B, C], 0, always)
    arc.touch([A, B, C])
    assert arc.t2 == [C, B, A]
    arc.touch([C])
    assert arc.t2 == [B, A, C]


def test_preferred_list_without_evictable_keys_falls_back() -> None:
    arc = ARCPolicy(4)
    arc.admit([A, B, C, D], 0, always)
    arc.touch([C, D])  # T1 = [A, B], T2 = [D, C]
    # T1 is preferred (|T1| > p = 0) but nothing there is evictable
    assert arc.admit([E], 1, lambda k: k in (C, D)) == [D]
    assert arc.b2 == [D]


def test_refused_admit_changes_nothing_not_even_the_target() -> None:
    arc = ARCPolicy(4)
    arc.admit([A, B, C, D], 0, always)
    arc.admit([E], 1, always)  # B1 = [A]
    before = state(arc)
    assert arc.admit([A], 2, lambda k: k == C) is None  # a ghost hit, but refused
    assert state(arc) == before


def test_discard_leaves_no_ghost() -> None:
    arc = ARCPolicy(2)
    arc.admit([A, B], 0, always)
    arc.discard(A)
    assert state(arc) == ([B], [], [], [], 0.0)


@given(
    st.lists(
        st.tuples(st.sampled_from(["admit", "touch", "discard"]), st.integers(0, 15)),
        max_size=200,
    )
)
def test_ghost_lists_stay_bounded_and_lists_disjoint(ops: list[tuple[str, int]]) -> None:
    c = 4
    arc = ARCPolicy(c)
    resident = 0
    for op, i in ops:
        key = bytes([i])
        if op == "admit" and key not in arc:
            victims = arc.admit([key], 1 if resident >= c else 0, always)
            assert victims is not None
            resident += 1 - len(victims)
        elif op == "touch":
            arc.touch([key])
        elif op == "discard" and key in arc:
            arc.discard(key)
            resident -= 1
        t1, t2, b1, b2 = map(set, (arc.t1, arc.t2, arc.b1, arc.b2))
        assert len(t1) + len(t2) == resident == len(arc) <= c
        assert len(t1) + len(b1) <= c
        assert len(t1) + len(t2) + len(b1) + len(b2) <= 2 * c
        assert not (t1 & t2) and not ((t1 | t2) & (b1 | b2)) and not (b1 & b2)
        assert 0 <= arc.target <= c


def test_pinned_keys_leave_the_victim_order_and_keep_their_list() -> None:
    arc = ARCPolicy(4)
    arc.admit([A, B, C, D], 0, always)
    arc.touch([B])  # B -> T2
    arc.pin(A)
    arc.pin(B)
    seen: list[bytes] = []

    def spy(key: bytes) -> bool:
        seen.append(key)
        return True

    assert arc.candidates(2, spy) == [C, D] and A not in seen and B not in seen
    assert len(arc) == 4 and A in arc and B in arc
    assert set(arc.t1) == {A, C, D} and arc.t2 == [B]
    arc.unpin(A)
    arc.unpin(B)
    assert arc.candidates(4, always) == [C, D, A, B]
    arc.pin(C)
    arc.discard(C)
    assert C not in arc and len(arc) == 3
