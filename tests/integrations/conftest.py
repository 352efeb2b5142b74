"""A small driver for vLLM's REAL tiering manager (from the installed wheel), calling
it the way vLLM's offloading scheduler does: under its lock, one step at a time.

vLLM is imported lazily, inside the fixtures: where it is missing these tests skip,
and under CI=true they fail (`tierkv.testing.missing_server`).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tierkv.testing import missing_server

ROW = 4096  # bytes of one primary chunk row (a page: vLLM aligns rows to pages)


def payload(key: bytes, row: int = ROW) -> bytes:
    """The bytes a test stores under `key` (distinct per key, checkable after a load)."""
    seed = hashlib.blake2b(key, digest_size=64).digest()
    return (seed * (row // 64 + 1))[:row]


def make_keys(n: int, salt: str = "") -> list[bytes]:
    from vllm.v1.kv_offload.base import make_offload_key

    hashes = [hashlib.sha256(f"{salt}{i}".encode()).digest()[:16] for i in range(n)]
    return [make_offload_key(h, 0) for h in hashes]


class Engine:
    """One vLLM `TieringOffloadingSpec` + manager over a shared-memory primary of
    `chunks` rows, with the given `secondary_tiers` entries and KV `groups`."""

    def __init__(
        self,
        secondary_tiers: list[dict[str, Any]],
        *,
        chunks: int = 32,
        model: str = "tiny-model",
        dtype: str = "float16",
        tp: int = 1,
        agnostic: bool = False,
        replicated: bool = False,
        events: bool = False,
        row: int = ROW,
        groups: Sequence[tuple[int, int | None]] = ((16, None),),
    ) -> None:
        from vllm.v1.kv_offload.config import (
            OffloadingCacheConfig,
            OffloadingConfig,
            OffloadingGroupConfig,
            OffloadingModelConfig,
            OffloadingParallelConfig,
        )
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        from tierkv.integrations.vllm import register

        register()  # what the vllm.general_plugins entry point does at start-up
        config = OffloadingConfig(
            groups=tuple(  # (tokens per block, sliding_window_size_in_chunks) each
                OffloadingGroupConfig(
                    tokens_per_block=tokens,
                    layer_names=(f"l{g}",),
                    group_id=g,
                    sliding_window_size_in_chunks=window,
                )
                for g, (tokens, window) in enumerate(groups)
            ),
            worker_kv_bytes_per_block=row // tp,
            enable_kv_cache_events=events,
            extra_config={"cpu_bytes_to_use": row * chunks, "secondary_tiers": secondary_tiers},
            engine_id=f"tierkv-test-{uuid.uuid4().hex}",
            model=OffloadingModelConfig(name=model, dtype=dtype),
            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(
                rank=0,
                world_size=tp,
                tp_size=tp,
                pp_size=1,
                pcp_size=1,
                dcp_size=1,
                data_parallel_index=0,
                data_parallel_size=1,
                data_parallel_rank_local=None,
                is_parallelism_agnostic=agnostic,
            ),
            replicated_layout=replicated,
        )
        self.row = row
        self.spec = TieringOffloadingSpec(config)
        self.manager = self.spec.get_manager()
        self.view = self.manager.primary_tier.get_kv_memoryview().cast("B")  # flat bytes
        self.tiers = list(self.manager.secondary_tiers)
        self.last_steps = 0  # scheduler steps the last `promote` took
        self._closed = False

    # -- one scheduler step's calls -------------------------------------------------
    def new_request(self, req_id: str | None = None) -> Any:
        from vllm.v1.kv_offload.base import ReqContext

        ctx = ReqContext(req_id=req_id or uuid.uuid4().hex)
        with self.manager.lock:
            self.manager.on_new_request(ctx)
        return ctx

    def finish(self, ctx: Any) -> None:
        with self.manager.lock:
            self.manager.on_request_finished(ctx)

    def store(self, ctx: Any, keys: Sequence[bytes]) -> list[bytes]:
        """GPU -> primary as the worker would (bytes written into the rows), then
        complete_store, which cascades to every secondary tier."""
        with self.manager.lock:
            out = self.manager.prepare_store(list(keys), ctx)
            assert out is not None, "the primary had no room"
            for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids):
                start = int(chunk) * self.row
                self.view[start : start + self.row] = payload(key, self.row)
            if out.keys_to_store:  # as the scheduler: only what it was told to store
                self.manager.complete_store(list(out.keys_to_store), ctx, True)
        return list(out.keys_to_store)

    def lookup(self, ctx: Any, key: bytes) -> Any:
        with self.manager.lock:
            return self.manager.lookup(key, ctx)

    def prefix(self, ctx: Any, keys: Sequence[bytes]) -> tuple[int, bool]:
        """(hits, deferred), as vLLM's scheduler scans a request's keys
        (`_maximal_prefix_lookup`): HIT and HIT_PENDING count, RETRY defers and the
        scan goes on (so the tiers are asked about every key), MISS ends it."""
        from vllm.v1.kv_offload.base import LookupResult

        hits, deferred = 0, False
        with self.manager.lock:
            for key in keys:
                result = self.manager.lookup(key, ctx)
                if result is LookupResult.MISS:
                    break
                if result is LookupResult.RETRY:
                    deferred = True
                    continue
                hits += 1
                deferred |= result is LookupResult.HIT_PENDING
        return hits, deferred

    def step(self) -> None:
        from vllm.v1.kv_offload.base import ScheduleEndContext

        with self.manager.lock:
            self.manager.on_schedule_end(ScheduleEndContext((), ()))

    def read(self, ctx: Any, keys: Sequence[bytes]) -> list[bytes]:
        """primary -> GPU as the worker would: the rows' bytes, then complete_load."""
        with self.manager.lock:
            spec = self.manager.prepare_load(list(keys), ctx)
            r = self.row
            rows = [bytes(self.view[int(c) * r : (int(c) + 1) * r]) for c in spec.chunk_ids]
            self.manager.complete_load(list(keys), ctx)
        return rows

    def settle(self, until: Callable[[], bool] | None = None, timeout: float = 30.0) -> int:
        """Step until `until()` (default: no transfer in flight); steps taken. Fails
        the test rather than hang when it never happens."""
        done = until or (lambda: not self.busy())
        deadline = time.monotonic() + timeout
        steps = 0
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"not settled after {timeout}s ({steps} steps)")
            self.step()
            steps += 1
            time.sleep(0.002)
        self.step()
        return steps

    def busy(self) -> bool:
        with self.manager.lock:
            return bool(self.manager.has_pending_work())

    def promote(self, ctx: Any, keys: Sequence[bytes], timeout: float = 30.0) -> int:
        """Look `keys` up until the answer is final (promotions done); the hit count."""
        final: list[int] = []

        def settled() -> bool:
            hits, pending = self.prefix(ctx, keys)
            if pending:
                return False
            final.append(hits)
            return True

        self.last_steps = self.settle(settled, timeout)
        return final[-1]

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self.view.release()
            self.manager.shutdown()


