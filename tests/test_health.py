"""`CircuitBreaker`: who may ask, who takes the probe, and what a lost probe costs."""

from __future__ import annotations

from tierkv.health import BreakerState, CircuitBreaker, worst


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def opened(clock: Clock, **kw: float) -> CircuitBreaker:
    breaker = CircuitBreaker("t", failure_threshold=2, recovery_after=5.0, clock=clock, **kw)
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN
    return breaker


def test_failures_open_and_after_recovery_one_probe_goes_through() -> None:
    clock = Clock()
    breaker = opened(clock)
    assert not breaker.may_allow() and not breaker.allow()
    clock.now = 5.0
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.allow()  # the probe
    assert not breaker.allow() and not breaker.may_allow()  # no second one meanwhile
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED and breaker.allow() and breaker.allow()


def test_asking_takes_nothing() -> None:
    clock = Clock()
    breaker = opened(clock)
    clock.now = 5.0
    assert all(breaker.may_allow() for _ in range(5))
    assert breaker.allow()


def test_a_failed_probe_reopens_for_another_interval() -> None:
    clock = Clock()
    breaker = opened(clock)
    clock.now = 5.0
    assert breaker.allow()
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN
    clock.now = 9.0
    assert not breaker.may_allow()
    clock.now = 10.0
    assert breaker.allow()


def test_an_abandoned_probe_goes_back() -> None:
    clock = Clock()
    breaker = opened(clock)
    clock.now = 5.0
    assert breaker.allow()
    breaker.abandon()
    assert breaker.state is BreakerState.HALF_OPEN and breaker.allow()


def test_a_probe_nobody_reports_on_is_lost_after_its_lease_not_forever() -> None:
    """A caller that takes the probe and never reports (the engines' bug) costs one
    lease of recovery time, not the tier."""
    clock = Clock()
    breaker = opened(clock, probe_lease=30.0)
    clock.now = 5.0
    assert breaker.allow()  # leaked
    clock.now = 34.9
    assert not breaker.allow() and breaker.lost_probes == 0
    clock.now = 35.0
    assert breaker.may_allow() and breaker.allow()
    assert breaker.lost_probes == 1
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED


def test_worst_orders_the_states() -> None:
    closed, half, open_ = BreakerState.CLOSED, BreakerState.HALF_OPEN, BreakerState.OPEN
    assert worst(closed, closed) is closed
    assert worst(closed, half) is half
    assert worst(half, open_, closed) is open_
    assert worst() is closed
