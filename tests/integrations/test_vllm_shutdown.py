"""vLLM unmaps its primary after `shutdown()` with the garbage collector off: tierkv
lets go of every view of the slab itself instead of leaving cycles for the collector
(issue 19, item 3). vLLM keeps a region mapped, and says so, while any view of it lives.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture
def no_collector() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def region_of(engine: Any) -> Any:
    return engine.manager.primary_tier._mmap_region


def nvme(path: Path) -> dict[str, Any]:
    return {"type": "nvme", "path": str(path), "capacity": "4MiB", "layout": "files"}


def corrupt_every_block(root: Path) -> int:
    files = [p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")]
    for path in files:
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    return len(files)


def assert_unmapped(engine: Any, caplog: pytest.LogCaptureFixture) -> None:
    assert not [r for r in caplog.records if "mapped" in r.getMessage()], caplog.text
    assert region_of(engine).mmap_obj is None, "vLLM kept its primary mapped"


def test_a_failed_promotion_leaves_no_view_of_the_slab_behind(
    vllm: Any, tmp_path: Path, no_collector: None, caplog: pytest.LogCaptureFixture
) -> None:
    engine = vllm.engine([vllm.entry(nvme(tmp_path))])
    ctx = engine.new_request()
    keys = vllm.keys(4, "corrupt")
    engine.store(ctx, keys)
    engine.settle()
    assert corrupt_every_block(tmp_path) >= len(keys)
    with engine.manager.lock:
        engine.manager.reset_cache()
        engine.manager.on_reset_flushed()
    other = engine.new_request()
    assert engine.promote(other, keys) == 0  # every read fails its check
    caplog.set_level(logging.WARNING)
    engine.shutdown()
    assert_unmapped(engine, caplog)


def test_a_caller_holding_the_tierkv_tier_does_not_keep_the_slab_mapped(
    vllm: Any, tmp_path: Path, no_collector: None, caplog: pytest.LogCaptureFixture
) -> None:
    engine = vllm.engine([vllm.entry(nvme(tmp_path))])
    adapter = engine.tiers[0]
    held = adapter.tierkv_tier  # a test, a metrics exporter, a debugger...
    ctx = engine.new_request()
    engine.store(ctx, vllm.keys(2))
    engine.settle()
    caplog.set_level(logging.WARNING)
    engine.shutdown()
    assert_unmapped(engine, caplog)
    with pytest.raises(ValueError, match="released"):
        held.primary.block(0)  # a clear error, not a write into unmapped memory


def test_a_store_thread_left_on_a_frozen_redis_does_not_keep_the_slab_mapped(
    vllm: Any, tmp_path: Path, no_collector: None, caplog: pytest.LogCaptureFixture
) -> None:
    try:
        from tierkv_redis.testing import RedisServer

        server = RedisServer(tmp_path)
    except Exception as exc:
        from tierkv.testing import missing_server

        missing_server("tierkv-cache-redis and a redis-server", exc)
    with server:
        tier = {"type": "redis", "url": server.url, "job_timeout": "6s"}
        engine = vllm.engine([vllm.entry(tier, shutdown_grace=0.2)])
        ctx = engine.new_request()
        engine.store(ctx, vllm.keys(2, "before"))
        engine.settle()
        server.freeze()  # the next store's thread waits on a socket nobody answers
        try:
            engine.store(ctx, vllm.keys(3, "frozen"))
            time.sleep(0.5)  # the store's thread is in its socket now
            caplog.set_level(logging.WARNING)
            engine.shutdown()
            left = [t for t in threading.enumerate() if t.name.startswith("tierkv-redis")]
            assert left, "the scenario needs a thread still waiting on the frozen server"
            assert_unmapped(engine, caplog)
        finally:
            server.thaw()