class Harness:
    """What a test gets from the `vllm` fixture: engines and the helpers above."""

    payload = staticmethod(payload)
    keys = staticmethod(make_keys)

    def __init__(self) -> None:
        self.engines: list[Engine] = []

    def engine(self, secondary_tiers: list[dict[str, Any]], **kwargs: Any) -> Engine:
        engine = Engine(secondary_tiers, **kwargs)
        self.engines.append(engine)
        return engine

    @staticmethod
    def entry(tier: dict[str, Any], **extra: Any) -> dict[str, Any]:
        """A `secondary_tiers` entry as a vLLM user writes it."""
        return {"type": "tierkv", "tier": tier, **extra}


@pytest.fixture
def vllm() -> Iterator[Harness]:
    """vLLM's real tiering manager, ready to build; every engine is shut down after."""
    try:
        import vllm.v1.kv_offload.tiering.spec  # noqa: F401
    except Exception as exc:
        missing_server("vLLM 0.33 (scripts/setup-vllm.sh installs requirements-vllm.txt)", exc)
    harness = Harness()
    yield harness
    for engine in harness.engines:
        engine.shutdown()


# -- real faults that clear, for the adapters' recovery tests ---------------------------
RECOVERY = {"job_timeout": "1s", "recovery_after": "0.5s", "failure_threshold": 2}
"""Breaker settings of the recovery tests: quick to open, quick to probe."""


class TierFault:
    """One real fault under one tier section: `inject`, then `clear`. `keeps_reads`:
    whether blocks stored before the fault stay readable while it lasts (a full or
    immutable disk: yes; a redis killed with persistence off: no, they are gone)."""

    def __init__(self, name: str, section: dict[str, Any], keeps_reads: bool) -> None:
        self.name, self.section, self.keeps_reads = name, section, keeps_reads
        self._stack = contextlib.ExitStack()
        self.inject: Callable[[], None] = lambda: None
        self.clear: Callable[[], None] = lambda: None

    def close(self) -> None:
        self._stack.close()


@pytest.fixture(params=["disk_full", "immutable", "redis_killed"])
def tier_fault(request: Any, tmp_path: Path) -> Iterator[TierFault]:
    """Each real fault the recovery promise is tested against: the nvme tier's disk
    filled then freed, its directories made immutable then writable, redis-server
    SIGKILLed then restarted (empty)."""
    from tierkv.testing import DiskFaultUnavailable, immutable, tiny_disk

    where = tmp_path / "tier"
    nvme = {"type": "nvme", "path": str(where), **RECOVERY}
    try:
        if request.param == "disk_full":
            fault = TierFault("disk_full", {**nvme, "capacity": "4MiB"}, keeps_reads=True)
            disk = fault._stack.enter_context(tiny_disk(where, 8 << 20))
            fault.inject, fault.clear = disk.fill, disk.free
        elif request.param == "immutable":
            # an immutable directory stops new files, not writes into files that exist:
            # the slab layout's slots are not stopped by it, so this fault is the file
            # layout's (the disk filled is both layouts': the default is slab)
            section = {**nvme, "capacity": "64MiB", "layout": "files"}
            fault = TierFault("immutable", section, keeps_reads=True)
            frozen = contextlib.ExitStack()
            fault._stack.enter_context(frozen)
            fault.inject = lambda: frozen.enter_context(immutable(where))
            fault.clear = frozen.close
        else:
            try:
                from tierkv_redis.testing import RedisServer

                (tmp_path / "redis-data").mkdir()
                server = RedisServer(tmp_path / "redis-data")
            except Exception as exc:  # tierkv-cache-redis or redis-server missing
                missing_server("tierkv-cache-redis and a redis-server", exc)
            fault = TierFault("redis_killed", {}, keeps_reads=False)
            fault._stack.enter_context(server)
            fault.section = {"type": "redis", "url": server.url, **RECOVERY}
            fault.inject, fault.clear = server.stop, server.start
    except DiskFaultUnavailable as exc:
        pytest.skip(f"{request.param}: {exc}")
    try:
        yield fault
    finally:
        fault.close()
