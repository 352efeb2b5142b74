"""Replay real request traces through a real `TieredCache` (`tierkv bench trace`):
hit rates against references computed from the trace itself, bytes per tier, and a
time-to-first-token estimate from a stated cost model; a queued replay behind a
modelled server that prefetches for the requests it has queued (`replay_queued`); a
sweep of primary sizes x tier capacities x admission policies in one table
(`run_capacity_sweep`); one tenant's served share alone and beside the others, with or
without quotas (`run_tenant_report`); and a generated conversation-shaped trace to run
them on, with a flooding second tenant if asked (`tierkv.trace.conversations`)."""

from tierkv.trace.conversations import ConversationSpec
from tierkv.trace.costmodel import CostModel, ServerClock
from tierkv.trace.format import TraceError, TraceRequest, read_trace, request_keys
from tierkv.trace.reference import infinite_cache_hits, lru_hits
from tierkv.trace.replay import ReplayOptions, ReplayReport, replay
from tierkv.trace.server import QueuedReport, ServerOptions, replay_queued
from tierkv.trace.sweep import SweepOptions, run_capacity_sweep
from tierkv.trace.tenants import TenantReportOptions, run_tenant_report

__all__ = [
    "ConversationSpec",
    "CostModel",
    "QueuedReport",
    "ReplayOptions",
    "ReplayReport",
    "ServerClock",
    "ServerOptions",
    "SweepOptions",
    "TenantReportOptions",
    "TraceError",
    "TraceRequest",
    "infinite_cache_hits",
    "lru_hits",
    "read_trace",
    "replay",
    "replay_queued",
    "run_capacity_sweep",
    "run_tenant_report",
    "request_keys",
]
