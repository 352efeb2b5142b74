"""One tier chain per object size, opened when first needed.

A tier's blocks are all one size (`PrimaryView.block_bytes`), while LMCache's objects
come in a size per object group (a hybrid model's attention and state groups differ)
and, with `save_unfull_chunk: true`, a size per partial-chunk length. `SizeChains`
keeps, per size, a `LentSlots` view and a `SyncChain` of the configured tiers over it
(namespace `<namespace>|obj<size>`), all on the process's one tier loop thread. The
sizes in `object_bytes`, and those an nvme tier's path holds from an earlier process,
open with the adapter; another opens the first time an object of its size is stored
or loaded, or a lookup's layout hint names it.

Each size has its own instance of every tier, but a bounded tier section (memory,
nvme) keeps ONE `capacity` for all of them: its instances answer to one
`budget.SharedBudget`, which evicts across sizes before a store would take the section
past it. So a `capacity` a user writes bounds the bytes of that tier however many
sizes come.

`capacity_bytes` is what the chains hold when full, for LMCache's usage fraction:
every tier is written every object, so the chains hold no more distinct objects than
their largest section (the tiers do not add up, nor do the sizes: they share it), in
object bytes (`SharedBudget.object_capacity`). Before any size is open, the largest
tier's configured `capacity`. 0 (unknown) when a tier names no bound of its own (redis,
s3: their server or bucket decides), as LMCache reads 0: no global eviction.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from tierkv.contract.keys import OffloadKey
from tierkv.driver.guarded import GuardedTier
from tierkv.driver.sync_chain import SyncChain, release_shared_loop, shared_loop
from tierkv.integrations.lmcache.budget import SharedBudget, shared_capacity
from tierkv.integrations.lmcache.objects import LentSlots
from tierkv.integrations.lmcache.settings import AdapterSettings
from tierkv.registry import get_tier_class

__all__ = ["SizeChain", "SizeChains", "sizes_on_disk"]

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
        self.budgets: dict[int, SharedBudget] = {}
        """Per bounded tier section (its index in the chain), the capacity its
        instances of every size share."""
        for i, (config, name) in enumerate(zip(settings.tiers, settings.names)):
            capacity = shared_capacity(config)
            if capacity > 0:
                self.budgets[i] = SharedBudget(name, capacity, settings.quotas.get(name))
        self._loop = shared_loop()  # where the budgets live; released by `close`

    def all(self) -> list[SizeChain]:
        return list(self._chains.values())

    def capacity_bytes(self) -> int:
        """What the chains hold when full, in object bytes; 0 when unknown (see the
        module docstring)."""
        chains = self.all()
        if not chains:
            return configured_capacity(self.settings)
        if any(one.capacity_blocks is None for one in chains):
            return 0
        if len(self.budgets) == len(self.settings.tiers):  # every section shared
            return max(b.object_capacity() for b in self.budgets.values())
        # a bounded section without a shared budget: its own capacity per size
        return sum((one.capacity_blocks or 0) * one.size for one in chains)

    def forget(self, okeys: Iterable[OffloadKey]) -> None:
        """Keys deleted from every tier (LMCache's `delete`): the budgets' recency
        stamps go too (on the loop, soon)."""
        if self.budgets and not self._closed:
            keys = list(okeys)
            for budget in self.budgets.values():
                self._loop.loop.call_soon_threadsafe(budget.forget, keys)

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
            on_removed=self._removed,
            quotas=settings.quotas,
        )
        logger.info(
            "tierkv below LMCache's L1: tiers %s for %d-byte objects (namespace %r)",
            ", ".join(settings.names),
            size,
            slots.namespace,
        )
        try:
            self._loop.run(self._adopt(chain), timeout=max(60.0, chain.job_deadline))
        except BaseException:
            chain.close()
            raise
        try:
            blocks = chain.capacity_blocks()
        except Exception as exc:  # a tier that cannot say: no usage fraction
            logger.warning("tierkv below LMCache's L1: %d-byte objects: no capacity: %s", size, exc)
            blocks = None
        return SizeChain(size, slots, chain, blocks)

    async def _adopt(self, chain: SyncChain) -> None:
        """The new size's instances of the shared sections join their budgets (which
        evict across sizes if what they recovered takes a section past `capacity`)."""
        for tier in chain.tiers:
            budget = self.budgets.get(tier.index)
            if budget is not None:
                await budget.adopt(tier)

    def _removed(self, tier: GuardedTier, okeys: tuple[OffloadKey, ...]) -> None:
        """A tier reported keys removed (on the loop): its budget forgets their
        recency, the adapter its record of them."""
        budget = self.budgets.get(tier.index)
        if budget is not None:
            budget.forget(okeys)
        self._on_removed(tier, okeys)

    def close(self) -> None:
        with self._lock:
            already, self._closed = self._closed, True
            chains, self._chains = list(self._chains.values()), {}
        for chain in chains:
            chain.chain.close()
            chain.slots.release()
        if not already:
            release_shared_loop(self._loop)


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


_SIZE_NOTE = "namespace.txt"
"""The file an nvme tier writes in each namespace directory with the namespace's name
(`tierkv_nvme.layout.NAMESPACE_NOTE`)."""


def sizes_on_disk(settings: AdapterSettings) -> list[int]:
    """Object sizes whose nvme directories an earlier process left under a tier's
    `path` (by the namespace each directory's note names): they open with the adapter,
    so the shared capacity counts what they hold from the start."""
    pattern = re.compile(re.escape(settings.namespace) + r"\|obj([1-9][0-9]{0,15})")
    found: set[int] = set()
    for config in settings.tiers:
        if config.type != "nvme":
            continue
        root = Path(str(getattr(config, "path", "")))
        try:
            notes = list(root.glob(f"ns-*/{_SIZE_NOTE}"))
        except OSError:
            continue
        for note in notes:
            try:
                name = note.read_text(encoding="utf-8").strip()
            except (OSError, UnicodeError):
                continue
            match = pattern.fullmatch(name)
            if match:
                found.add(int(match.group(1)))
    return sorted(found)
