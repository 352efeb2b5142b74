"""Per-tenant accounting: what each tenant (`ReqContext.tenant`) looked up, stored and
loaded through the cache, and how much of the primary its blocks fill.

One `TenantCounts` per tenant, found by one dict probe per call (never per block) and
incremented by the call's totals. Bytes are blocks times `block_bytes` (every block is
that size), worked out when reported.

Blocks held in the primary are counted by owner: the tenant whose store (or load,
for a promotion) put a block there owns it until the primary evicts it (its
`removed` event). Only tenants other than the default are tracked key by key (one
dict entry per resident block, set in one call per window, dropped in one call per
eviction); the default tenant holds the rest, so a cache whose requests carry no
tenant pays nothing per block. Secondary tiers are not counted: a tier holds blocks
of several stores and evicts on its own, and says nothing of whose they were.

Memory is bounded: at most `TRACKED` tenants are counted apart; past that, the
smaller half of those holding no primary block are folded into `other` (their counts
added there), and a tenant seen again starts afresh (when every tracked tenant holds
primary blocks, the next `TRACKED / 2` new tenants count as `other` before the ledger
looks again). Reports name the `report_top` tenants that moved the most blocks
(stored + loaded) and sum the rest as `other`.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, fields
from itertools import repeat
from typing import Any

from tierkv.contract.keys import OffloadKey
from tierkv.contract.tenants import DEFAULT_TENANT, OTHER_TENANTS

TRACKED = 4096
"""Tenants counted apart at most (the default and `other` aside)."""


@dataclass(slots=True, eq=False)
class TenantCounts:
    """What one tenant did since the cache was made (hashable by identity: the
    primary's owner table points at it)."""

    lookups: int = 0  # lookup calls
    hits: int = 0  # blocks of the hits (to load; those the GPU holds aside)
    misses: int = 0  # blocks looked up past the hit
    stored_blocks: int = 0  # blocks a store placed in the cache (new ones)
    rejected_blocks: int = 0  # blocks a store reported rejected
    loaded_blocks: int = 0  # blocks a load copied out
    load_failed_blocks: int = 0  # blocks a load reported failed (recompute)
    primary_blocks: int = 0  # blocks of the tenant's in the primary now
    evicted_blocks: int = 0  # blocks of the tenant's the primary evicted
    declined_blocks: int = 0  # blocks a quota declined (any tier)

    @property
    def moved(self) -> int:
        return self.stored_blocks + self.loaded_blocks

    def add(self, other: TenantCounts) -> None:
        for name in _COUNTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))


_COUNTS = tuple(f.name for f in fields(TenantCounts))


