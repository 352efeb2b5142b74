"""The TTFT cost model (tierkv.trace.costmodel)."""

from __future__ import annotations

import pytest

from tierkv.trace.costmodel import CostModel, RequestCost, arrival_scale_for

MODEL = CostModel(
    prefill_tokens_per_s=1000.0,
    kv_bytes_per_token=100,
    bandwidth={"cpu": 1e6, "nvme": 2e5},
)


def test_one_request_costs_its_loads_then_its_prefill() -> None:
    r = RequestCost(0.0, 500, {"cpu": 100_000, "nvme": 20_000})
    # 0.1 s from the primary, 0.1 s from nvme, 0.5 s of prefill
    assert MODEL.ttft([r]) == pytest.approx([0.7])


def test_a_medium_slower_than_recompute_is_not_read() -> None:
    slow = CostModel(prefill_tokens_per_s=1000.0, kv_bytes_per_token=100, bandwidth={"s3": 1e3})
    # 100 tokens of KV: 10 s to read, 0.1 s to recompute
    assert slow.load_seconds({"s3": 10_000}) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="no bandwidth for medium 'redis'"):
        slow.load_seconds({"redis": 1})


def test_requests_queue_one_prefill_at_a_time() -> None:
    rs = [RequestCost(0.0, 1000, {}), RequestCost(0.5, 1000, {})]
    assert MODEL.ttft(rs) == pytest.approx([1.0, 1.5])
    assert MODEL.ttft(rs, arrival_scale=4.0) == pytest.approx([1.0, 1.0])


def test_prefetch_hides_tier_reads_behind_the_queue_wait_only() -> None:
    rs = [RequestCost(0.0, 1000, {}), RequestCost(0.1, 0, {"nvme": 100_000})]
    # second: waits 0.9 s; its 0.5 s of nvme reads are done by then: 0.1 s from the primary
    assert MODEL.ttft(rs) == pytest.approx([1.0, 0.9 + 0.5])
    assert MODEL.ttft(rs, prefetch=True) == pytest.approx([1.0, 0.9 + 0.1])
    # no wait, no prefetch
    alone = [RequestCost(0.0, 0, {"nvme": 100_000})]
    assert MODEL.ttft(alone, prefetch=True) == MODEL.ttft(alone)


def test_prefetch_is_bounded_by_its_budget_and_by_time() -> None:
    rs = [RequestCost(0.0, 1000, {}), RequestCost(0.1, 0, {"nvme": 100_000})]
    half = CostModel(
        prefill_tokens_per_s=1000.0,
        kv_bytes_per_token=100,
        bandwidth={"cpu": 1e6, "nvme": 2e5},
        prefetch_budget_bytes=50_000,
    )
    # half prefetched: 0.05 s from the primary + 0.25 s from nvme
    assert half.ttft(rs, prefetch=True)[1] == pytest.approx(0.9 + 0.05 + 0.25)
    short = [RequestCost(0.0, 200, {}), RequestCost(0.0, 0, {"nvme": 100_000})]
    # waits 0.2 s: 40 % of the 0.5 s read done -> 0.04 + 0.3
    assert MODEL.ttft(short, prefetch=True)[1] == pytest.approx(0.2 + 0.04 + 0.3)


def test_the_arrival_scale_sets_the_load() -> None:
    rs = [RequestCost(0.0, 1000, {}), RequestCost(10.0, 1000, {"cpu": 100_000})]
    # no cache: 1 s + (1,000 hit tokens + 1,000) = 3 s of prefill over a 10 s span
    assert arrival_scale_for(rs, MODEL, 0.3) == pytest.approx(1.0)
    assert arrival_scale_for(rs, MODEL, 0.6) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="load must be > 0"):
        arrival_scale_for(rs, MODEL, 0)
