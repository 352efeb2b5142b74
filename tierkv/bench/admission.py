"""What admission costs per block looked up: the lookup's sighting (the sketch, and for
`adaptive` the walk of its sampled keys through the two shadow chains) plus the store's
decision for the blocks the lookup missed, per policy (`reuse`, `tinylfu`, `adaptive`).

Measured on trace-like asks (each repeats the first half of the one before and adds as
many new keys, so the sketch, the shadows and the rivals all see misses, as on a real
trace) against a full memory tier of `tier_blocks` (no free room: every new key meets an
eviction candidate, the costliest path) under a primary of `primary_blocks`. CPU time of
this thread, not the wall clock: on a shared machine the process also waits for a core.
`adaptive` is measured in its `tinylfu` state (the costlier one), sized for the tier;
`adaptive, 200-block tier` is its worst case, where every key is sampled.
`benchmarks/admission_cost.py` breaks the same costs down further.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator

from tierkv.contract.slab import PrimaryView
from tierkv.memory_tier import MemoryTier, MemoryTierConfig
from tierkv.policies.adaptive import AdaptiveAdmission
from tierkv.policies.admission import ReuseAdmission

KEY_BYTES = 36
"""A 32-byte block hash and a 4-byte group, as `make_offload_key` makes them."""
SMALL_TIER_BLOCKS = 200
"""The small tier `adaptive`'s worst case is measured for (every key sampled)."""


def random_keys(n: int) -> list[bytes]:
    return [os.urandom(KEY_BYTES) for _ in range(n)]


def full_tier(blocks: int, block_bytes: int = 4096) -> MemoryTier:
    """A memory tier holding `blocks` frames, full: its LRU order is filled directly
    (the decision reads only that order, not the frames)."""
    view = PrimaryView(bytearray(block_bytes), block_bytes, "admission-bench")
    frame = view.block_bytes + 34 + KEY_BYTES
    tier = MemoryTier(MemoryTierConfig(type="memory", capacity=blocks * frame), view)
    for key in random_keys(blocks):
        tier._frames[key] = b""
    tier._bytes = blocks * frame
    tier._frame_bytes = frame
    return tier


def trace_like(batch: int, rounds: int) -> Callable[[], list[bytes]]:
    """Asks of `batch` keys that each repeat the first half of the one before and add
    new keys; enough fresh keys for `rounds` x 8 asks."""
    fresh = iter(random_keys(batch * rounds * 8))
    ask = [next(fresh) for _ in range(batch)]

    def next_ask() -> list[bytes]:
        nonlocal ask
        ask = ask[: batch // 2] + [next(fresh) for _ in range(batch - batch // 2)]
        return ask

    return next_ask


def cpu_us_per_block(run: Callable[[], object], blocks: int, rounds: int) -> float:
    """This thread's CPU microseconds per block over `rounds` calls of `run`."""
    started = time.thread_time()
    for _ in range(rounds):
        run()
    return (time.thread_time() - started) / (rounds * blocks) * 1e6


def _policy_runs(
    batch: int, rounds: int, tier: MemoryTier, primary: dict[bytes, None], primary_blocks: int
) -> dict[str, Callable[[], object]]:
    """One lookup-then-store decision per call, per policy, on fresh trace-like asks."""
    tier_blocks = len(tier._frames)
    candidates: Callable[[], Iterator[bytes]] = tier.eviction_candidates
    held = primary.__contains__

    def missed(ask: list[bytes]) -> list[bytes]:
        return ask[batch // 2 :]

    reuse, tinylfu = ReuseAdmission(), ReuseAdmission()
    adaptive, small = AdaptiveAdmission(), AdaptiveAdmission()
    adaptive.size_for(tier_blocks, primary_blocks)
    small.size_for(SMALL_TIER_BLOCKS, SMALL_TIER_BLOCKS // 10)
    asks = {name: trace_like(batch, rounds) for name in ("reuse", "tinylfu", "a", "s")}

    def run_reuse() -> object:
        ask = asks["reuse"]()
        reuse.sighted(ask, missed(ask))
        return reuse.admits(missed(ask))

    def run_tinylfu() -> object:
        ask = asks["tinylfu"]()
        tinylfu.sighted(ask, missed(ask))
        return tinylfu.admits_against(missed(ask), 0, candidates(), held)

    def run_adaptive(duel: AdaptiveAdmission, name: str) -> Callable[[], object]:
        def run() -> object:
            ask = asks[name]()
            duel.sighted(ask, missed(ask))
            duel.writes_all = False  # its costlier state: the tinylfu rule
            return duel.admits_adaptive(missed(ask), 0, candidates(), held)

        return run

    return {
        "reuse": run_reuse,
        "tinylfu": run_tinylfu,
        "adaptive": run_adaptive(adaptive, "a"),
        f"adaptive, {SMALL_TIER_BLOCKS}-block tier": run_adaptive(small, "s"),
    }


def bench_admission(
    repeat: int,
    *,
    batches: tuple[int, ...] = (32, 1024),
    rounds: int = 50,
    tier_blocks: int = 100_000,
    primary_blocks: int = 4096,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, dict[str, float]]:
    """`{policy: {str(batch): CPU us per block looked up}}`, the median of `repeat`
    runs of `rounds` asks of each batch size (see the module doc)."""
    tier = full_tier(tier_blocks)
    primary = dict.fromkeys(random_keys(primary_blocks))
    result: dict[str, dict[str, float]] = {}
    for batch in batches:
        progress(f"admission: {batch}-block asks against a full tier of {tier_blocks:,}")
        runs_of = _policy_runs(batch, rounds * repeat + 8, tier, primary, primary_blocks)
        for name, run in runs_of.items():
            runs = [cpu_us_per_block(run, batch, rounds) for _ in range(repeat)]
            result.setdefault(name, {})[str(batch)] = statistics.median(runs)
    return result
