"""Quotas on a secondary tier, kept by the cache from outside the tier.

A tier evicts by itself, in its own order, knowing nothing of tenants. The cache holds
a tier to its quotas before each cascade (`plan`): it counts who holds what there (a
`QuotaBook` fed by the tier's confirmed stores and its removal reports), and when the
tier lacks room for a tenant's blocks it removes the victims the quota rule allows
(`tierkv.quotas.book`) itself, first, so the tier's own eviction has nothing to take;
blocks the rule finds no room for are declined for that tier and counted.

That needs a tier that says how much room it has and which blocks it would evict
next, and reports every block that leaves it (`names_eviction_candidates` and
`reports_evictions`: the memory and nvme tiers). Tiers that cannot (a Redis under
`maxmemory`, S3, Mooncake) are counted, never enforced: the book holds what this
cache stored there less what it learnt was removed, and a log line at the first
cascade says the quota is not enforced.

Approximate under concurrency by design: the plan counts the cascades in flight to
the tier, but two tenants' cascades planned in the same instant may both count on the
same free room, and the tier then evicts one block in its own order. The book's counts
stay exact.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from itertools import islice
from typing import NamedTuple

from tierkv.contract.keys import OffloadKey
from tierkv.contract.tenants import DEFAULT_TENANT
from tierkv.contract.tier import SecondaryTierManager
from tierkv.quotas.book import CanEvict, QuotaBook, tenant_name
from tierkv.quotas.config import TierQuotas

logger = logging.getLogger(__name__)

_WALK = 8
"""A plan walks at most this many eviction candidates per block it needs, past the
first thousand: a tenant whose own blocks are buried under others' gives up early
(its blocks are declined) instead of walking the whole tier on the event loop."""


class Plan(NamedTuple):
    """What one cascade of a tenant's blocks may do on a tier."""

    send: list[OffloadKey]  # keys to store, in key order
    victims: list[OffloadKey]  # keys to remove from the tier first
    declined: list[OffloadKey]  # keys the quota keeps out of the tier
    grows: int = 0  # new blocks for the tenant, pending until the store answers


def can_enforce(tier: type[SecondaryTierManager] | SecondaryTierManager) -> bool:
    """Whether the cache can hold `tier` to quotas (see the module docstring)."""
    return bool(tier.names_eviction_candidates and tier.reports_evictions)


class TierQuotaGate:
    """The quotas of one secondary tier: plans cascades and keeps the book."""

    def __init__(
        self, tier: SecondaryTierManager, quotas: TierQuotas, block_bytes: int, *, name: str
    ) -> None:
        self.tier = tier
        self.quotas = quotas
        self.block_bytes = block_bytes
        self.name = name
        self.enforced = can_enforce(tier)
        self._book: QuotaBook | None = None
        self._victims: set[OffloadKey] = set()  # chosen by a plan, not yet removed

    @property
    def book(self) -> QuotaBook:
        """The tier's book, made at first use: a tier's capacity is known once open."""
        if self._book is None:
            if self.enforced:
                capacity = self.tier.room().capacity_blocks
                self._book = QuotaBook(
                    self.quotas, capacity, self.block_bytes, tier=self.name, strict=False
                )
            else:  # counted, not enforced: no caps
                logger.warning(
                    "tenants.quotas.%s: tier %s (%s) cannot bound blocks per tenant (it "
                    "does not name its eviction candidates and report its evictions): "
                    "its quotas are counted, not enforced",
                    self.name,
                    self.name,
                    self.tier.get_tier_type(),
                )
                self._book = QuotaBook(TierQuotas(), 0, self.block_bytes, tier=self.name)
        return self._book

    @property
    def opened_book(self) -> QuotaBook | None:
        """The book if made yet (reports never make it: a tier may be closed)."""
        return self._book

    def plan(
        self,
        keys: Sequence[OffloadKey],
        tenant: str | None,
        pending: int,
        *,
        reserve: bool = True,
    ) -> Plan:
        """How a cascade of `keys` (in key order) for `tenant` fits the tier's quotas,
        with `pending` blocks already on their way to the tier. With `reserve`, the
        plan's new blocks count as the tenant's and its victims as gone until `stored`
        settles it (stores run concurrently); without, it changes nothing (a look
        ahead, as admission's)."""
        book = self.book
        if not self.enforced:
            return Plan(list(keys), [], [])
        name = tenant_name(tenant)
        owner = book.owner
        fresh = [k for k in keys if k not in owner]  # the rest are there already
        if not fresh:
            return Plan(list(keys), [], [])
        room = self.tier.room()
        free = room.free_blocks - pending
        took = min(book.usable_free(name, max(0, free)), len(fresh))
        need = len(fresh) - took
        victims: list[OffloadKey] = []
        if need > 0:
            mine = set(keys) | self._victims  # nor a block another plan is removing
            # the first blocks the writes in flight will displace are theirs
            skip = max(0, -free)
            walk = 1024 + _WALK * need

            def candidates(limit: int, may_take: CanEvict) -> list[OffloadKey]:
                found: list[OffloadKey] = []
                order = islice(self.tier.eviction_candidates(), skip, skip + walk)
                for key in order:
                    if may_take(key):
                        found.append(key)
                        if len(found) == limit:
                            break
                return found

            victims = book.choose_victims(name, took, need, candidates, lambda k: k not in mine)
        admitted = min(took + len(victims), len(fresh))
        if reserve:
            self._mark(victims)
            _bump(book.pending, name, admitted)
        if admitted >= len(fresh):
            return Plan(list(keys), victims, [], admitted)
        declined = fresh[admitted:]  # the fresh keys from the first one without room
        out = set(declined)
        return Plan([k for k in keys if k not in out], victims, declined, admitted)

    def _mark(self, victims: list[OffloadKey]) -> None:
        """`victims` are being removed: no other plan takes them, and their owners
        count them gone already."""
        book = self.book
        for key in victims:
            _bump(book.leaving, book.owner.get(key, DEFAULT_TENANT), 1)
        self._victims.update(victims)

    def unmark(self, victims: Sequence[OffloadKey]) -> None:
        """`victims` were not removed after all (the tier failed to): theirs again."""
        book = self.book
        for key in victims:
            if key in self._victims:
                self._victims.discard(key)
                _bump(book.leaving, book.owner.get(key, DEFAULT_TENANT), -1)

    def stored(self, tenant: str | None, plan: Plan, keys: Sequence[OffloadKey]) -> None:
        """The store `plan` was for answered: the tier took `keys` for `tenant` (keys
        it held already keep their owner); the plan's blocks are pending no more."""
        book = self.book
        name = tenant_name(tenant)
        owner = book.owner
        _bump(book.pending, name, -plan.grows)
        book.add(name, [k for k in keys if k not in owner])

    def removed(self, keys: Sequence[OffloadKey]) -> None:
        """The tier no longer holds `keys`."""
        if self._book is not None:
            self.unmark(keys)  # removed: gone for real now
            self._book.remove(keys)


def _bump(counts: dict[str, int], name: str, by: int) -> None:
    """Add `by` to `counts[name]`, dropping the entry at zero."""
    left = counts.get(name, 0) + by
    if left > 0:
        counts[name] = left
    else:
        counts.pop(name, None)
