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
  tier at most `SHADOW_BLOCKS` keys; past 256 x `SHADOW_BLOCKS` blocks the shadows are
  capped there, so memory is bounded whatever the tier's size.
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
lookup's path (`sighted`) and one batched sketch estimate per request; a decision is
the `tinylfu` one or a constant (`benchmarks/admission_cost.py`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from itertools import islice

import numpy as np

from tierkv.policies.admission import ReuseAdmission

SHADOW_BLOCKS = 4096
"""At most this many keys in each shadow tier, and in each shadow primary."""
MAX_SAMPLING = 256
"""One key in at most this many is sampled (the first byte of a key picks it)."""
MARGIN = 0.99
"""The tinylfu rule is used while its shadow serves at least this share of write-all's."""
DECAY_PER_BLOCK = 16
"""The shadows' scores halve every this many sampled asks per shadow tier block."""


class ShadowChain:
    """Keys only: a primary LRU of `primary_blocks` over a tier LRU of `tier_blocks`,
    written through; `hits` counts prefix hits (decayed by the owner)."""

    __slots__ = ("hits", "primary", "primary_blocks", "tier", "tier_blocks")

    def __init__(self, primary_blocks: int, tier_blocks: int) -> None:
        self.primary: OrderedDict[bytes, None] = OrderedDict()
        self.tier: OrderedDict[bytes, None] = OrderedDict()
        self.primary_blocks = max(1, primary_blocks)
        self.tier_blocks = max(1, tier_blocks)
        self.hits = 0.0

    def ask(self, keys: Sequence[bytes]) -> list[bytes]:
        """One request asks `keys` (in order): score the prefix hit, refresh the
        primary, and return the keys its tier does not hold (to be written or not)."""
        primary, tier = self.primary, self.tier
        prefix = True
        new: list[bytes] = []
        hits = 0
        for key in keys:
            in_primary = key in primary
            in_tier = key in tier
            if prefix and (in_primary or in_tier):
                hits += 1
                if in_tier and not in_primary:
                    tier.move_to_end(key)  # loaded from the tier: its LRU sees the read
            else:
                prefix = False
                if not in_tier:
                    new.append(key)
            primary[key] = None
            primary.move_to_end(key)
            if len(primary) > self.primary_blocks:
                primary.popitem(last=False)
        self.hits += hits
        return new

    def write(self, keys: Sequence[bytes]) -> None:
        """Write-all: every key into the tier, the least recently used out."""
        tier = self.tier
        for key in keys:
            tier[key] = None
            if len(tier) > self.tier_blocks:
                tier.popitem(last=False)

    def write_against(self, keys: Sequence[bytes], admitted: Callable[..., list[bool]]) -> None:
        """The tinylfu rule against this tier's own LRU tail: `admitted(keys, free,
        candidates)` is `ReuseAdmission.admits_against`."""
        tier = self.tier
        free = self.tier_blocks - len(tier)
        rivals = list(islice(iter(tier), max(0, len(keys) - free)))
        verdicts = admitted(keys, free, iter(rivals))
        displaced = iter(rivals)
        for key, ok in zip(keys, verdicts):
            if not ok:
                continue
            if len(tier) >= self.tier_blocks:
                del tier[next(displaced)]
            tier[key] = None


class AdaptiveAdmission(ReuseAdmission):
    """`ReuseAdmission` (the sketch, `reuse` and `tinylfu`) plus the duel that picks
    `tinylfu` or write-all for `adaptive` tiers (see the module doc). Call `size_for`
    once the tiers' sizes are known; until then the shadows assume `SHADOW_BLOCKS`."""

    def __init__(
        self,
        *,
        shadow_blocks: int = SHADOW_BLOCKS,
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
        self.shadow_blocks = shadow_blocks
        self.margin = margin
        self.decay_per_block = decay_per_block
        self.size_for(shadow_blocks, 0)

    def size_for(self, tier_blocks: int, primary_blocks: int) -> None:
        """Size the shadows for a tier of `tier_blocks` under a primary of
        `primary_blocks` (the scores start again from nothing)."""
        rate = 1
        while rate < MAX_SAMPLING and tier_blocks // rate > self.shadow_blocks:
            rate *= 2
        self.sampling = rate
        self._sampled_below = 256 // rate
        # bounded however large: past 256 x shadow_blocks (1 Mi blocks by default) a
        # shadow tier models a smaller share of the tier than its sample of the keys
        tier = max(1, min(tier_blocks // rate, self.shadow_blocks))
        primary = min(primary_blocks // rate, self.shadow_blocks)
        self.all_shadow = ShadowChain(primary, tier)
        self.tinylfu_shadow = ShadowChain(primary, tier)
        self._decay_every = self.decay_per_block * tier
        self._asks = 0
        self.writes_all = False
        self.switches = 0

    def sighted(self, keys: Sequence[bytes], tail: Sequence[bytes] = ()) -> np.ndarray:
        counts = super().sighted(keys, tail)
        below = self._sampled_below
        sample = [k for k in keys if k[0] < below]
        if sample:
            self._duel(sample)
        return counts

    def _duel(self, sample: list[bytes]) -> None:
        everything, selective = self.all_shadow, self.tinylfu_shadow
        everything.write(everything.ask(sample))
        new = selective.ask(sample)
        if new:
            selective.write_against(new, self.admits_against)
        self._asks += len(sample)
        if self._asks >= self._decay_every:
            self._asks = 0
            everything.hits /= 2
            selective.hits /= 2
        writes_all = selective.hits < self.margin * everything.hits
        if writes_all != self.writes_all:
            self.writes_all = writes_all
            self.switches += 1

    @property
    def max_shadow_keys(self) -> int:
        """Keys the shadows may hold at most, all four structures together."""
        chain = self.all_shadow
        return 2 * (chain.primary_blocks + chain.tier_blocks)

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
