"""Adaptive admission (`admission: adaptive`): `tinylfu` or write-all, whichever a pair
of sampled shadow chains says serves more on the workload of the moment.

Neither fixed rule is safe everywhere (issue 36, `docs/bench.md` "Capacity sweep"):
`tinylfu` serves up to 1.09x write-all's hits where one-shot prompts crowd a small tier
and writes a quarter of its blocks, but 0.93-0.95x on a conversation trace, where every
first turn, seen once, comes back next turn. What wins depends on the trace *and* the
tier's size, so the policy measures it while it runs (set dueling, as CPU caches choose
between insertion policies, Qureshi et al. 2007; Caffeine adapts its window to the
measured hit rate for the same reason):

- **Two shadow chains.** Each is a key-only model of the real chain, a primary LRU over
  a tier LRU, scaled down by the sampling rate: one writes every new block to its tier
  (write-all), the other applies the `tinylfu` rule against its own tier's LRU tail,
  with the real sketch's estimates. Only sampled keys enter them: a key is sampled when
  its first byte is below `256 / rate`; keys are uniform hashes, so the sample is a
  fixed 1/rate of the key space, the same in every process (never Python's salted
  `hash()`). The rate is the smallest power of two (at most 256) that keeps each shadow
  tier at most `SHADOW_BLOCKS` keys, and at least `MIN_SAMPLING` while the shadow tier
  keeps `MIN_SHADOW_BLOCKS` keys (the duel's cost per block is its cost per sampled key
  over the rate); past 256 x `SHADOW_BLOCKS` blocks the shadows are capped there, so
  memory is bounded whatever the tier's size. Both shadows see the same asks, so they
  share one primary, and one pass over the sampled keys serves both.
- **Hits scored as a prefix.** Each lookup walks its sampled keys through both shadows
  in order; a key scores a hit in a shadow only while every sampled key before it also
  did (a block after a missing one cannot be served, as in the real cache).
- **A decaying score.** Both scores halve every `DECAY_PER_BLOCK` sampled asks per shadow
  tier block, so the choice follows a workload that changes and stays steady within one
  (a choice that flips often mixes the two rules' tiers, which serves less than either).
- **The choice.** The real tier uses the `tinylfu` rule (`ReuseAdmission.admits_against`)
  while the tinylfu shadow scores at least `MARGIN` of the write-all one, and admits
  every block otherwise: writes are saved only where they cost at most ~1 % of hits.

Decisions are deterministic (a replay gives the same verdicts every time): the shadows
depend only on the keys and the sketch. Per sampled key, a few dict operations on the
lookup's path (`sighted`); the tinylfu shadow's rivals are estimated in the same numpy
pass that counts the lookup's sightings; a decision is the `tinylfu` one or a constant
(`benchmarks/admission_cost.py`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from itertools import islice, repeat
from typing import NamedTuple

import numpy as np

from tierkv.policies.admission import ReuseAdmission

SHADOW_BLOCKS = 4096
"""At most this many keys in each shadow tier, and in each shadow primary."""
MAX_SAMPLING = 256
"""One key in at most this many is sampled (the first byte of a key picks it)."""
MIN_SAMPLING = 16
"""One key in at least this many is sampled while the shadow tier keeps at least
`MIN_SHADOW_BLOCKS` keys: the duel's cost per block looked up is its cost per sampled
key (some twenty dict operations where the shadows miss and write) over the rate."""
MIN_SHADOW_BLOCKS = 128
"""The sampling floor does not shrink a shadow tier below this many keys (a smaller
tier samples more keys, down to every key). 128 and 16 kept the hit bar in the
capacity sweep's cells rerun (`docs/bench.md`); 64-key shadows lost 3.5 % at the
smallest conversation cell, and the result is not monotone in the rate (256-key
shadows, one key in 4, lost 3 % at the smallest shared-trace cell, one in 8 did not)."""
BULK_PAST = 8
"""Past this many keys, the duel's bookkeeping goes by whole batches (dearer to start)."""
MARGIN = 0.99
"""The tinylfu rule is used while its shadow serves at least this share of write-all's."""
DECAY_PER_BLOCK = 16
"""The shadows' scores halve every this many sampled asks per shadow tier block."""


class Sighting(NamedTuple):
    """What one lookup's sketch pass found, as the tinylfu shadow's writes weigh it:
    `counts`, the sightings of `keys` after this one (`halved`: the sketch halved
    right after adding them); `front_counts`, estimates of the tinylfu shadow tier's
    `front` keys (its first ones, the rivals of a large sample's new keys; empty
    where the lookup did not estimate them)."""

    keys: Sequence[bytes]
    counts: np.ndarray
    halved: bool
    front: list[bytes]
    front_counts: np.ndarray


