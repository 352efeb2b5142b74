"""`ClaimTable`: live claims per key, let go once each, lapsing with their lease."""

from __future__ import annotations

import threading

from hypothesis import given
from hypothesis import strategies as st

from tierkv.contract.claims import ClaimTable


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def table() -> tuple[ClaimTable, Clock]:
    clock = Clock()
    return ClaimTable(clock), clock


def test_a_claim_protects_until_let_go() -> None:
    claims, _ = table()
    claims.protect([b"a", b"b"], 10)
    assert claims.is_protected(b"a") and claims.is_protected(b"b")
    assert not claims.is_protected(b"c")
    claims.unprotect([b"a", b"c"])  # c was never claimed: ignored
    assert not claims.is_protected(b"a") and claims.is_protected(b"b")
    assert len(claims) == 1 and claims.expired == 0


def test_a_key_claimed_twice_needs_two_releases() -> None:
    claims, _ = table()
    claims.protect([b"a"], 10)
    claims.protect([b"a"], 10)
    claims.unprotect([b"a"])
    assert claims.is_protected(b"a")
    claims.unprotect([b"a"])
    assert not claims.is_protected(b"a")
    claims.unprotect([b"a"])  # one release too many changes nothing
    assert len(claims) == 0


def test_a_claim_lapses_when_its_lease_runs_out() -> None:
    claims, clock = table()
    claims.protect([b"a", b"b"], 1.0)
    clock.now += 0.5
    assert claims.is_protected(b"a")
    clock.now += 0.5
    assert not claims.is_protected(b"a")  # at the deadline: gone, counted
    assert claims.expired == 1
    assert claims.sweep() == 0  # b ran out unseen: the sweep counts it
    assert claims.expired == 2 and len(claims) == 0
    claims.unprotect([b"a", b"b"])  # a late release finds nothing
    assert claims.expired == 2


def test_a_release_lets_go_of_the_claim_that_runs_out_first() -> None:
    """Claims are anonymous: after one release, the key is protected as long as the
    longest of the others lasts, and the one that remains is counted once."""
    claims, clock = table()
    claims.protect([b"a"], 1.0)
    claims.protect([b"a"], 5.0)
    claims.unprotect([b"a"])
    clock.now += 2
    assert claims.is_protected(b"a")
    clock.now += 4
    assert claims.sweep() == 0
    assert claims.expired == 1


def test_a_zero_lease_claims_nothing() -> None:
    claims, _ = table()
    claims.protect([b"a"], 0)
    assert not claims.is_protected(b"a") and len(claims) == 0


def test_clear_forgets_everything() -> None:
    claims, _ = table()
    claims.protect([b"a"], 10)
    claims.clear()
    assert not claims.is_protected(b"a") and claims.sweep() == 0


def test_threads_may_check_while_the_loop_claims() -> None:
    """A tier may evict in a worker thread (sqlite): checks race claims safely."""
    claims = ClaimTable()
    keys = [bytes([i]) for i in range(50)]
    stop = threading.Event()
    seen: list[bool] = []

    def check() -> None:
        while not stop.is_set():
            seen.extend(claims.is_protected(k) for k in keys)

    worker = threading.Thread(target=check)
    worker.start()
    for _ in range(200):
        claims.protect(keys, 10)
        claims.unprotect(keys)
    stop.set()
    worker.join()
    assert len(claims) == 0 and claims.expired == 0


@given(
    st.lists(
        st.tuples(st.sampled_from(["protect", "unprotect", "tick"]), st.integers(0, 3)),
        max_size=60,
    )
)
def test_every_claim_ends_once(ops: list[tuple[str, int]]) -> None:
    """Whatever the order: claims taken = claims let go + claims expired + claims
    live, and a key is protected exactly when a claim on it is live."""
    claims, clock = table()
    live: dict[bytes, list[float]] = {}
    released = 0
    taken = 0
    for op, n in ops:
        key = bytes([n])
        if op == "protect":
            claims.protect([key], 1.0 + n)
            live.setdefault(key, []).append(clock.now + 1.0 + n)
            live[key].sort()
            taken += 1
        elif op == "unprotect":
            held = [d for d in live.get(key, []) if d > clock.now]
            if held:
                released += 1
                live[key] = held[1:]
            claims.unprotect([key])
        else:
            clock.now += 0.75
        for k in list(live):
            assert claims.is_protected(k) == any(d > clock.now for d in live[k])
    left = claims.sweep()
    assert taken == released + claims.expired + left
