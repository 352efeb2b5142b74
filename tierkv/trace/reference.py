"""What a trace allows, computed from the trace alone: the references a replay's hit
rate is judged against. A request is served its longest prefix of blocks present in
the cache when it arrives (a block after a missing one is recomputed anyway, as in a
prefix cache), and then every block of its prompt is in the cache."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence

Keys = Sequence[Sequence[bytes]]


def infinite_cache_hits(requests: Keys) -> int:
    """Blocks served by a cache that never evicts: the best any policy can do."""
    seen: set[bytes] = set()
    served = 0
    for keys in requests:
        served += _leading_hits(keys, seen)
        seen.update(keys)
    return served


def lru_hits(requests: Keys, capacity: int) -> int:
    """Blocks served by one plain LRU cache of `capacity` blocks that keeps every block
    of every prompt (the same-capacity reference: a chain serving less than this is
    losing blocks somewhere)."""
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    cache: OrderedDict[bytes, None] = OrderedDict()
    served = 0
    for keys in requests:
        served += _leading_hits(keys, cache)
        for key in keys:
            cache[key] = None
            cache.move_to_end(key)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return served


def _leading_hits(keys: Sequence[bytes], present: Container[bytes]) -> int:
    """How many of a request's blocks, from the first, `present` holds: a prefix cache
    serves no block after the first it lacks."""
    served = 0
    for key in keys:
        if key not in present:
            break
        served += 1
    return served