class ShadowChain:
    """Keys only: a primary LRU of `primary_blocks` over a tier LRU of `tier_blocks`,
    written through; `hits` counts prefix hits (decayed by the owner). Both shadows of
    a duel see the same asks, so they share one primary (`primary`)."""

    __slots__ = ("hits", "primary", "primary_blocks", "tier", "tier_blocks")

    def __init__(
        self,
        primary_blocks: int,
        tier_blocks: int,
        primary: OrderedDict[bytes, None] | None = None,
    ) -> None:
        self.primary: OrderedDict[bytes, None] = OrderedDict() if primary is None else primary
        self.tier: OrderedDict[bytes, None] = OrderedDict()
        self.primary_blocks = max(1, primary_blocks)
        self.tier_blocks = max(1, tier_blocks)
        self.hits = 0.0


class AdaptiveAdmission(ReuseAdmission):
    """`ReuseAdmission` (the sketch, `reuse` and `tinylfu`) plus the duel that picks
    `tinylfu` or write-all for `adaptive` tiers (see the module doc). Call `size_for`
    once the tiers' sizes are known; until then the shadows assume `SHADOW_BLOCKS`."""

    def __init__(
        self,
        *,
        shadow_blocks: int = SHADOW_BLOCKS,
        min_sampling: int = MIN_SAMPLING,
        margin: float = MARGIN,
        decay_per_block: int = DECAY_PER_BLOCK,
        width_bits: int = 20,
    ) -> None:
        super().__init__(width_bits=width_bits)
        if shadow_blocks < 1:
            raise ValueError(f"shadow_blocks must be at least 1, got {shadow_blocks}")
        if not 0 < margin <= 1:
            raise ValueError(f"margin must be in (0, 1], got {margin}")
        if decay_per_block < 1:
            raise ValueError(f"decay_per_block must be at least 1, got {decay_per_block}")
        if min_sampling < 1 or min_sampling & (min_sampling - 1):
            raise ValueError(f"min_sampling must be a power of two, got {min_sampling}")
        self.shadow_blocks = shadow_blocks
        self.min_sampling = min_sampling
        self.margin = margin
        self.decay_per_block = decay_per_block
        self.size_for(shadow_blocks, 0)

    def size_for(self, tier_blocks: int, primary_blocks: int) -> None:
        """Size the shadows for a tier of `tier_blocks` under a primary of
        `primary_blocks` (the scores start again from nothing)."""
        rate = 1
        while rate < MAX_SAMPLING and (
            tier_blocks // rate > self.shadow_blocks
            or (rate < self.min_sampling and tier_blocks // (2 * rate) >= MIN_SHADOW_BLOCKS)
        ):
            rate *= 2
        self.sampling = rate
        self._sampled_below = 256 // rate
        # bounded however large: past 256 x shadow_blocks (1 Mi blocks by default) a
        # shadow tier models a smaller share of the tier than its sample of the keys
        tier = max(1, min(tier_blocks // rate, self.shadow_blocks))
        primary = min(primary_blocks // rate, self.shadow_blocks)
        self.all_shadow = ShadowChain(primary, tier)
        self.tinylfu_shadow = ShadowChain(primary, tier, self.all_shadow.primary)
        self._decay_every = self.decay_per_block * tier
        self._asks = 0
        self.writes_all = False
        self.switches = 0

    def sighted(self, keys: Sequence[bytes], tail: Sequence[bytes] = ()) -> np.ndarray:
        below = self._sampled_below
        sample = keys if below == 256 else [k for k in keys if k[0] < below]
        if not sample:
            return super().sighted(keys, tail)
        bulk = len(sample) > BULK_PAST
        # the tinylfu shadow's rivals are among its tier's first len(sample) keys: for
        # a large sample, estimated in the same sketch pass as the request's sightings
        # (a small one estimates them later, and only if some key is new)
        selective = self.tinylfu_shadow
        rivals = len(sample) + len(selective.tier) - selective.tier_blocks > 0
        front = list(islice(selective.tier, len(sample))) if rivals and bulk else []
        halvings = self.sketch.halvings
        counts, front_counts = self.sketch.add_then_estimate(keys, front)
        self._continued(keys, tail)
        halved = self.sketch.halvings != halvings
        self._duel(sample, Sighting(keys, counts, halved, front, front_counts))
        return counts

    def _duel(self, sample: Sequence[bytes], sighting: Sighting) -> None:
        """Walk `sample` through both shadows at once (one pass over the shared
        primary), write each shadow's new keys by its rule, and score the duel."""
        everything, selective = self.all_shadow, self.tinylfu_shadow
        primary, room = everything.primary, everything.primary_blocks
        every_tier, tier = everything.tier, selective.tier
        prefix_all = prefix_sel = True
        hits_all = hits_sel = 0
        new_all: list[bytes] = []
        new_sel: list[bytes] = []
        walked = 0
        bulk = len(sample) > BULK_PAST
        for key in sample:
            if bulk and not (prefix_all or prefix_sel):
                break  # past both hits: the rest is done in bulk below
            walked += 1
            if key in primary:  # a hit in both while its prefix holds; no tier read
                primary.move_to_end(key)
                if prefix_all:
                    hits_all += 1
                elif key not in every_tier:
                    new_all.append(key)
                if prefix_sel:
                    hits_sel += 1
                elif key not in tier:
                    new_sel.append(key)
                continue
            primary[key] = None
            if len(primary) > room:
                primary.popitem(last=False)
            if key in every_tier:
                if prefix_all:
                    hits_all += 1
                    every_tier.move_to_end(key)  # loaded from the tier: its LRU sees it
            else:
                prefix_all = False
                new_all.append(key)
            if key in tier:
                if prefix_sel:
                    hits_sel += 1
                    tier.move_to_end(key)
            else:
                prefix_sel = False
                new_sel.append(key)
        if walked < len(sample):
            # no hit left to score: only the tiers' membership and the primary's order
            # matter (the final order is what per-key refreshes would have left)
            rest = sample[walked:]
            new_all += [key for key in rest if key not in every_tier]
            new_sel += [key for key in rest if key not in tier]
            deque(map(primary.pop, rest, repeat(None)), maxlen=0)
            primary.update(dict.fromkeys(rest))
            for _ in range(len(primary) - room):
                primary.popitem(last=False)
        if new_all:  # write-all: every new key in, the least recently used out
            every_tier.update(dict.fromkeys(new_all))
            for _ in range(len(every_tier) - everything.tier_blocks):
                every_tier.popitem(last=False)
        if new_sel:
            self._write_against(new_sel, sighting)
        everything.hits += hits_all
        selective.hits += hits_sel
        self._asks += len(sample)
        if self._asks >= self._decay_every:
            self._asks = 0
            everything.hits /= 2
            selective.hits /= 2
        writes_all = selective.hits < self.margin * everything.hits
        if writes_all != self.writes_all:
            self.writes_all = writes_all
            self.switches += 1

    def _write_against(self, new: list[bytes], sighting: Sighting) -> None:
        """The tinylfu rule (`admits_against`, no primary check) for the tinylfu
        shadow's new keys against its own tier's LRU tail."""
        shadow = self.tinylfu_shadow
        tier = shadow.tier
        free = max(0, shadow.tier_blocks - len(tier))
        if free >= len(new):
            tier.update(dict.fromkeys(new))
            return
        past = new[free:]
        # the rivals: the tier's first keys before these come (all of them in `front`
        # where the lookup's pass estimated it)
        rivals = list(islice(tier, len(past)))
        tier.update(dict.fromkeys(new[:free]))
        if sighting.front:
            rival_count = dict(zip(sighting.front, sighting.front_counts.tolist()))
            rival_counts = [rival_count[rival] for rival in rivals]
            counts = sighting.counts >> 1 if sighting.halved else sighting.counts
            sighted = dict(zip(sighting.keys, counts.tolist()))
            past_counts = [sighted[key] for key in past]
        else:  # as `admits_against` does: one estimate of both, after the sightings
            both = self.sketch.estimate(past + rivals).tolist()
            past_counts, rival_counts = both[: len(past)], both[len(past) :]
        continuing, need = self._continuing, self.min_sightings
        displaced = 0
        for key, count in zip(past, past_counts):
            if displaced == len(rivals):
                break  # no candidate left: the tier would refuse it
            if count >= need or key in continuing or count > rival_counts[displaced]:
                del tier[rivals[displaced]]
                tier[key] = None
                displaced += 1

    @property
    def max_shadow_keys(self) -> int:
        """Keys the shadows may hold at most: two tiers and their shared primary."""
        chain = self.all_shadow
        return chain.primary_blocks + 2 * chain.tier_blocks

    def admits_adaptive(
        self,
        keys: Sequence[bytes],
        free: int,
        candidates: Iterator[bytes],
        held_above: Callable[[bytes], bool] | None = None,
    ) -> list[bool]:
        """For each key: write it to an `adaptive` tier (arguments as `admits_against`)?"""
        if self.writes_all:
            return [True] * len(keys)
        return self.admits_against(keys, free, candidates, held_above)

    def admits_adaptive_blind(self, keys: Sequence[bytes]) -> list[bool]:
        """An `adaptive` tier that cannot name its eviction candidates: every block
        while the duel says write-all, else the `reuse` rule."""
        if self.writes_all:
            return [True] * len(keys)
        return self.admits(keys)
