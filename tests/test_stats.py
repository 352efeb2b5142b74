"""Nearest-rank percentiles, shared by the cache's latency summaries, the demo and bench."""

from __future__ import annotations

from tierkv.stats import LatencySummary, percentile


def test_percentile_is_the_nearest_rank() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 0.0) == 1.0
    assert percentile(values, 0.5) == 3.0
    assert percentile(values, 0.99) == 5.0
    assert percentile([], 0.5) == 0.0


def test_latency_summary_uses_its_recent_window() -> None:
    summary = LatencySummary(window=3)
    for seconds in (10.0, 0.001, 0.002, 0.003):
        summary.add(seconds)
    assert summary.count == 4 and summary.max == 10.0
    assert summary.percentile(0.99) == 0.003  # 10.0 has left the window
    assert summary.snapshot()["p50_ms"] == 2.0
