"""One tier chain per object size, opened when first needed.

A tier's blocks are all one size (`PrimaryView.block_bytes`), while LMCache's objects
come in a size per object group (a hybrid model's attention and state groups differ).
`SizeChains` keeps, per size, a `LentSlots` view and a `SyncChain` of the configured
tiers over it (namespace `<namespace>|obj<size>`), all on the process's one tier loop
thread. The sizes in `object_bytes` open with the adapter; another opens the first
time an object of its size is stored or loaded, or a lookup's layout hint names it.

`capacity_bytes` is what the chains hold when full, for LMCache's usage fraction:
per size, its largest tier (every tier is written every object, so a chain holds no
more distinct objects than its largest tier; the tiers do not add up), summed over
the sizes open (each size's tiers have the whole configured capacity, in their own
namespace). Before any size is open, the largest tier's configured `capacity`.
0 (unknown) when a tier names no bound of its own (redis, s3: their server or bucket
decides), as LMCache reads 0: no global eviction.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from tierkv.contract.keys import OffloadKey
from tierkv.driver.guarded import GuardedTier
from tierkv.driver.sync_chain import SyncChain
from tierkv.integrations.lmcache.objects import LentSlots
from tierkv.integrations.lmcache.settings import AdapterSettings
from tierkv.registry import get_tier_class

__all__ = ["SizeChain", "SizeChains"]

logger = logging.getLogger(__name__)

Removed = Callable[[GuardedTier, tuple[OffloadKey, ...]], None]


@dataclass
class SizeChain:
    """The tiers holding objects of `size` bytes."""

    size: int
    slots: LentSlots
    chain: SyncChain
    capacity_blocks: int | None = None
    """Objects the chain holds when full (its largest tier); None: unbounded."""


class SizeChains:
    """Per object size, its tier chain (see the module docstring); thread-safe."""

    def __init__(
        self, settings: AdapterSettings, on_removed: Removed, tags: dict[str, str]
    ) -> None:
        self.settings = settings
        self._on_removed = on_removed
        self._tags = tags
        self._chains: dict[int, SizeChain] = {}
        self._lock = threading.Lock()
        self._closed = False

    def all(self) -> list[SizeChain]:
        return list(self._chains.values())

    def capacity_bytes(self) -> int:
        """What the chains hold when full, in object bytes; 0 when unknown (see the
        module docstring)."""
        chains = self.all()
        if not chains:
            return configured_capacity(self.settings)
        total = 0
        for one in chains:
            if one.capacity_blocks is None:
                return 0
            total += one.capacity_blocks * one.size
        return total

    def get(self, size: int) -> SizeChain:
        """The chain for `size`, opened now if it is new (`TierUnavailable` when a
        required tier does not open; `RuntimeError` after `close`)."""
        found = self._chains.get(size)
        if found is not None:
            return found
        with self._lock:
            if self._closed:
                raise RuntimeError("the tierkv L2 adapter is closed")
            found = self._chains.get(size)
            if found is None:
                found = self._open(size)
                self._chains[size] = found
            return found

    def _open(self, size: int) -> SizeChain:
        settings = self.settings
        slots = LentSlots(size, settings.namespace_for(size))
        chain = SyncChain(
            settings.tiers,
            settings.names,
            slots,
            lookup_timeout=settings.lookup_timeout,
            tags=dict(self._tags, object_bytes=str(size)),
            on_removed=self._on_removed,
        )
        logger.info(
            "tierkv below LMCache's L1: tiers %s for %d-byte objects (namespace %r)",
            ", ".join(settings.names),
            size,
            slots.namespace,
        )
        try:
            blocks = chain.capacity_blocks()
        except Exception as exc:  # a tier that cannot say: no usage fraction
            logger.warning("tierkv below LMCache's L1: %d-byte objects: no capacity: %s", size, exc)
            blocks = None
        return SizeChain(size, slots, chain, blocks)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            chains, self._chains = list(self._chains.values()), {}
        for chain in chains:
            chain.chain.close()
            chain.slots.release()


def configured_capacity(settings: AdapterSettings) -> int:
    """The largest tier's configured `capacity` in bytes, 0 when some tier has no
    bound it can name (its type does not report its evictions and room)."""
    largest = 0
    for config in settings.tiers:
        cls = get_tier_class(config.type)
        capacity = int(getattr(config, "capacity", 0) or 0)
        if not (cls.names_eviction_candidates and cls.reports_evictions) or capacity <= 0:
            return 0
        largest = max(largest, capacity)
    return largest
