"""The demo: a small transformer with a paged KV cache serving a multi-turn chat
workload through tierkv, timed and checked against the same model without it.

    tierkv demo                      # default chain: primary + nvme in a temp directory
    tierkv demo --config chain.yaml --json

`DemoEngine` is also what `examples/async_server.py` serves completions from.
"""

from __future__ import annotations

from tierkv.demo.engine import DemoEngine, Generation, build_engine
from tierkv.demo.model import ModelConfig, PagedKVCache, TinyDecoder
from tierkv.demo.run import DemoOptions, TurnRecord, run_demo
from tierkv.demo.workload import ChatWorkload, Turn, WorkloadConfig

__all__ = [
    "ChatWorkload",
    "DemoEngine",
    "DemoOptions",
    "Generation",
    "ModelConfig",
    "PagedKVCache",
    "TinyDecoder",
    "Turn",
    "TurnRecord",
    "WorkloadConfig",
    "build_engine",
    "run_demo",
]
