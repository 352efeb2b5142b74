"""The demo: a small transformer with a paged KV cache serving a multi-turn chat
workload through tierkv, timed and checked against the same model without it.

    tierkv demo                      # default chain: primary + nvme in a temp directory
    tierkv demo --config chain.yaml --json
    tierkv demo --hybrid window          # full + sliding-window attention, two KV groups
    tierkv demo --hybrid state           # full attention + a gated linear recurrence

`DemoEngine` is also what `examples/async_server.py` serves completions from.
"""

from __future__ import annotations

from tierkv.demo.engine import DemoEngine, Generation, build_engine
from tierkv.demo.hybrid_engine import HybridEngine
from tierkv.demo.hybrid_model import HybridConfig, HybridDecoder
from tierkv.demo.model import ModelConfig, PagedKVCache, TinyDecoder
from tierkv.demo.records import DemoOptions, TurnRecord
from tierkv.demo.run import run_demo
from tierkv.demo.workload import ChatWorkload, Turn, WorkloadConfig

__all__ = [
    "ChatWorkload",
    "DemoEngine",
    "DemoOptions",
    "Generation",
    "HybridConfig",
    "HybridDecoder",
    "HybridEngine",
    "ModelConfig",
    "PagedKVCache",
    "TinyDecoder",
    "Turn",
    "TurnRecord",
    "WorkloadConfig",
    "build_engine",
    "run_demo",
]
