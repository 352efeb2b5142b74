"""Lookup: the longest prefix the chain can serve, and where each needed block is.

The primary answers first (a dict probe per key). Keys it lacks go to the secondary
tiers concurrently, each tier asked once, under `lookup_timeout`, and only about keys
the index does not already place in a tier above it. A key is located in the highest
tier that claims it and whose claim has not failed before. The hit is then combined
across groups in one pass per group (`tierkv.hits`). The hit is the truth whatever
the primary's size: the promotion reserve bounds staging in `load`, not the hit.

Tokens the GPU already holds (`gpu_tokens`) count as present and are not asked about.

A lookup claims the blocks of its hit in the tier each is read from
(`tierkv.driver.claims`): the claims are taken as each tier answers, with no await in
between, and those the hit does not need are let go once it is known; the request's
load (or its end, or the lease) lets the rest go. A lookup without a `request_id`
claims the same way, under an owner of its own: a load without one ends, per key, the
oldest such claim.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import MappingProxyType

import anyio

from tierkv.cache.core import CacheCore
from tierkv.cache.results import LookupResult
from tierkv.cache.validate import check_keys
from tierkv.contract.jobs import ReqContext
from tierkv.contract.keys import OffloadKey
from tierkv.driver import GuardedTier
from tierkv.driver.claims import Taken
from tierkv.hits import GroupHit, combine_group_hits
from tierkv.primary import MEDIUM as PRIMARY_MEDIUM

_GPU = "gpu"


class Lookup:
    def __init__(
        self,
        core: CacheCore,
        on_hits: Callable[[Sequence[OffloadKey], ReqContext, Sequence[OffloadKey]], None]
        | None = None,
    ) -> None:
        self.core = core
        # called with every key the request looked up, its context, and the keys past
        # the hit: selective write-through counts hits, reuse admission sightings
        self.on_hits = on_hits

    async def locate(
        self,
        missing: Sequence[OffloadKey],
        ctx: ReqContext,
        taken: list[Taken] | None = None,
    ) -> dict[OffloadKey, int]:
        """Ask the tiers, concurrently and once each, where `missing` keys are; return
        key -> tier index for the keys some tier holds. With `taken`, every key a tier
        reports held is claimed there as it answers (appended to `taken`).

        A tier is asked only about keys the index does not place in a tier above it. A
        key the index placed that its tier now denies (or fails to answer for) is asked
        once more of the tiers below believed to hold it: a tier that lost a block
        without telling (a redis restarted empty) must not hide the copy below."""
        core = self.core
        if not missing or not core.tiers:
            return {}
        index = core.index
        known = {k: index.location(k) for k in missing}
        asks: list[tuple[GuardedTier, list[OffloadKey]]] = []
        for handle in core.tiers:
            i = handle.index
            ask = [k for k in missing if (loc := known[k]) is None or loc >= i]
            if ask:
                asks.append((handle, ask))
        found = await self._ask(asks, ctx, taken)
        again = [
            k
            for k in missing
            if k not in found and (loc := known[k]) is not None and index.held(k) >> (loc + 1)
        ]
        if again:  # rare: only after a tier denied (or failed) what the index placed there
            asks = []
            for handle in core.tiers:
                i = handle.index
                ask = [k for k in again if i > (known[k] or 0) and index.held(k) >> i & 1]
                if ask:
                    asks.append((handle, ask))
            found.update(await self._ask(asks, ctx, taken))
        return found

    async def ask_below(
        self, floors: dict[OffloadKey, int], ctx: ReqContext
    ) -> dict[OffloadKey, int]:
        """A load's last resort for keys every tier it knew of failed to serve: ask
        each usable tier below `floors[key]` that the index does not already place the
        key in (and whose claim has not failed), once, concurrently. Key -> highest
        tier that has it. Counted per tier as `fallback_lookups` / `fallback_hits`."""
        index = self.core.index
        asks: list[tuple[GuardedTier, list[OffloadKey]]] = []
        for handle in self.core.tiers:
            i = handle.index
            ask = [
                k
                for k, floor in floors.items()
                if i > floor and not index.held(k) >> i & 1 and index.believes(k, i)
            ]
            if ask and handle.usable("load"):
                asks.append((handle, ask))
                handle.stats.fallback_lookups += len(ask)
        found = await self._ask(asks, ctx)
        for handle, ask in asks:
            handle.stats.fallback_hits += sum(1 for k in ask if index.held(k) >> handle.index & 1)
        return found

    async def _ask(
        self,
        asks: list[tuple[GuardedTier, list[OffloadKey]]],
        ctx: ReqContext,
        taken: list[Taken] | None = None,
    ) -> dict[OffloadKey, int]:
        """One round: each tier asked (concurrently) about its keys in `asks`; with
        `taken`, what each reports held is claimed there before anything else runs."""
        index = self.core.index
        timeout = self.core.config.lookup_timeout
        answers: list[list[bool] | None] = [None] * len(asks)
        claims = self.core.claims

        async def ask_one(n: int, handle: GuardedTier, keys: list[OffloadKey]) -> None:
            def claim(flags: list[bool]) -> None:  # the moment the tier answers
                taking = claims.take(handle, [k for k, f in zip(keys, flags) if f])
                if taking is not None and taken is not None:
                    taken.append(taking)

            wants = taken is not None and handle.claim_lease
            answers[n] = await handle.lookup(keys, ctx, timeout, claim if wants else None)

        if len(asks) == 1:
            await ask_one(0, *asks[0])
        elif asks:
            async with anyio.create_task_group() as tg:
                for n, (handle, keys) in enumerate(asks):
                    tg.start_soon(ask_one, n, handle, keys)
        found: dict[OffloadKey, int] = {}
        for (handle, keys), flags in zip(asks, answers):
            if flags is None:
                continue
            i = handle.index
            held: list[OffloadKey] = []
            for key, present in zip(keys, flags):
                if present and index.believes(key, i):
                    held.append(key)
                    prev = found.get(key)
                    if prev is None or i < prev:
                        found[key] = i
                elif not present:
                    index.note_missing(key, i)
            # every tier that holds a key is remembered, not only the highest: a load
            # whose copy above fails (evicted since, by another server's Redis) then
            # goes on down the chain
            index.note_held(held, i)
            handle.stats.hits += len(held)
            handle.stats.misses += len(keys) - len(held)
        return found

    async def lookup(
        self,
        keys_per_group: Sequence[Sequence[OffloadKey]],
        ctx: ReqContext,
        gpu_tokens: int = 0,
    ) -> LookupResult:
        """Where each key is (the GPU, the primary, or the tier the tiers name), the
        longest prefix every group can serve, and the keys that serve it."""
        groups = self.core.config.layout.groups
        self._check(keys_per_group, gpu_tokens)
        if not gpu_tokens and len(groups) == 1 and groups[0].kind == "full":
            keys = keys_per_group[0]
            if self.core.primary.lookup(keys) == len(keys):  # the hot case: all resident
                return self._all_resident(keys, groups[0].block_size, ctx)
        where, missing = self._in_primary(keys_per_group, gpu_tokens)
        located: dict[OffloadKey, int] = {}
        taken: list[Taken] = []  # with or without a request id: a hit keeps its claims
        try:
            if missing:
                tiers = self.core.tiers
                located = await self.locate(list(missing), ctx, taken)
                for key, i in located.items():
                    where[key] = tiers[i].name
            tokens, ranges = self._hit(keys_per_group, where, bool(missing))
            group_keys = self._needed(keys_per_group, ranges, where, gpu_tokens)
        except BaseException:  # cancelled (or a bug): the claims taken end here
            if taken:
                self.core.claims.drop(taken)
            raise
        locations = {k: where[k] for keys in group_keys for k in keys}
        # this lookup's claims replace the request's last; without a request id they
        # are the lookup's own, ended by the loads of their keys (or their lease)
        owner = ctx.request_id if ctx.request_id is not None else self.core.claims.anonymous()
        needed = {k: located[k] for k in locations if k in located}
        self.core.claims.keep(owner, taken, needed)
        if missing:
            self.core.primary.touch([k for k, m in locations.items() if m == PRIMARY_MEDIUM])
        else:
            self.core.primary.touch(list(locations))
        if self.on_hits is not None:
            self._report_hits(keys_per_group, ranges, ctx)
        hits = sum(map(len, group_keys))
        past = sum(len(keys) - r.end for keys, r in zip(keys_per_group, ranges))
        self.core.tenants.looked_up(ctx.tenant, hits, past)
        return LookupResult(
            tokens, group_keys, tuple(ranges), MappingProxyType(locations), gpu_tokens
        )

    @staticmethod
    def _needed(
        keys_per_group: Sequence[Sequence[OffloadKey]],
        ranges: Sequence[GroupHit],
        where: dict[OffloadKey, str],
        gpu_tokens: int,
    ) -> tuple[tuple[OffloadKey, ...], ...]:
        """Each group's keys of its hit range to load (those the GPU holds left out)."""
        if gpu_tokens:
            return tuple(
                tuple(k for k in keys[r.first : r.end] if where[k] != _GPU)
                for keys, r in zip(keys_per_group, ranges)
            )
        return tuple(tuple(keys[r.first : r.end]) for keys, r in zip(keys_per_group, ranges))

    def _check(self, keys_per_group: Sequence[Sequence[OffloadKey]], gpu_tokens: int) -> None:
        """A request that does not fit the layout raises before anything is asked."""
        groups = self.core.config.layout.groups
        if len(keys_per_group) != len(groups):
            raise ValueError(
                f"lookup got keys for {len(keys_per_group)} groups; the layout has {len(groups)}"
            )
        if isinstance(gpu_tokens, bool) or not isinstance(gpu_tokens, int) or gpu_tokens < 0:
            raise ValueError(f"gpu_tokens must be a non-negative int, got {gpu_tokens!r}")
        for g, keys in enumerate(keys_per_group):
            check_keys(keys, f"keys_per_group[{g}]")

    def _in_primary(
        self, keys_per_group: Sequence[Sequence[OffloadKey]], gpu_tokens: int
    ) -> tuple[dict[OffloadKey, str], dict[OffloadKey, None]]:
        """The first pass: keys the GPU holds (the leading `gpu_tokens` of each group)
        and keys ready in the primary, by medium; and the keys neither has, in order
        (counted as the primary's misses)."""
        groups = self.core.config.layout.groups
        primary = self.core.primary
        where: dict[OffloadKey, str] = {}
        missing: dict[OffloadKey, None] = {}
        on_gpu = 0
        for g, keys in enumerate(keys_per_group):
            skip = min(len(keys), gpu_tokens // groups[g].block_size) if gpu_tokens else 0
            for key in keys[:skip] if skip else ():
                where[key] = _GPU
                on_gpu += 1
            rest = keys[skip:] if skip else keys
            for key in primary.ready_keys(rest):
                where[key] = PRIMARY_MEDIUM
            for key in rest:
                if key not in where:
                    missing[key] = None
        ps = self.core.primary_stats
        ps.lookups += 1
        ps.lookup_keys += len(where) - on_gpu + len(missing)
        ps.hits += len(where) - on_gpu
        ps.misses += len(missing)
        return where, missing

    def _hit(
        self,
        keys_per_group: Sequence[Sequence[OffloadKey]],
        where: dict[OffloadKey, str],
        missed: bool,
    ) -> tuple[int, list[GroupHit]]:
        """The tokens every group can serve from the keys in `where`, and each group's
        range of blocks (one full-attention group: its present prefix)."""
        groups = self.core.config.layout.groups
        if len(groups) == 1 and groups[0].kind == "full":
            keys = keys_per_group[0]
            end = len(keys)
            if missed:
                for j, key in enumerate(keys):
                    if key not in where:
                        end = j
                        break
            return end * groups[0].block_size, [GroupHit(0, end)]
        present = [[k in where for k in keys] for keys in keys_per_group]
        return combine_group_hits(groups, present)

    def _report_hits(
        self,
        keys_per_group: Sequence[Sequence[OffloadKey]],
        ranges: Sequence[GroupHit],
        ctx: ReqContext,
    ) -> None:
        """Tell `on_hits` every key the request looked up and the keys past its hit."""
        assert self.on_hits is not None
        if len(keys_per_group) == 1:  # one group's keys are distinct (prefix-chained)
            seen, tail = keys_per_group[0], keys_per_group[0][ranges[0].end :]
        else:
            seen = list(dict.fromkeys(k for keys in keys_per_group for k in keys))
            tail = list(
                dict.fromkeys(k for keys, r in zip(keys_per_group, ranges) for k in keys[r.end :])
            )
        self.on_hits(seen, ctx, tail)

    def _all_resident(
        self, keys: Sequence[OffloadKey], block_size: int, ctx: ReqContext
    ) -> LookupResult:
        """A one-group full-attention request whose every block is ready in the
        primary: no tier is asked, nothing to combine."""
        core = self.core
        ps = core.primary_stats
        ps.lookups += 1
        ps.lookup_keys += len(keys)
        ps.hits += len(keys)
        core.primary.touch(keys)
        core.claims.let_go(ctx.request_id)  # nothing to claim: the last lookup's go
        core.tenants.looked_up(ctx.tenant, len(keys), 0)
        if self.on_hits is not None:
            self.on_hits(keys, ctx, ())
        locations = dict.fromkeys(keys, PRIMARY_MEDIUM)
        return LookupResult(
            len(keys) * block_size,
            (tuple(keys),),
            (GroupHit(0, len(keys)),),
            MappingProxyType(locations),
        )
