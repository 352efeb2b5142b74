"""Replay real request traces through a real `TieredCache` (`tierkv bench trace`):
hit rates against references computed from the trace itself, bytes per tier, and a
time-to-first-token estimate from a stated cost model."""

from tierkv.trace.costmodel import CostModel
from tierkv.trace.format import TraceError, TraceRequest, read_trace, request_keys
from tierkv.trace.reference import infinite_cache_hits, lru_hits
from tierkv.trace.replay import ReplayOptions, ReplayReport, replay

__all__ = [
    "CostModel",
    "ReplayOptions",
    "ReplayReport",
    "TraceError",
    "TraceRequest",
    "infinite_cache_hits",
    "lru_hits",
    "read_trace",
    "replay",
    "request_keys",
]
