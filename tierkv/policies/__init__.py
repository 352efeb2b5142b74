"""Eviction policies for the primary tier: `lru` and `arc`."""

from __future__ import annotations

from tierkv.policies.arc import ARCPolicy
from tierkv.policies.base import CanEvict, EvictionPolicy, evict_any
from tierkv.policies.lru import LRUPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """The policy called `name` (`lru` or `arc`) for `capacity` slots."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of {', '.join(sorted(POLICIES))}"
        ) from None
    return cls(capacity)


__all__ = [
    "ARCPolicy",
    "CanEvict",
    "EvictionPolicy",
    "LRUPolicy",
    "POLICIES",
    "evict_any",
    "make_policy",
]
