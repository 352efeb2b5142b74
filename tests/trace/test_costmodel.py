"""The TTFT cost model (tierkv.trace.costmodel)."""

from __future__ import annotations

import pytest

from tierkv.trace.costmodel import (
    CostModel,
    PrefetchedBytes,
    RequestCost,
    ServerClock,
    arrival_scale_for,
    ttft_summary,
)

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


def test_prefetched_bytes_read_by_the_start_come_from_the_primary() -> None:
    # second: arrives at 0.1, waits until 1.0; 100 KB from nvme, all prefetched
    read = PrefetchedBytes("nvme", 100_000, 0.1, 0.6)  # 0.5 s on the channel
    rs = [
        RequestCost(0.0, 1000, {}),
        RequestCost(0.1, 0, {"nvme": 100_000}, (read,)),
    ]
    assert MODEL.ttft(rs) == pytest.approx([1.0, 0.9 + 0.1])  # 0.1 s from the primary
    # the read still under way at the start: 40 % done, the load reads the rest
    late = PrefetchedBytes("nvme", 100_000, 0.8, 1.3)
    rs[1] = RequestCost(0.1, 0, {"nvme": 100_000}, (late,))
    assert MODEL.ttft(rs)[1] == pytest.approx(0.9 + 0.04 + 0.3)
    # nothing read yet: as without prefetch
    rs[1] = RequestCost(0.1, 0, {"nvme": 100_000}, (PrefetchedBytes("nvme", 100_000, 2, 3),))
    assert MODEL.ttft(rs)[1] == pytest.approx(0.9 + 0.5)


def test_the_clock_reads_prefetches_one_after_another() -> None:
    clock = ServerClock(MODEL, arrival_scale=0.5)
    assert clock.arrival(2.0) == 1.0
    assert clock.read_prefetch(1.0, {"nvme": 100_000}) == pytest.approx((1.0, 1.5))
    # issued earlier, still waits for the channel
    assert clock.read_prefetch(1.2, {"nvme": 20_000}) == pytest.approx((1.5, 1.6))
    assert clock.next_start(2.0) == 1.0
    assert clock.serve(RequestCost(2.0, 1000, {})) == pytest.approx(1.0)
    assert clock.next_start(2.0) == pytest.approx(2.0)  # the server is busy until 2.0
    with pytest.raises(ValueError, match="arrival_scale must be > 0"):
        ServerClock(MODEL, 0)


def test_the_summary_has_mean_median_and_p99() -> None:
    times = [float(i) for i in range(1, 101)]
    assert ttft_summary(times) == {"mean": 50.5, "p50": 51.0, "p99": 100.0}
    assert ttft_summary([]) == {"mean": 0.0, "p50": 0.0, "p99": 0.0}


def test_the_arrival_scale_sets_the_load() -> None:
    rs = [RequestCost(0.0, 1000, {}), RequestCost(10.0, 1000, {"cpu": 100_000})]
    # no cache: 1 s + (1,000 hit tokens + 1,000) = 3 s of prefill over a 10 s span
    assert arrival_scale_for(rs, MODEL, 0.3) == pytest.approx(1.0)
    assert arrival_scale_for(rs, MODEL, 0.6) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="load must be > 0"):
        arrival_scale_for(rs, MODEL, 0)
