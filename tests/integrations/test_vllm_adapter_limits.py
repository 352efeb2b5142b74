"""The adapter's own rules under vLLM's real tiering manager: a tier that does not
open (required: false), the cap on store bytes in flight, KV events, and removals the
tier reports."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tierkv.contract.jobs import ReqContext

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def wait_for(condition: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.01)


def test_a_tier_that_does_not_open_is_required_by_default(vllm: Any, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(Exception, match="nvme tier cannot use"):
        vllm.engine(
            [
                vllm.entry(
                    {"type": "nvme", "path": str(tmp_path / "file" / "kv"), "capacity": "1MiB"}
                )
            ]
        )


def test_an_optional_tier_misses_until_it_opens(vllm: Any, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    tier = {
        "type": "nvme",
        "path": str(blocker / "kv"),
        "capacity": "1MiB",
        "required": False,
        "recovery_after": "50ms",
    }
    engine = vllm.engine([vllm.entry(tier)])
    adapter = engine.tiers[0]
    keys = vllm.keys(2)
    ctx = engine.new_request()
    engine.store(ctx, keys)
    engine.settle()  # the store job was reported (failed), nothing hangs
    assert engine.promote(engine.new_request(), vllm.keys(2, "other")) == 0

    blocker.unlink()  # the disk comes back
    wait_for(lambda: adapter.describe()["up"])
    more = vllm.keys(2, "later")
    later = engine.new_request()
    engine.store(later, more)
    engine.finish(later)
    engine.settle()
    found = adapter.loop.run(adapter.tierkv_tier.lookup(more, ReqContext()), 30)
    assert list(found) == [True, True]


def test_stores_beyond_max_inflight_bytes_are_dropped(vllm: Any, faulty_tier_type: str) -> None:
    engine = vllm.engine(
        [vllm.entry({"type": "faulty", "capacity": "1MiB", "max_inflight_bytes": 8192})]
    )
    adapter = engine.tiers[0]
    adapter.tierkv_tier.hang = True
    first, second = vllm.keys(2, "a"), vllm.keys(1, "b")
    engine.store(engine.new_request(), first)  # 8 KiB: exactly the cap, in flight
    engine.store(engine.new_request(), second)  # over the cap: refused at once
    results = list(adapter.get_finished_jobs())
    assert [r.success for r in results] == [False]
    adapter.tierkv_tier.hang = False
    adapter.drain_jobs()
    assert [r.success for r in adapter.get_finished_jobs()] == [True]
    stored = [k for op, ks in adapter.tierkv_tier.calls if op == "store" for k in ks]
    assert stored == first


def test_stored_and_removed_blocks_become_kv_events(vllm: Any, faulty_tier_type: str) -> None:
    engine = vllm.engine([vllm.entry({"type": "faulty", "capacity": "1MiB"})], events=True)
    adapter = engine.tiers[0]
    keys = vllm.keys(16)  # a set's order would differ from the job's for 16 keys
    ctx = engine.new_request()
    engine.store(ctx, keys)
    engine.finish(ctx)
    engine.settle()
    stored = [e for e in engine.manager.take_events() if e.ownership == "tierkv"]
    assert [(list(e.keys), e.removed) for e in stored] == [(keys, False)]  # the job's order

    # the tier drops a block on its own: an event, and lookups miss it from then on
    reader = engine.new_request()
    engine.manager.primary_tier.reset_cache()
    adapter.loop.run(_report_removed(adapter, keys[:1]), 10)
    assert engine.promote(reader, keys) == 0
    removed = [e for e in engine.manager.take_events() if e.ownership == "tierkv"]
    assert [(e.keys, e.removed) for e in removed] == [(keys[:1], True)]


async def _report_removed(adapter: Any, keys: list[bytes]) -> None:
    """What a tier does after its own eviction: delete, then report (loop thread)."""
    await adapter.tierkv_tier.remove(keys)
    adapter.tierkv_tier.report_removed(keys)


def test_a_failing_tier_opens_its_breaker_and_jobs_are_refused_at_once(
    vllm: Any, faulty_tier_type: str
) -> None:
    """The adapter drives its tier through the shared driver: failures open the
    breaker, and while it is open the scheduler's submits are refused on its own
    thread (no tier call, no exception), until a probe after recovery_after succeeds."""
    entry = {"type": "faulty", "capacity": "1MiB", "failure_threshold": 2, "recovery_after": "1h"}
    engine = vllm.engine([vllm.entry(entry)])
    adapter = engine.tiers[0]
    adapter.tierkv_tier.down = True
    for salt in ("a", "b"):
        engine.store(engine.new_request(), vllm.keys(1, salt))
        engine.settle()
    assert adapter.driver.state == "open"
    list(adapter.get_finished_jobs())
    tried = len(adapter.tierkv_tier.calls)
    engine.store(engine.new_request(), vllm.keys(1, "c"))  # refused on this thread
    assert [r.success for r in adapter.get_finished_jobs()] == [False]
    assert len(adapter.tierkv_tier.calls) == tried
    assert adapter.driver.stats.skipped_unhealthy == 1


def test_a_malformed_job_does_not_take_the_breakers_probe(
    vllm: Any, faulty_tier_type: str
) -> None:
    """A job refused as malformed while the breaker is half-open leaves the probe to
    the next job, which closes the breaker once the tier works again."""
    import numpy as np
    from vllm.v1.kv_offload.base import ReqContext as VllmReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    entry = {"type": "faulty", "capacity": "1MiB", "failure_threshold": 1, "recovery_after": "50ms"}
    engine = vllm.engine([vllm.entry(entry)])
    adapter = engine.tiers[0]
    adapter.tierkv_tier.down = True
    engine.store(engine.new_request(), vllm.keys(1, "a"))
    engine.settle()
    assert adapter.driver.breaker("store").state.value == "open"
    adapter.tierkv_tier.down = False
    time.sleep(0.1)
    assert adapter.driver.state == "half_open"
    bad = TransferJob(
        job_id=10_000,
        keys=vllm.keys(2, "m"),
        chunk_ids=np.array([1]),  # two keys, one chunk
        is_promotion=False,
        req_context=VllmReqContext(req_id="r"),
    )
    adapter.submit_store(bad)
    assert [r.success for r in adapter.get_finished_jobs()] == [False]
    good = vllm.keys(1, "g")
    engine.store(engine.new_request(), good)  # the probe
    engine.settle()
    assert adapter.driver.state == "closed"
    assert adapter.tierkv_tier.stored_keys() >= set(good)
    assert adapter.driver.stats.inflight_bytes == 0


def test_a_submit_after_the_loop_thread_died_is_refused_not_raised(
    vllm: Any, faulty_tier_type: str
) -> None:
    engine = vllm.engine([vllm.entry({"type": "faulty", "capacity": "1MiB"})])
    adapter = engine.tiers[0]
    adapter.loop.stop()
    engine.store(engine.new_request(), vllm.keys(1))  # no exception on vLLM's thread
    assert [r.success for r in adapter.get_finished_jobs()] == [False]
    assert not adapter.has_pending_work() and adapter.driver.stats.inflight_bytes == 0
