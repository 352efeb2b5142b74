"""A circuit breaker for one Redis Cluster node, inside the redis tier.

The cache keeps one breaker per tier; on a cluster that is too coarse: one dead master
would make every key of the tier a miss. Each node gets its own, with one failure
enough to open it (a refused connection or a timeout is not worth repeating per key):

    closed --(a failure)--> open --(probe_after)--> half_open: one request goes
    through as the probe; success closes, failure opens again for probe_after

While it is open the keys the node serves are misses (lookups) and failed keys (jobs),
answered without touching the network. Used from the event loop only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal

logger = logging.getLogger(__name__)

NodeState = Literal["closed", "open", "half_open"]


class NodeBreaker:
    """Whether to send a request to one node now."""

    def __init__(
        self, node: str, probe_after: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.node = node
        self.probe_after = probe_after
        self._clock = clock
        self._open = False
        self._opened_at = 0.0
        self._probing = False
        self.reason = ""  # why it opened: the error that failed the node
        self.times_opened = 0

    @property
    def state(self) -> NodeState:
        if not self._open:
            return "closed"
        if self._clock() - self._opened_at >= self.probe_after:
            return "half_open"
        return "open"

    @property
    def closed(self) -> bool:
        return not self._open

    def allow(self) -> bool:
        """True when closed, and for the one probe of a half-open node."""
        state = self.state
        if state == "closed":
            return True
        if state == "half_open" and not self._probing:
            self._probing = True
            return True
        return False

    def succeeded(self) -> None:
        if self._open:
            logger.info("redis cluster node %s answers again; its slots are served", self.node)
        self._open = False
        self._probing = False

    def failed(self, reason: str) -> None:
        if not self._open:
            self.times_opened += 1
            logger.warning("%s; its keys miss for %gs, then a probe", reason, self.probe_after)
        self._open = True
        self._probing = False
        self._opened_at = self._clock()
        self.reason = reason

    def abandon(self) -> None:
        """A request let through ended without a verdict (cancelled): another may probe."""
        self._probing = False

    def explain(self) -> str:
        """Why this node's keys are not tried now, for a failed key's message."""
        wait = max(0.0, self.probe_after - (self._clock() - self._opened_at))
        probe = "probe in flight" if self._probing else f"next probe in {wait:.1f}s"
        return f"{self.reason} (node breaker open, {probe})"
