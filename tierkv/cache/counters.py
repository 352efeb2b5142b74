"""The cache-wide counters: blocks and events the cache counts as a whole, not per tier.

One dataclass, so a counter is declared once: the parts increment it by attribute
(`core.counters.store_waits += 1`), `TieredCache.stats()` reports every field in
`stats().primary` under its own name, and `tierkv.metrics` exports each field as the
Prometheus counter named in its metadata (with the help text beside it), so a new
counter cannot be left out of either.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


def _counter(metric: str, doc: str) -> Any:
    """A counter field, starting at 0, exported as `tierkv_<metric>_total`."""
    return field(default=0, metadata={"metric": metric, "doc": doc})


@dataclass(slots=True)
class CacheCounters:
    """Counts since the cache was made (never reset); field order is the order
    `stats().primary` lists them in."""

    store_rejected: int = _counter(
        "store_rejected_blocks",
        "Blocks a store reported rejected: no room in the primary, and no tier below "
        "accepted the blocks that would free it, within store_timeout",
    )
    store_waits: int = _counter(
        "store_waits",
        "Times a store waited for cascades to release primary slots (not rejected)",
    )
    write_back_dropped: int = _counter(
        "write_back_dropped_blocks",
        "Dirty blocks given up for a write-back tier: past write_back_max_dirty while the "
        "tier was down, or after repeated failed write-backs",
    )
    promotions_shed: int = _counter(
        "promotions_shed_blocks",
        "Blocks a load reported failed (recompute): no primary room for their promotion "
        "within promotion_wait",
    )
    promotion_waits: int = _counter(
        "promotion_waits",
        "Times a load was woken by room released for its promotion (waited, not shed)",
    )
    load_fallbacks: int = _counter(
        "load_fallback_blocks",
        "Blocks a load found further down the chain after every tier it knew of failed them",
    )
    store_skipped: int = _counter(
        "store_skipped_blocks",
        "Blocks a store left out: sliding-window and state blocks no hit at a checkpoint "
        "can use (layout.checkpoint_every)",
    )
    prefetched_blocks: int = _counter(
        "prefetched_blocks",
        "Blocks prefetches promoted into the primary for queued requests",
    )
    prefetch_used: int = _counter(
        "prefetch_used_blocks",
        "Prefetched blocks a load then read from the primary or joined while in flight",
    )
    prefetch_cancelled: int = _counter(
        "prefetch_cancelled_blocks",
        "Prefetched (or still reading) blocks released unused by cancel_prefetch",
    )
    prefetch_shed: int = _counter(
        "prefetch_shed_blocks",
        "Blocks a prefetch did not promote: its share of the promotion reserve (prefetch_share) "
        "or the room was taken, or loads waited for room (best_effort, or past its timeout)",
    )

    def as_dict(self) -> dict[str, int]:
        """Field name -> count, in declaration order (what `stats().primary` holds)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def metrics(cls) -> dict[str, tuple[str, str]]:
        """Field name -> (metric name without prefix and `_total`, help text)."""
        return {f.name: (f.metadata["metric"], f.metadata["doc"]) for f in fields(cls)}
