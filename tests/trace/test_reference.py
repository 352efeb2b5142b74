"""The references a replay is judged against (tierkv.trace.reference)."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from tierkv.trace.reference import infinite_cache_hits, lru_hits

A, B, C, D = b"a", b"b", b"c", b"d"


def test_infinite_cache_serves_each_prefix_seen_before() -> None:
    trace = [[A, B], [A, B, C], [A, D], [B]]
    # 0, then a b, then a (d new), then b alone is a different block but seen: 1
    assert infinite_cache_hits(trace) == 0 + 2 + 1 + 1


def test_lru_evicts_the_least_recent_and_the_prefix_stops_at_a_miss() -> None:
    trace = [[A, B], [C, D], [A, B]]
    assert lru_hits(trace, 2) == 0  # a, b evicted by c, d
    assert lru_hits(trace, 4) == 2
    assert lru_hits([[A, B], [B, A], [A, C]], 2) == 2 + 1


requests = st.lists(
    st.lists(st.sampled_from([A, B, C, D, b"e", b"f"]), max_size=6, unique=True), max_size=25
)


@settings(max_examples=80, deadline=None)
@given(requests)
def test_lru_grows_with_capacity_up_to_the_infinite_cache(trace: list[list[bytes]]) -> None:
    served = [lru_hits(trace, c) for c in range(8)]
    assert served == sorted(served)  # LRU keeps what a smaller LRU keeps
    assert served[-1] == infinite_cache_hits(trace)  # 6 distinct blocks all fit
