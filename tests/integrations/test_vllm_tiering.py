"""tierkv tiers under vLLM's REAL `TieringOffloadingManager` (the installed wheel):
cascade, promotion, partial lookup, single flight, failures, shutdown.

vLLM's manager asserts that each finished job id is one it is waiting for, so a job
reported twice fails these tests inside vLLM; `settle` fails them when a job is never
reported (the step loop would wait forever).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from tierkv.contract.jobs import ReqContext

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def faulty(**fields: Any) -> dict[str, Any]:
    return {"type": "faulty", "capacity": "1MiB", **fields}


def nvme(path: Path) -> dict[str, Any]:
    return {"type": "nvme", "path": str(path), "capacity": "4MiB"}


def s3(endpoint: str) -> dict[str, Any]:
    return {
        "type": "s3",
        "url": f"s3://vllm/{uuid.uuid4().hex}",
        "endpoint_url": endpoint,
        "access_key_id": "testing",
        "secret_access_key": "testing",
        "region": "us-east-1",
    }


def holds(adapter: Any, keys: list[bytes]) -> list[bool]:
    """Ask the tierkv tier itself (on its loop) which keys it holds."""
    tier = adapter.tierkv_tier
    return list(adapter.loop.run(tier.lookup(keys, ReqContext(request_id="check")), 30))


def calls(adapter: Any, op: str) -> list[tuple[bytes, ...]]:
    return [keys for name, keys in adapter.tierkv_tier.calls if name == op]


def test_a_store_cascades_to_every_tier_once(
    vllm: Any, faulty_tier_type: str, tmp_path: Path, redis_url: str, moto_server: Any
) -> None:
    moto_server.create_bucket("vllm")
    engine = vllm.engine(
        [
            vllm.entry(faulty()),
            vllm.entry(nvme(tmp_path)),
            vllm.entry({"type": "redis", "url": redis_url}),
            vllm.entry(s3(moto_server.endpoint_url)),
        ]
    )
    keys = vllm.keys(6)
    ctx = engine.new_request()
    engine.store(ctx, keys)
    engine.finish(ctx)
    engine.settle()
    assert calls(engine.tiers[0], "store") == [tuple(keys)]
    for adapter in engine.tiers:
        assert holds(adapter, keys) == [True] * 6, adapter.describe()

    again = engine.new_request()  # the same prefix once more: the primary has it
    engine.store(again, keys)
    engine.finish(again)
    engine.settle()
    assert calls(engine.tiers[0], "store") == [tuple(keys)]


def test_promotion_comes_from_the_second_tier(
    vllm: Any, faulty_tier_type: str, tmp_path: Path
) -> None:
    keys = vllm.keys(5)
    first = vllm.engine([vllm.entry(faulty()), vllm.entry(nvme(tmp_path))])
    ctx = first.new_request()
    first.store(ctx, keys)
    first.finish(ctx)
    first.settle()
    first.shutdown()

    # a restarted engine: empty primary, empty memory tier, the nvme directory kept
    engine = vllm.engine([vllm.entry(faulty()), vllm.entry(nvme(tmp_path))])
    ctx = engine.new_request()
    assert engine.promote(ctx, keys) == 5
    assert engine.read(ctx, keys) == [vllm.payload(k) for k in keys]
    assert calls(engine.tiers[0], "load") == []
    assert calls(engine.tiers[0], "lookup")  # it was asked first, and missed


def test_a_partial_hit_stops_at_the_first_missing_block(vllm: Any, tmp_path: Path) -> None:
    keys = vllm.keys(8)
    first = vllm.engine([vllm.entry(nvme(tmp_path))])
    ctx = first.new_request()
    first.store(ctx, keys[:3])
    first.finish(ctx)
    first.settle()
    first.shutdown()

    engine = vllm.engine([vllm.entry(nvme(tmp_path))])
    ctx = engine.new_request()
    assert engine.promote(ctx, keys) == 3
    assert engine.read(ctx, keys[:3]) == [vllm.payload(k) for k in keys[:3]]


def test_two_requests_for_one_block_share_one_promotion(vllm: Any, faulty_tier_type: str) -> None:
    engine = vllm.engine([vllm.entry(faulty())])
    keys = vllm.keys(3)
    writer = engine.new_request()
    engine.store(writer, keys)
    engine.finish(writer)
    engine.settle()
    engine.manager.primary_tier.reset_cache()  # primary forgets; the tier keeps them

    a, b = engine.new_request(), engine.new_request()
    hits: dict[str, int] = {}

    def both_final() -> bool:
        for ctx in (a, b):
            n, pending = engine.prefix(ctx, keys)
            if not pending:
                hits[ctx.req_id] = n
        return len(hits) == 2

    engine.settle(both_final)
    assert hits == {a.req_id: 3, b.req_id: 3}
    loaded = [k for job in calls(engine.tiers[0], "load") for k in job]
    assert sorted(loaded) == sorted(keys)  # each block read from the tier once
    assert engine.read(b, keys) == [vllm.payload(k) for k in keys]


def test_a_failed_store_job_is_reported_failed_and_nothing_hangs(
    vllm: Any, faulty_tier_type: str
) -> None:
    engine = vllm.engine([vllm.entry(faulty())])
    engine.tiers[0].tierkv_tier.fail_jobs = 1
    keys = vllm.keys(4)
    ctx = engine.new_request()
    engine.store(ctx, keys)
    engine.finish(ctx)
    engine.settle()
    assert holds(engine.tiers[0], keys) == [False] * 4
    # the cascade's slots were released: the primary can evict them for new blocks
    for salt in ("x", "y", "z"):
        more = engine.new_request()
        assert engine.store(more, vllm.keys(15, salt))
        engine.finish(more)
        engine.settle()


def test_a_job_past_its_timeout_is_reported_failed(vllm: Any, faulty_tier_type: str) -> None:
    engine = vllm.engine([vllm.entry(faulty(job_timeout="200ms"))])
    engine.tiers[0].tierkv_tier.hang = True
    ctx = engine.new_request()
    engine.store(ctx, vllm.keys(2))
    engine.finish(ctx)
    engine.settle(timeout=20)  # the manager saw the job end although the tier never did


def test_a_failed_load_is_not_promoted_again(vllm: Any, faulty_tier_type: str) -> None:
    engine = vllm.engine([vllm.entry(faulty())])
    adapter = engine.tiers[0]
    key = vllm.keys(1, "lie")[0]
    adapter.tierkv_tier.lie_about = {key}  # lookup says yes, the load fails
    ctx = engine.new_request()
    assert engine.promote(ctx, [key]) == 0
    for _ in range(20):  # the request keeps asking, as the scheduler does
        assert engine.prefix(ctx, [key]) == (0, False)
        engine.step()
    assert len(calls(adapter, "load")) == 1


def test_a_tier_that_is_down_serves_as_a_miss(vllm: Any, faulty_tier_type: str) -> None:
    engine = vllm.engine([vllm.entry(faulty())])
    engine.tiers[0].tierkv_tier.down = True
    ctx = engine.new_request()
    keys = vllm.keys(3)
    engine.store(ctx, keys)
    engine.settle()
    other = engine.new_request()
    engine.manager.primary_tier.reset_cache()
    assert engine.promote(other, keys) == 0


def test_shutdown_reports_jobs_in_flight_once(vllm: Any, faulty_tier_type: str) -> None:
    engine = vllm.engine([vllm.entry(faulty(), shutdown_grace=0.2)])
    adapter = engine.tiers[0]
    adapter.tierkv_tier.hang = True
    ctx = engine.new_request()
    keys = vllm.keys(3)
    engine.store(ctx, keys)
    assert adapter.has_pending_work()
    engine.shutdown()  # returns although the tier never finishes the job
    finished = list(adapter.get_finished_jobs())
    assert [r.success for r in finished] == [False]
    assert list(adapter.get_finished_jobs()) == []
    assert not adapter.has_pending_work()
    assert adapter.lookup(keys[0], ctx) is not None  # a miss, not an error


def test_jobs_after_shutdown_are_failed_at_once(vllm: Any, faulty_tier_type: str) -> None:
    import numpy as np
    from vllm.v1.kv_offload.base import LookupResult
    from vllm.v1.kv_offload.base import ReqContext as VllmReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    engine = vllm.engine([vllm.entry(faulty())])
    adapter = engine.tiers[0]
    engine.shutdown()
    req = VllmReqContext(req_id="late")
    job = TransferJob(7, vllm.keys(2), np.array([0, 1], dtype=np.int32), False, req)
    adapter.submit_store(job)
    assert [(r.job_id, r.success) for r in adapter.get_finished_jobs()] == [(7, False)]
    assert adapter.lookup(vllm.keys(1)[0], req) is LookupResult.MISS


def test_drain_jobs_waits_for_every_job(vllm: Any, faulty_tier_type: str) -> None:
    engine = vllm.engine([vllm.entry(faulty(delay="50ms"))])
    ctx = engine.new_request()
    engine.store(ctx, vllm.keys(4))
    adapter = engine.tiers[0]
    adapter.drain_jobs()
    assert not adapter.has_pending_work()
    assert [r.success for r in adapter.get_finished_jobs()] == [True]


def memory(blocks: int) -> dict[str, Any]:
    """A memory tier holding exactly `blocks` framed 4 KiB rows (frames are ~70 bytes
    over the row)."""
    return {"type": "memory", "capacity": blocks * 4200}


@pytest.mark.parametrize("claims", [True, False], ids=["claimed", "lease 0: no claims"])
def test_a_hit_the_tier_reported_is_still_there_when_vllm_loads_it(
    vllm: Any, claims: bool
) -> None:
    """The tier answers a request's lookup (a hit on every block), then another
    request's stores fill it before vLLM promotes the hit: the claimed blocks stay,
    the other blocks are evicted in their place, and the load reads every byte.
    Without claims (`claim_lease: 0`) the same run loses the hit."""
    tier = {**memory(8), "claim_lease": "10s" if claims else 0}
    engine = vllm.engine([vllm.entry(tier)], chunks=4)
    old, newer, newest = vllm.keys(4, "old"), vllm.keys(4, "newer"), vllm.keys(4, "newest")
    for keys in (old, newer):  # the tier holds both; the 4-row primary only `newer`
        ctx = engine.new_request()
        engine.store(ctx, keys)
        engine.finish(ctx)
        engine.settle()
    adapter = engine.tiers[0]
    assert holds(adapter, old + newer) == [True] * 8
    reader = engine.new_request()
    assert engine.prefix(reader, old) == (0, True)  # asked: RETRY until the tier answers
    engine.step()
    engine.settle(lambda: adapter._lookups.answer(old[-1], reader.req_id) is not None)
    writer = engine.new_request()
    engine.store(writer, newest)  # the tier must evict 4 blocks for these
    engine.finish(writer)
    engine.settle()
    if claims:
        assert engine.promote(reader, old) == 4
        assert engine.read(reader, old) == [vllm.payload(k) for k in old]
        assert holds(adapter, newer) == [False] * 4, "evicted in the claimed blocks' place"
        assert adapter.tierkv_tier.claims.expired == 0
    else:
        assert engine.promote(reader, old) < 4
    engine.finish(reader)
    engine.settle()
    assert adapter._claim_owners == {}
