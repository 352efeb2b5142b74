"""What a tierkv tier under vLLM adds to vLLM's offloading metrics.

vLLM's tiering manager already measures each tier from the job results it gets
(bytes and time read and written, failed promotion and cascade jobs, lookup delays,
hits per chunk). It cannot see inside a tier: how many keys were asked of the
storage, how many lookups failed and were answered as misses, why a job failed (the
tier down, its timeout, too many bytes in flight, shutdown), which blocks the tier
dropped on its own, how much reuse was forwarded, whether the tier is up. Those are
these metrics, one series per tier, labelled as vLLM labels its tiers
(`"<1-based index>:<tier type>"` under the `tier` label), so they join with vLLM's own.

`TierMetrics` counts from the scheduler thread and the adapter's loop thread;
`take()` is vLLM's `get_stats()`: the observations since the last call.
"""

from __future__ import annotations

import threading
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
)
from vllm.v1.kv_offload.tiering.base import TIER_LABEL

PREFIX = "vllm:kv_offload_tierkv_"
LOOKUP_KEYS = PREFIX + "lookup_keys"
LOOKUP_HITS = PREFIX + "lookup_hits"
LOOKUP_ERRORS = PREFIX + "lookup_errors"
FAILED_JOBS = PREFIX + "failed_jobs"
FAILED_BLOCKS = PREFIX + "failed_blocks"
REMOVED_BLOCKS = PREFIX + "removed_blocks"
TOUCHED_BLOCKS = PREFIX + "touched_blocks"
UP = PREFIX + "up"
STORE_BYTES_IN_FLIGHT = PREFIX + "store_bytes_in_flight"

FAILURE_REASONS = (
    "not_serving",
    "max_inflight",
    "timeout",
    "error",
    "keys_failed",
    "quota",
    "shutdown",
)
"""Why a job failed (the `reason` label of FAILED_JOBS): the tier was not open or its
circuit breaker was open (refused at once); its store would pass `max_inflight_bytes`;
the tier gave no answer within `job_timeout` plus the grace (a contract breach: a tier
that reports its late keys itself, as `run_job` does, shows `keys_failed`); the tier
raised, or the job was malformed; the tier's result failed some or all keys (late ones
included); the request's tenant holds its quota of the tier and the keys that failed
were declined for it (`quotas`; not a fault of the tier); shutdown or `drain_jobs`
cancelled it first."""


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """The metrics above, for vLLM's `build_metric_definitions`."""
    tier = (TIER_LABEL,)
    counters: dict[str, tuple[str, tuple[str, ...]]] = {
        LOOKUP_KEYS: ("Keys a tierkv tier was asked about (batched per request and step).", tier),
        LOOKUP_HITS: ("Keys a tierkv tier answered as held.", tier),
        LOOKUP_ERRORS: (
            "Keys whose lookup failed (tier down, timeout) and were answered as misses.",
            tier,
        ),
        FAILED_JOBS: (
            "Jobs of a tierkv tier reported failed, by operation (load, store) and reason ("
            + ", ".join(FAILURE_REASONS)
            + ").",
            (TIER_LABEL, "op", "reason"),
        ),
        FAILED_BLOCKS: (
            "Blocks of failed or partly failed jobs that did not move.",
            (TIER_LABEL, "op"),
        ),
        REMOVED_BLOCKS: (
            "Blocks a tierkv tier dropped on its own (capacity eviction, expiry, a failed "
            "integrity check).",
            tier,
        ),
        TOUCHED_BLOCKS: ("Reuses forwarded to a tierkv tier's eviction order (touch).", tier),
    }
    gauges = {
        UP: "1 while a tierkv tier is open and serving, else 0.",
        STORE_BYTES_IN_FLIGHT: "Bytes of store jobs submitted to a tierkv tier and not yet "
        "reported (bounded by max_inflight_bytes).",
    }
    definitions: dict[str, OffloadingMetricMetadata] = {
        name: OffloadingCounterMetadata(documentation=doc, labelnames=labels)
        for name, (doc, labels) in counters.items()
    }
    for name, doc in gauges.items():
        definitions[name] = OffloadingGaugeMetadata(documentation=doc, labelnames=tier)
    return definitions


class TierMetrics:
    """Counters of one tier between two `take()`s; thread-safe."""

    def __init__(self, tier_label: str) -> None:
        self.label = tier_label
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, tuple[str, ...]], int] = {}

    def count(self, name: str, n: int = 1, *labels: str) -> None:
        if n:
            key = (name, (self.label, *labels))
            with self._lock:
                self._counts[key] = self._counts.get(key, 0) + n

    def job_failed(self, op: str, blocks: int, reason: str) -> None:
        """A job of `op` failed `blocks` of its keys (nothing when none), for `reason`
        (`FAILURE_REASONS`)."""
        if blocks:
            self.count(FAILED_JOBS, 1, op, reason)
            self.count(FAILED_BLOCKS, blocks, op)

    def take(self, *, up: bool, store_bytes_in_flight: int) -> Any:
        """An `OffloadingConnectorStats` with the counts since the last call and the
        gauges now."""
        with self._lock:
            counts, self._counts = self._counts, {}
        stats = OffloadingConnectorStats()
        for (name, labels), n in counts.items():
            stats.increase_counter(name, n, labels)
        stats.set_gauge(UP, 1 if up else 0, (self.label,))
        stats.set_gauge(STORE_BYTES_IN_FLIGHT, store_bytes_in_flight, (self.label,))
        return stats
