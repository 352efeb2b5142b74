"""A circuit breaker per tier: stop asking a tier that keeps failing, probe it later.

closed --(failure_threshold consecutive failures)--> open --(recovery_after)-->
half-open: one probe is let through; success closes, failure reopens.
While open, the cache treats the tier as a miss for lookups and skips stores to it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import Enum

import anyio

logger = logging.getLogger(__name__)


class BreakerState(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(
        self,
        name: str,
        failure_threshold: int = 3,
        recovery_after: float = 5.0,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.name = name
        self.failure_threshold = failure_threshold
        self.recovery_after = recovery_after
        self._clock = clock or anyio.current_time
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probing = False
        self.times_opened = 0

    @property
    def state(self) -> BreakerState:
        if (
            self._state is BreakerState.OPEN
            and self._clock() - self._opened_at >= self.recovery_after
        ):
            return BreakerState.HALF_OPEN
        return self._state

    def allow(self) -> bool:
        """Whether to send a request to the tier now. In half-open, only one probe
        is in flight at a time."""
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.HALF_OPEN and not self._probing:
            self._state = BreakerState.HALF_OPEN
            self._probing = True
            return True
        return False

    def record_success(self) -> None:
        if self._state is not BreakerState.CLOSED:
            logger.info("tier %s recovered; circuit closed", self.name)
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._probing = False

    def record_failure(self) -> None:
        self._failures += 1
        self._probing = False
        if self._state is BreakerState.HALF_OPEN or self._failures >= self.failure_threshold:
            if self._state is not BreakerState.OPEN:
                self.times_opened += 1
                logger.warning(
                    "tier %s failed %d times in a row; circuit open for %.1fs",
                    self.name,
                    self._failures,
                    self.recovery_after,
                )
            self._state = BreakerState.OPEN
            self._opened_at = self._clock()

    def abandon(self) -> None:
        """A request let through ended without a verdict (cancelled): allow another probe."""
        self._probing = False
