"""A circuit breaker: stop asking a tier that keeps failing, probe it later.

closed --(failure_threshold consecutive failures)--> open --(recovery_after)-->
half-open: one probe is let through; success closes, failure reopens.
While open, the tier is a miss for the calls this breaker guards.

Who may ask what (the rule whose breach left tiers dead until restart under SGLang
and LMCache: a caller took the half-open probe only to *ask* whether the tier
served, then the call itself was refused because the probe was out, and nobody ever
reported on that probe):
- `may_allow` only asks: it takes nothing and may be called any number of times;
- `allow` takes a permit for one call that goes to the tier (the probe, while half
  open). The caller that took it reports exactly once: `record_success`,
  `record_failure`, or `abandon` (the call never happened, or was cancelled);
- a probe nobody reported on within `probe_lease` seconds counts as lost (a caller
  broke the rule): the next `allow` takes a fresh probe, and `lost_probes` counts it,
  so a leak costs one lease of recovery time, never the tier.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import Enum

import anyio

logger = logging.getLogger(__name__)

DEFAULT_PROBE_LEASE = 60.0
"""Seconds a half-open probe may stay out before another is let through, when the
owner names no lease (`GuardedTier` names its tier's job backstop)."""


class BreakerState(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


_RANK = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


def worst(*states: BreakerState) -> BreakerState:
    """The least serving of `states` (open, then half-open, then closed)."""
    return max(states, key=_RANK.__getitem__, default=BreakerState.CLOSED)


class CircuitBreaker:
    def __init__(
        self,
        name: str,
        failure_threshold: int = 3,
        recovery_after: float = 5.0,
        clock: Callable[[], float] | None = None,
        probe_lease: float = DEFAULT_PROBE_LEASE,
    ) -> None:
        self.name = name
        self.failure_threshold = failure_threshold
        self.recovery_after = recovery_after
        self.probe_lease = probe_lease
        self._clock = clock or anyio.current_time
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probe_since: float | None = None
        self.times_opened = 0
        self.lost_probes = 0
        """Probes whose taker never reported (each cost one `probe_lease`)."""

    @property
    def state(self) -> BreakerState:
        if (
            self._state is BreakerState.OPEN
            and self._clock() - self._opened_at >= self.recovery_after
        ):
            return BreakerState.HALF_OPEN
        return self._state

    @property
    def probing(self) -> bool:
        """A half-open probe is out and still within its lease."""
        since = self._probe_since
        return since is not None and self._clock() - since < self.probe_lease

    def may_allow(self) -> bool:
        """Whether `allow` would let a call through now. Takes nothing."""
        state = self.state
        return state is BreakerState.CLOSED or (
            state is BreakerState.HALF_OPEN and not self.probing
        )

    def allow(self) -> bool:
        """Take a permit for one call to the tier (the probe, while half-open: one at
        a time). True obliges the caller to report exactly once (`record_success`,
        `record_failure` or `abandon`)."""
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        if state is not BreakerState.HALF_OPEN:
            return False
        if self._probe_since is not None:
            if self.probing:
                return False
            self.lost_probes += 1
            logger.warning(
                "%s: a half-open probe got no verdict within %.0fs; probing again",
                self.name,
                self.probe_lease,
            )
        self._state = BreakerState.HALF_OPEN
        self._probe_since = self._clock()
        return True

    def record_success(self) -> None:
        if self._state is not BreakerState.CLOSED:
            logger.info("%s recovered; circuit closed", self.name)
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._probe_since = None

    def record_failure(self) -> None:
        self._failures += 1
        self._probe_since = None
        if self._state is BreakerState.HALF_OPEN or self._failures >= self.failure_threshold:
            if self._state is not BreakerState.OPEN:
                self.times_opened += 1
                logger.warning(
                    "%s failed %d times in a row; circuit open for %.1fs",
                    self.name,
                    self._failures,
                    self.recovery_after,
                )
            self._state = BreakerState.OPEN
            self._opened_at = self._clock()

    def abandon(self) -> None:
        """A call let through ended without a verdict (never sent, or cancelled): the
        probe, if it was one, goes back, so another call may probe."""
        self._probe_since = None
