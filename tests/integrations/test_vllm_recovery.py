"""Under vLLM's tiering manager, a tier that failed comes back once its fault clears
(the twin of the SGLang and LMCache recovery tests, over the same real faults)."""

from __future__ import annotations

import time
from typing import Any

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_a_tier_serves_again_after_its_fault_clears(vllm: Any, tier_fault: Any) -> None:
    name = tier_fault.name
    writer = vllm.engine([vllm.entry(tier_fault.section)])
    adapter = writer.tiers[0]
    driver = adapter.driver
    recovery = float(driver.config.recovery_after)
    ctx = writer.new_request()
    writer.store(ctx, vllm.keys(4, f"{name}-before"))
    writer.finish(ctx)
    writer.settle()
    assert driver.stats.blocks_stored == 4

    tier_fault.inject()
    seen: set[str] = set()
    rounds = 0
    ends = time.monotonic() + 3 * recovery + 1.0
    while time.monotonic() < ends:  # the scheduler keeps storing and looking up
        rounds += 1
        ctx = writer.new_request()
        writer.prefix(ctx, vllm.keys(2, f"{name}-miss{rounds}"))
        writer.store(ctx, vllm.keys(1, f"{name}-during{rounds}"))
        writer.finish(ctx)
        writer.settle()
        seen.add(driver.breaker("store").state.value)
        time.sleep(0.05)
    assert "open" in seen, f"the write breaker never opened (saw {seen})"
    assert driver.stats.blocks_stored == 4

    tier_fault.clear()
    cleared = time.monotonic()
    bound = recovery + 2 * float(driver.config.job_timeout) + 1.0
    fresh: list[bytes] = []
    while driver.stats.blocks_stored < 4 + 2:
        assert time.monotonic() - cleared < bound, f"{name}: nothing stored {bound:.1f}s after"
        ctx = writer.new_request()
        fresh = vllm.keys(2, f"{name}-after{time.monotonic()}")
        writer.prefix(ctx, fresh)  # a lookup first, as the scheduler does
        writer.store(ctx, fresh)
        writer.finish(ctx)
        writer.settle()
        time.sleep(0.05)
    assert driver.state == "closed"
    writer.shutdown()
    reader = vllm.engine([vllm.entry(tier_fault.section)])  # its primary is empty
    ctx = reader.new_request()
    assert reader.promote(ctx, fresh) == 2
    assert reader.read(ctx, fresh) == [vllm.payload(k) for k in fresh]
