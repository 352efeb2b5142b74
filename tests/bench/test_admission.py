"""`tierkv.bench.admission`: what each admission policy costs per block looked up."""

from __future__ import annotations

from tierkv.bench.admission import bench_admission, full_tier, trace_like


def test_every_policy_is_measured_at_every_ask_size() -> None:
    seen: list[str] = []
    costs = bench_admission(2, batches=(8, 64), rounds=3, tier_blocks=500, progress=seen.append)
    assert list(costs) == ["reuse", "tinylfu", "adaptive", "adaptive, 200-block tier"]
    for cost in costs.values():
        assert list(cost) == ["8", "64"]
        assert all(us > 0 for us in cost.values())
    assert seen == [
        "admission: 8-block asks against a full tier of 500",
        "admission: 64-block asks against a full tier of 500",
    ]


def test_the_tier_is_full_and_names_its_candidates() -> None:
    tier = full_tier(50)
    assert tier.room().free_blocks == 0
    assert len(list(tier.eviction_candidates())) == 50


def test_trace_like_asks_repeat_half_of_the_one_before() -> None:
    ask = trace_like(8, 4)
    first, second = ask(), ask()
    assert len(first) == len(second) == 8
    assert second[:4] == first[:4] and not set(second[4:]) & set(first)
