"""What an admission decision costs per block: `reuse` (`ReuseAdmission.admits`),
`tinylfu` (`admits_against`, read against a real full `MemoryTier`'s eviction
candidates, each candidate checked for residence in a primary-sized dict as the cache
does) and `adaptive` (`AdaptiveAdmission.admits_adaptive`, in its tinylfu state: the
costlier one), beside sketching the lookup that precedes it (`sighted`; `adaptive`
also walks the sampled keys through its two shadow chains there: one key in
`sampling`). The duel is measured for the `--tier-blocks` tier, for tiers of 4,096
and 1,000 blocks (sampled at the floor, `MIN_SAMPLING`, or as often as a shadow tier of
`MIN_SHADOW_BLOCKS` keys needs) and of 200 (every key sampled: the worst case), each
on two kinds of asks: the same keys again (every key a
hit in the shadows' primary) and trace-like ones ("new half": each ask repeats the
first half of the one before and adds as many new keys, so the shadows miss, write and
weigh rivals as on a real trace).

    python benchmarks/admission_cost.py [--batches 32,1024] [--tier-blocks 100000]

Per batch size (blocks of one store window) it prints the median of `--repeat` runs of
`--rounds` decisions each, in CPU microseconds per block (this thread's CPU time, not
the wall clock: on a shared machine the process also waits for a core), with min..max. The keys are
random 36-byte keys seen once or twice; the tier is full (no free room), so every key
past the room meets a candidate: the costliest path. CPU only; no tier I/O. `tierkv
bench` prints the sum per policy (lookup and decision, `tierkv.bench.admission`).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from functools import partial

from tierkv.bench.admission import cpu_us_per_block as _per_block
from tierkv.bench.admission import full_tier as _full_tier
from tierkv.bench.admission import random_keys as _keys
from tierkv.bench.admission import trace_like as _trace_like
from tierkv.memory_tier import MemoryTier
from tierkv.policies.adaptive import AdaptiveAdmission
from tierkv.policies.admission import ReuseAdmission


def _cases(
    admission: ReuseAdmission,
    duels: dict[str, AdaptiveAdmission],
    keys: list[bytes],
    tier: MemoryTier,
    free: int,
    primary: dict,
    rounds: int,
) -> dict[str, Callable[[], object]]:
    cases: dict[str, Callable[[], object]] = {
        "sighted (the lookup's sketch)": lambda: admission.sighted(keys, ()),
        "reuse: admits": lambda: admission.admits(keys),
        "tinylfu: admits_against": lambda: admission.admits_against(
            keys, free, tier.eviction_candidates(), primary.__contains__
        ),
    }
    for name, duel in duels.items():
        cases[f"adaptive: sighted, {name}, 1 in {duel.sampling}"] = partial(duel.sighted, keys, ())
    plain = ReuseAdmission()
    asks = _trace_like(len(keys), rounds)
    cases["sighted, new half"] = lambda: plain.sighted(asks(), ())
    for name, duel in duels.items():
        asks_duel = _trace_like(len(keys), rounds)
        cases[f"adaptive: sighted, {name}, 1 in {duel.sampling}, new half"] = (
            lambda d=duel, a=asks_duel: d.sighted(a(), ())
        )
    adaptive = duels["tier"]
    cases["adaptive: admits_adaptive"] = lambda: adaptive.admits_adaptive(
        keys, free, tier.eviction_candidates(), primary.__contains__
    )
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="32,1024", help="blocks per decision (32,1024)")
    parser.add_argument("--tier-blocks", type=int, default=100_000, help="blocks the tier holds")
    parser.add_argument("--primary-blocks", type=int, default=4096, help="resident in primary")
    parser.add_argument("--rounds", type=int, default=200, help="decisions per run (200)")
    parser.add_argument("--repeat", type=int, default=5, help="runs; the median is printed (5)")
    args = parser.parse_args()
    tier = _full_tier(args.tier_blocks, 4096)
    primary = dict.fromkeys(_keys(args.primary_blocks))
    admission = ReuseAdmission()
    print(
        f"tier of {args.tier_blocks:,} blocks (full), primary of {args.primary_blocks:,}, "
        f"sketch {admission.sketch.nbytes >> 20} MiB; CPU microseconds per block, median of "
        f"{args.repeat} runs of {args.rounds} decisions (min..max)"
    )
    for batch in (int(b) for b in args.batches.split(",")):
        keys = _keys(batch)
        duels: dict[str, AdaptiveAdmission] = {}
        tiers = (("tier", args.tier_blocks), ("4,096", 4096), ("1,000", 1000), ("200", 200))
        for name, blocks in tiers:
            duels[name] = AdaptiveAdmission()
            duels[name].size_for(blocks, min(args.primary_blocks, blocks // 10))
        for a in (admission, *duels.values()):
            a.sighted(keys, keys)
            a.sighted(keys[::2], keys[::2])  # half seen twice, half once
        free = tier.room().free_blocks
        assert free == 0
        assert not duels["tier"].writes_all  # its costlier state: the tinylfu rule
        cases = _cases(admission, duels, keys, tier, free, primary, args.rounds)
        for name, run in cases.items():
            runs = [_per_block(run, batch, args.rounds) for _ in range(args.repeat)]
            print(
                f"  {batch:>5} blocks  {name:<44} {statistics.median(runs):6.3f} us "
                f"({min(runs):.3f}..{max(runs):.3f})"
            )


if __name__ == "__main__":
    main()
