"""The parts of vLLM's secondary-tier interface beyond jobs and lookups, under vLLM's
REAL tiering manager: `touch` reaches the tier's eviction order, `get_stats` feeds
vLLM's metrics with series vLLM can define, stored events say whether a removal will
follow, and `drain_jobs` (vLLM's `reset_cache`, under its lock) always returns."""

from __future__ import annotations

import threading
import time
from typing import Any

import anyio
import pytest

from tierkv.contract.jobs import ReqContext
from tierkv.registry import register_tier, unregister_tier
from tierkv.testing import FaultyTier

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
ROW = 4096


def faulty(**fields: Any) -> dict[str, Any]:
    return {"type": "faulty", "capacity": "1MiB", **fields}


def holds(adapter: Any, keys: list[bytes]) -> list[bool]:
    tier = adapter.tierkv_tier
    return list(adapter.loop.run(tier.lookup(keys, ReqContext(request_id="check")), 30))


def test_reuse_vllm_reports_reaches_the_tiers_eviction_order(
    vllm: Any, faulty_tier_type: str
) -> None:
    # room for three framed rows, not four
    engine = vllm.engine([vllm.entry(faulty(capacity=3 * ROW + 600))])
    adapter = engine.tiers[0]
    keys = vllm.keys(4, "touch")
    ctx = engine.new_request()
    for key in keys[:3]:  # one job each: the tier's LRU order is the store order
        engine.store(ctx, [key])
        engine.settle()
    assert holds(adapter, keys[:3]) == [True, True, True]
    with engine.manager.lock:
        engine.manager.touch([keys[0]], ctx)  # the oldest block is served again
    engine.step()  # touches go to the tier once per step
    adapter.loop.run(anyio.sleep(0), 10)
    engine.store(ctx, keys[3:])
    engine.settle()
    assert holds(adapter, keys) == [True, False, True, True]  # the untouched one went


def _ours(stats: Any) -> dict[str, dict[tuple[str, ...], Any]]:
    from tierkv.integrations.vllm.metrics import PREFIX

    _types, values = stats.metric_sections()
    return {name: dict(v) for name, v in values.items() if name.startswith(PREFIX)}


def test_get_stats_gives_vllm_what_only_the_tier_knows(vllm: Any, faulty_tier_type: str) -> None:
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from tierkv.integrations.vllm import metrics

    engine = vllm.engine([vllm.entry(faulty())])
    adapter = engine.tiers[0]
    label = ("1:tierkv",)  # as vLLM labels the first secondary tier
    keys = vllm.keys(3, "stats")
    ctx = engine.new_request()
    engine.store(ctx, keys)
    engine.settle()
    engine.manager.primary_tier.reset_cache()
    reader = engine.new_request()
    assert engine.promote(reader, keys) == 3
    adapter.tierkv_tier.down = True
    engine.store(engine.new_request(), vllm.keys(2, "while-down"))
    engine.settle()

    ours = _ours(engine.manager.get_stats())
    assert ours[metrics.LOOKUP_KEYS][label] == 3
    assert ours[metrics.LOOKUP_HITS][label] == 3
    assert ours[metrics.FAILED_JOBS] == {(*label, "store", "error"): 1}
    assert ours[metrics.FAILED_BLOCKS] == {(*label, "store"): 2}
    assert ours[metrics.UP][label] == 1
    assert ours[metrics.STORE_BYTES_IN_FLIGHT][label] == 0
    # counters are per call: the next one starts again
    again = _ours(engine.manager.get_stats())
    assert metrics.LOOKUP_KEYS not in again and again[metrics.UP][label] == 1

    # vLLM defines every series we send, with the labels we give it (its Prometheus
    # logger asserts the count)
    extra = engine.spec.config.extra_config
    definitions = TieringOffloadingSpec.build_metric_definitions(extra)
    for name, series in ours.items():
        for labels in series:
            assert len(labels) == len(definitions[name].labelnames), name


class _UnseenEvictionsTier(FaultyTier):
    """A tier whose blocks may vanish without a report (a Redis under maxmemory)."""

    reports_evictions = False

    @staticmethod
    def get_tier_type() -> str:
        return "faulty-unseen"


@pytest.mark.parametrize(("tier_type", "expected"), [("faulty", True), ("faulty-unseen", False)])
def test_stored_events_expect_a_removal_only_from_tiers_that_report_theirs(
    vllm: Any, faulty_tier_type: str, tier_type: str, expected: bool
) -> None:
    register_tier(_UnseenEvictionsTier)
    try:
        engine = vllm.engine([vllm.entry({"type": tier_type})], events=True)
        ctx = engine.new_request()
        engine.store(ctx, vllm.keys(2, tier_type))
        engine.settle()
        stored = [e for e in engine.manager.take_events() if e.ownership == "tierkv"]
        assert [e.removal_expected for e in stored] == [expected]
    finally:
        unregister_tier("faulty-unseen")


def test_drain_jobs_cancels_jobs_past_drain_timeout_and_reports_each_once(
    vllm: Any, faulty_tier_type: str
) -> None:
    engine = vllm.engine([vllm.entry(faulty(job_timeout="60s"), drain_timeout="200ms")])
    adapter = engine.tiers[0]
    adapter.tierkv_tier.hang = True
    ctx = engine.new_request()
    engine.store(ctx, vllm.keys(2, "drain"))
    started = time.monotonic()
    with engine.manager.lock:
        engine.manager.reset_cache()  # drains every tier; asserts no job is left
        engine.manager.on_reset_flushed()
    assert time.monotonic() - started < 10
    assert not adapter.has_pending_work() and not engine.busy()
    adapter.tierkv_tier.hang = False
    engine.store(ctx, vllm.keys(2, "after"))  # the tier serves on
    engine.settle()


def test_drain_jobs_returns_when_the_loop_thread_is_gone(vllm: Any, faulty_tier_type: str) -> None:
    engine = vllm.engine([vllm.entry(faulty(job_timeout="60s"), drain_timeout="60s")])
    adapter = engine.tiers[0]
    adapter.tierkv_tier.hang = True
    ctx = engine.new_request()
    engine.store(ctx, vllm.keys(2, "dead-loop"))
    loop = adapter.loop
    loop.loop.call_soon_threadsafe(loop.loop.stop)  # the loop thread dies
    deadline = time.monotonic() + 10
    while loop.is_alive():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    done = threading.Event()
    threading.Thread(target=lambda: (adapter.drain_jobs(), done.set()), daemon=True).start()
    assert done.wait(10), "drain_jobs waited on a loop that will never run again"
    assert [r.success for r in adapter.get_finished_jobs()] == [False]
    assert not adapter.has_pending_work()


@pytest.mark.parametrize("bad", ["soon", -1, True])
def test_a_bad_drain_timeout_is_refused_with_its_path(
    vllm: Any, faulty_tier_type: str, bad: object
) -> None:
    from tierkv.contract.errors import ConfigError

    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.drain_timeout"):
        vllm.engine([vllm.entry(faulty(), drain_timeout=bad)])
