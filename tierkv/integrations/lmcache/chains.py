"""One tier chain per object size, opened when first needed.

A tier's blocks are all one size (`PrimaryView.block_bytes`), while LMCache's objects
come in a size per object group (a hybrid model's attention and state groups differ).
`SizeChains` keeps, per size, a `LentSlots` view and a `SyncChain` of the configured
tiers over it (namespace `<namespace>|obj<size>`), all on the process's one tier loop
thread. The sizes in `object_bytes` open with the adapter; another opens the first
time an object of its size is stored or loaded, or a lookup's layout hint names it.
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

__all__ = ["SizeChain", "SizeChains"]

logger = logging.getLogger(__name__)

Removed = Callable[[GuardedTier, tuple[OffloadKey, ...]], None]


@dataclass
class SizeChain:
    """The tiers holding objects of `size` bytes."""

    size: int
    slots: LentSlots
    chain: SyncChain


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
        return SizeChain(size, slots, chain)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            chains, self._chains = list(self._chains.values()), {}
        for chain in chains:
            chain.chain.close()
            chain.slots.release()
