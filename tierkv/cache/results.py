"""What `TieredCache` hands back: the results of lookup, store and load, and stats."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from tierkv.contract.keys import OffloadKey
from tierkv.hits import GroupHit, combine_group_hits
from tierkv.layout import GroupSpec


@dataclass(frozen=True)
class LookupResult:
    """What a lookup found.

    `hit_tokens` is the longest prefix every group can serve (tokens the GPU already
    holds included). `group_keys[g]` are the keys group `g` needs loaded to serve it
    (every block before the hit for a full-attention group, only the window's blocks
    for a sliding-window group; blocks the GPU already holds left out), and
    `group_ranges[g]` the block indices of the needed range. `locations` says where
    each needed key lives now: `"cpu"` (the primary) or a secondary tier's name.
    `gpu_tokens` is what the lookup was told the GPU holds (its leading blocks of
    every group count as present and are not in `group_keys`).
    """

    hit_tokens: int
    group_keys: tuple[tuple[OffloadKey, ...], ...]
    group_ranges: tuple[GroupHit, ...]
    locations: Mapping[OffloadKey, str]
    gpu_tokens: int = 0

    @property
    def keys_to_load(self) -> tuple[OffloadKey, ...]:
        """All needed keys, group by group: what to pass to `load`."""
        return tuple(k for keys in self.group_keys for k in keys)

    def count_in(self, medium: str) -> int:
        """How many needed blocks live in `medium` now."""
        return sum(1 for m in self.locations.values() if m == medium)


@dataclass(frozen=True)
class StoreResult:
    """`stored` are resident in the primary or accepted by at least one tier (a store
    larger than the primary streams through it); `already_present` were ready in the
    primary (a block another store or a promotion was writing counts only once that
    write succeeded: the store waits for it, and writes the block itself if it
    failed); `rejected` could not be placed (nothing changed for them; the
    server may simply not cache them), with the reason in `error`. A partial store
    keeps the longest prefix: every rejected key comes after every stored one.
    `skipped` are blocks the store left out on purpose: given `positions`, no hit at a
    checkpoint can use them (`tierkv.retention`); they are neither stored nor an error."""

    stored: tuple[OffloadKey, ...] = ()
    already_present: tuple[OffloadKey, ...] = ()
    rejected: tuple[OffloadKey, ...] = ()
    error: str | None = None
    skipped: tuple[OffloadKey, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.rejected and self.error is None


@dataclass(frozen=True)
class LoadResult:
    """`ok_keys` are in the destination; `failed_keys` are not (recompute them), with a
    reason each in `errors`. `sources` says which medium served each ok key."""

    ok_keys: tuple[OffloadKey, ...] = ()
    failed_keys: tuple[OffloadKey, ...] = ()
    errors: Mapping[OffloadKey, str] = field(default_factory=lambda: MappingProxyType({}))
    sources: Mapping[OffloadKey, str] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def ok(self) -> bool:
        return not self.failed_keys


@dataclass(frozen=True)
class CacheStats:
    """Counters per medium: `primary` and each secondary tier by name, in chain order;
    and per tenant (`tierkv.cache.tenants`): the `tenants.report_top` that moved the
    most blocks by name (`default`: requests with no tenant), the rest as `other`."""

    primary: dict[str, Any]
    tiers: dict[str, dict[str, Any]]
    tenants: dict[str, dict[str, Any]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"primary": self.primary, "tiers": self.tiers, "tenants": self.tenants}


def served_after_load(
    groups: Sequence[GroupSpec], hit: LookupResult, ok_keys: Iterable[OffloadKey]
) -> int:
    """The longest prefix the blocks that loaded (`ok_keys`, out of `hit.keys_to_load`)
    and those the GPU holds can serve, by the same rule as the lookup (`tierkv.hits`).
    A block the hit did not ask to load counts as absent: a shorter hit of a
    sliding-window group needs an earlier window, which was never loaded."""
    ok = set(ok_keys)
    if all(k in ok for k in hit.keys_to_load):
        return hit.hit_tokens
    present: list[list[bool]] = []
    for group, r, keys in zip(groups, hit.group_ranges, hit.group_keys):
        on_gpu = min(r.end, hit.gpu_tokens // group.block_size)
        flags = [j < on_gpu for j in range(r.end)]
        # group_keys[g]: blocks [first, end) of the range the GPU lacks, in order
        for j, key in zip(range(max(r.first, on_gpu), r.end), keys):
            flags[j] = key in ok
        present.append(flags)
    return combine_group_hits(groups, present)[0]
