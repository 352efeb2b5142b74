"""Under LMCache's calls, a tier that failed comes back once its fault clears.

The twin of SGLang's `test_sglang_recovery.py`: each real fault (`tier_fault`: a
full disk, an immutable directory, a SIGKILLed redis) is driven through open and
half-open while LMCache's controller keeps calling (lookup-and-lock, load, store),
then cleared; within `recovery_after` plus one probe new objects store and load
again, byte-identical. While a disk cannot write, the objects it holds keep loading.
"""

from __future__ import annotations

import time
from typing import Any

SIZE = 64 << 10
N = 8


def test_a_tier_serves_again_after_its_fault_clears(rig: Any, tier_fault: Any) -> None:
    l1 = rig.L1(64 * SIZE)
    adapter = rig.adapter([tier_fault.section], l1)
    drive = rig.Driver(adapter)
    name = tier_fault.name
    stored = [rig.key(i, salt=f"{name}-before") for i in range(N)]
    assert drive.store(stored, [l1.obj(SIZE, f"b{i}") for i in range(N)]).is_successful()
    chain = adapter._chains.get(SIZE).chain
    tier = chain.tiers[0]
    recovery = float(tier.config.recovery_after)
    out = [l1.obj(SIZE) for _ in range(N)]
    extra = l1.obj(SIZE, "x")

    tier_fault.inject()
    seen: set[str] = set()
    rounds = 0
    ends = time.monotonic() + 3 * recovery + 1.0
    while time.monotonic() < ends:  # the controller keeps calling throughout
        rounds += 1
        new = [rig.key(1000 + rounds, salt=name)]
        assert not drive.store(new, [extra]).is_successful()
        held = drive.lookup(stored)
        if tier_fault.keeps_reads:  # a disk that cannot write still serves
            assert held == [True] * N
            assert drive.load(stored, out) == [True] * N
            assert [rig.content(o) for o in out] == [rig.pattern(f"b{i}", SIZE) for i in range(N)]
        adapter.submit_unlock(stored)
        seen.add(tier.breaker("store").state.value)
        time.sleep(0.05)
    assert "open" in seen, f"the write breaker never opened (saw {seen})"

    tier_fault.clear()
    cleared = time.monotonic()
    fresh = [rig.key(i, salt=f"{name}-after") for i in range(N)]
    objects = [l1.obj(SIZE, f"a{i}") for i in range(N)]
    bound = recovery + chain.job_deadline + 1.0
    while True:  # as LMCache's controller calls: a lookup before each store
        drive.lookup(fresh)
        if drive.store(fresh, objects).is_successful():
            break
        assert time.monotonic() - cleared < bound, (
            f"{name}: new objects still not stored {bound:.1f}s after the fault cleared"
        )
        time.sleep(0.05)
    assert drive.lookup(fresh) == [True] * N
    for o in out:
        o.tensor.zero_()
    assert drive.load(fresh, out) == [True] * N
    assert [rig.content(o) for o in out] == [rig.pattern(f"a{i}", SIZE) for i in range(N)]
    assert tier.state == "closed" and tier.serving == "read_write"
