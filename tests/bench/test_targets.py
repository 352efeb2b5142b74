"""`check_targets`: per bound figure of a report, its value, its bound and whether it
was met; a phase that did not run has no targets."""

from __future__ import annotations

import pytest

from tierkv.bench import TARGETS, check_targets


def test_each_figure_is_checked_against_its_bound() -> None:
    report = {
        "streaming": {"store_ratio": 0.81, "load_ratio": 0.79, "promotion_vs_slower_stage": 1.25},
        "orchestrator": {
            "load_1024_us_per_block": 5.01,
            "lookup_hit_keys_per_s": 2e6,
            "host_store_us_per_key_beyond_copy": 1.0,
            "host_load_us_per_key_beyond_copy": 3.0,
        },
    }
    checked = check_targets(report)
    assert list(checked) == [t.name for t in TARGETS]
    assert checked["streaming_store_ratio"] == {"value": 0.81, "min": 0.8, "met": True}
    assert checked["streaming_load_ratio"] == {"value": 0.79, "min": 0.8, "met": False}
    assert checked["promotion_vs_slower_stage"] == {"value": 1.25, "max": 1.25, "met": True}
    assert checked["load_1024_us_per_block"]["met"] is False
    assert checked["lookup_us_per_key"] == {"value": pytest.approx(0.5), "max": 1, "met": True}
    assert checked["host_store_us_per_key_beyond_copy"]["met"] is True
    assert checked["host_load_us_per_key_beyond_copy"]["met"] is False


def test_a_phase_that_did_not_run_has_no_targets() -> None:
    assert check_targets({"streaming": None, "orchestrator": None}) == {}
    only_streaming = {"streaming": {"store_ratio": 1, "load_ratio": 1,
                                    "promotion_vs_slower_stage": 1}}  # fmt: skip
    assert list(check_targets(only_streaming)) == [
        "streaming_store_ratio", "streaming_load_ratio", "promotion_vs_slower_stage",
    ]  # fmt: skip
