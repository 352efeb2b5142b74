"""The breaker of one Redis Cluster node (`tierkv_redis.nodes`), on a clock of its own."""

from __future__ import annotations

from tierkv_redis.nodes import NodeBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_failure_opens_it_and_one_probe_goes_through_after_the_interval() -> None:
    clock = Clock()
    breaker = NodeBreaker("127.0.0.1:7000", probe_after=2.0, clock=clock)
    assert breaker.state == "closed" and breaker.allow() and breaker.allow()

    breaker.failed("redis cluster node 127.0.0.1:7000 unreachable: refused")
    assert breaker.state == "open" and not breaker.allow()
    assert breaker.explain().startswith("redis cluster node 127.0.0.1:7000 unreachable")
    assert "next probe in 2.0s" in breaker.explain()
    clock.now += 1.9
    assert not breaker.allow()

    clock.now += 0.1
    assert breaker.state == "half_open"
    assert breaker.allow()  # the probe
    assert not breaker.allow()  # and no other while it is out
    assert "probe in flight" in breaker.explain()
    breaker.failed("still refused")  # a failed probe: open for another interval
    assert breaker.state == "open" and breaker.reason == "still refused"
    clock.now += 2.0
    assert breaker.allow()
    breaker.succeeded()
    assert breaker.state == "closed" and breaker.closed and breaker.allow()
    assert breaker.times_opened == 1


def test_a_probe_cancelled_without_a_verdict_lets_another_probe() -> None:
    clock = Clock()
    breaker = NodeBreaker("n", probe_after=1.0, clock=clock)
    breaker.failed("timeout")
    clock.now += 1.0
    assert breaker.allow()
    breaker.abandon()
    assert breaker.state == "half_open" and breaker.allow()