class TenantLedger:
    """The counts of every tenant of one cache (see the module docstring)."""

    def __init__(self, block_bytes: int, report_top: int = 10, tracked: int = TRACKED) -> None:
        self.block_bytes = block_bytes
        self.report_top = report_top
        self.tracked = tracked
        self.default = TenantCounts()
        self.other = TenantCounts()
        # tenant name (None: the default) -> its counts; the two reserved names too
        self._by_name: dict[str | None, TenantCounts] = {
            None: self.default,
            "": self.default,
            DEFAULT_TENANT: self.default,
            OTHER_TENANTS: self.other,
        }
        self._named = 0  # entries of _by_name other than the four above
        self._skip = 0  # new tenants to sum as `other` before trying to fold again
        self._owner: dict[OffloadKey, TenantCounts] = {}  # primary blocks of tracked tenants

    # -- the hot path: one probe per call ---------------------------------------------
    def counts(self, tenant: str | None) -> TenantCounts:
        """The counts of `tenant` (made on first sight)."""
        found = self._by_name.get(tenant)
        return found if found is not None else self._new(tenant)

    def looked_up(self, tenant: str | None, hits: int, misses: int) -> None:
        c = self.counts(tenant)
        c.lookups += 1
        c.hits += hits
        c.misses += misses

    def stored(self, tenant: str | None, stored: int, rejected: int) -> None:
        c = self.counts(tenant)
        c.stored_blocks += stored
        c.rejected_blocks += rejected

    def loaded(self, tenant: str | None, ok: int, failed: int) -> None:
        c = self.counts(tenant)
        c.loaded_blocks += ok
        c.load_failed_blocks += failed

    def placed(self, tenant: str | None, keys: Sequence[OffloadKey]) -> None:
        """`keys` became ready in the primary for a call of `tenant`'s: it owns them."""
        c = self.counts(tenant)
        if c is self.default or not keys:
            return  # the default holds whatever no tracked tenant does
        c.primary_blocks += len(keys)
        self._owner.update(dict.fromkeys(keys, c))

    def evicted(self, keys: Sequence[OffloadKey]) -> None:
        """The primary evicted `keys`: their owners hold them no more."""
        owner = self._owner
        if not owner:
            self.default.evicted_blocks += len(keys)
            return
        for c, n in Counter(map(owner.pop, keys, repeat(None, len(keys)))).items():
            if c is None:
                self.default.evicted_blocks += n
            else:
                c.primary_blocks -= n
                c.evicted_blocks += n

    def declined(self, tenant: str | None, n: int) -> None:
        """A quota declined `n` blocks of `tenant`'s."""
        self.counts(tenant).declined_blocks += n

    # -- reports -------------------------------------------------------------------
    def report(self, resident: int) -> dict[str, dict[str, Any]]:
        """Tenant name -> its counts (bytes too): the `report_top` tenants that moved
        the most blocks, then `other` (the rest, summed) when any is left out.
        `resident` is the primary's block count (the default tenant holds those no
        tracked tenant does). Tenants that did nothing yet are left out."""
        self.default.primary_blocks = max(0, resident - len(self._owner))
        candidates = [
            (name, c)
            for name, c in self._by_name.items()
            if c is not self.other and (name is None or c is not self.default) and _active(c)
        ]
        top = heapq.nlargest(self.report_top, candidates, key=lambda item: item[1].moved)
        named = {id(c) for _, c in top}
        rest = TenantCounts()
        rest.add(self.other)
        for _, c in candidates:
            if id(c) not in named:
                rest.add(c)
        report = {DEFAULT_TENANT if name is None else name: self._row(c) for name, c in top}
        if _active(rest):
            report[OTHER_TENANTS] = self._row(rest)
        return report

    def empty_row(self) -> dict[str, Any]:
        """A row of no counts (for a tenant only a quota book knows)."""
        return self._row(TenantCounts())

    def _row(self, c: TenantCounts) -> dict[str, Any]:
        b = self.block_bytes
        return {
            "lookups": c.lookups,
            "hits": c.hits,
            "misses": c.misses,
            "stored_blocks": c.stored_blocks,
            "stored_bytes": c.stored_blocks * b,
            "rejected_blocks": c.rejected_blocks,
            "loaded_blocks": c.loaded_blocks,
            "loaded_bytes": c.loaded_blocks * b,
            "load_failed_blocks": c.load_failed_blocks,
            "primary_blocks": c.primary_blocks,
            "primary_bytes": c.primary_blocks * b,
            "evicted_blocks": c.evicted_blocks,
            "declined_blocks": c.declined_blocks,
        }

    def __len__(self) -> int:
        """Tenants counted apart now (the default and `other` aside)."""
        return self._named

    # -- bounded memory ----------------------------------------------------------------
    def _new(self, tenant: str | None) -> TenantCounts:
        if self._named >= self.tracked:
            if self._skip:
                self._skip -= 1
                return self.other
            self._fold()
            if self._named >= self.tracked:  # every tracked tenant holds primary blocks:
                self._skip = self.tracked // 2  # look again after this many new ones
                return self.other
        c = self._by_name[tenant] = TenantCounts()
        self._named += 1
        return c

    def _fold(self) -> None:
        """Fold the smaller half (by blocks moved) of the tenants that hold no primary
        block (so no owner entry points at them) into `other`: once per `tracked / 2`
        new tenants at most."""
        idle = [
            (name, c)
            for name, c in self._by_name.items()
            if c is not self.default and c is not self.other and c.primary_blocks == 0
        ]
        for name, c in heapq.nsmallest(max(1, self.tracked // 2), idle, key=lambda i: i[1].moved):
            self.other.add(c)
            del self._by_name[name]
            self._named -= 1


def _active(c: TenantCounts) -> bool:
    """Whether `c` counted anything yet."""
    return any(getattr(c, name) for name in _COUNTS)
