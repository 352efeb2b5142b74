"""`TierkvSecondaryTier`: any tierkv tier as one of vLLM's secondary KV-offload tiers.

vLLM (0.33, `vllm.v1.kv_offload.tiering`) keeps its CPU primary (a shared-memory
slab of chunk rows) and its GPU worker; its `TieringOffloadingManager` calls a
secondary tier synchronously from the scheduler, under its lock, and expects every
call to return at once. This class is that tier. It wraps vLLM's slab in a tierkv
`PrimaryView` (zero-copy: a tier reads and writes the rows in place), runs the tierkv
tier's coroutines on one event-loop thread of its own, and turns their outcomes into
vLLM's `JobResult`s, each job reported exactly once: done, failed, past its
`job_timeout`, refused (tier down, too many bytes in flight) or cut off by shutdown.

Lookups are batched per scheduler step (`lookups.LookupBook`): RETRY while the tier
is being asked, then the answer, which a failed load or a removal reported by the
tier turns into a MISS so a block that cannot be read is not promoted again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from types import MappingProxyType
from typing import Any

import anyio
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.base import ReqContext as VllmReqContext
from vllm.v1.kv_offload.tiering.base import JobResult as VllmJobResult
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager as VllmSecondaryTier
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tierkv.errors import TierUnavailable
from tierkv.integrations.vllm.lookups import LookupBook
from tierkv.integrations.vllm.loop import LoopThread
from tierkv.integrations.vllm.settings import VllmGeometry, resolve_entry
from tierkv.jobs import JobMetadata, JobResult, ReqContext
from tierkv.keys import OffloadKey
from tierkv.registry import get_tier_class
from tierkv.slab import PrimaryView
from tierkv.tier import SecondaryTierManager

logger = logging.getLogger(__name__)

_HIT, _MISS, _RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY


def geometry_of(offloading_spec: Any, row_bytes: int) -> VllmGeometry:
    """What vLLM's normalized `OffloadingConfig` says about the bytes of a chunk."""
    config = offloading_spec.config
    parallel = {
        k: v
        for k, v in asdict(config.parallel).items()
        # per-process facts: DP replicas and ranks of one layout share blocks
        if k not in ("rank", "data_parallel_index", "data_parallel_rank_local")
    }
    layout = {
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "replicated_layout": config.replicated_layout,
        "canonical_layout": config.canonical_layout,
        "kv_cache_layout": config.kv_cache_layout,
        "sliding_windows": [g.sliding_window_size_in_chunks for g in config.groups],
    }
    return VllmGeometry(
        model=str(config.model.name),
        dtype=str(config.model.dtype),
        tokens_per_block=tuple(int(g.tokens_per_block) for g in config.groups),
        blocks_per_chunk=int(config.cache.blocks_per_chunk),
        tokens_per_hash=int(config.cache.tokens_per_hash),
        row_bytes=row_bytes,
        parallel=parallel,
        layout=layout,
    )


def _where(offloading_spec: Any, entry: Mapping[str, Any]) -> str:
    """`secondary_tiers[i]` for the entry vLLM built us from (for error paths)."""
    configs = getattr(offloading_spec, "secondary_tier_configs", None) or []
    for i, config in enumerate(configs):
        if isinstance(config, Mapping) and all(
            config.get(k) is v or config.get(k) == v for k, v in entry.items()
        ):
            return f"secondary_tiers[{i}]"
    return "secondary_tiers[?]"


class TierkvSecondaryTier(VllmSecondaryTier):  # type: ignore[misc]
    """A tierkv tier plugin (nvme, redis, s3, memory, any third-party type) serving
    vLLM's tiering manager. Built by vLLM's `SecondaryTierFactory` from a
    `{"type": "tierkv", "tier": {...}}` entry; see `settings.resolve_entry`."""

    medium: Medium = Medium.STORAGE  # per instance: see __init__

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        **entry: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self._shutdown_grace = float(entry.pop("shutdown_grace", 10.0))
        row_bytes = self.block_size_bytes
        resolved = resolve_entry(
            entry, geometry_of(offloading_spec, row_bytes), where=_where(offloading_spec, entry)
        )
        self.namespace = resolved.namespace
        # per instance: one class serves every tier type (memory and redis are CPU)
        self.medium = Medium(resolved.medium)
        self.locality = Locality(resolved.locality) if resolved.locality else None
        self.cache_hit_source = (
            CacheHitSource.HOST if self.medium is Medium.CPU else CacheHitSource.DISK
        )
        self._name = resolved.name
        self._timeout = float(resolved.tier.job_timeout)
        self._max_inflight = int(resolved.tier.max_inflight_bytes)
        self._row_bytes = row_bytes
        self._view: PrimaryView | None = PrimaryView(primary_kv_view, row_bytes, self.namespace)
        tier_cls = get_tier_class(resolved.tier.type)
        self._tier: SecondaryTierManager | None = tier_cls(resolved.tier, self._view)
        self._lookups = LookupBook()
        self._tier.set_removal_listener(self._on_removed)
        self._events: list[OffloadingEvent] | None = (
            [] if offloading_spec.kv_events_config.enable_kv_cache_events else None
        )
        self._removed_inbox: list[tuple[OffloadKey, ...]] = []

        # job bookkeeping shared by the scheduler thread and the loop thread
        self._lock = threading.Condition()
        self._open_jobs: dict[int, tuple[bool, int, tuple[OffloadKey, ...]]] = {}
        self._store_bytes = 0
        self._finished: list[VllmJobResult] = []
        self._closed = False
        self._up = False

        self._loop = LoopThread(f"tierkv-vllm-{self._name}")
        try:
            self._loop.run(self._tier.open(), timeout=max(60.0, self._timeout))
            self._up = True
        except Exception as exc:
            if resolved.tier.required:
                self._loop.stop()
                raise
            logger.warning(
                "tierkv tier %s did not open (%s); it serves as a miss and retries every "
                "%.1fs (required: false)",
                self._name,
                exc,
                float(resolved.tier.recovery_after),
            )
            self._loop.spawn(lambda: self._reopen(float(resolved.tier.recovery_after)))
        logger.info("tierkv tier %s under vLLM, namespace %r", self._name, self.namespace)

    # -- what tests and logs look at ---------------------------------------------------
    @property
    def tierkv_tier(self) -> SecondaryTierManager:
        """The tierkv tier this adapter drives (its methods run on the loop thread)."""
        assert self._tier is not None, "the tier was shut down"
        return self._tier

    @property
    def loop(self) -> LoopThread:
        return self._loop

    def describe(self) -> dict[str, Any]:
        tier = self._tier.describe() if self._tier is not None else {}
        return {"namespace": self.namespace, "up": self._up, **tier}

    # -- vLLM's secondary-tier interface ---------------------------------------------
    def on_new_request(self, req_context: VllmReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: VllmReqContext) -> LookupResult:
        if self._closed or not self._up:
            return _MISS
        answer = self._lookups.answer(key, req_context.req_id)
        return _RETRY if answer is None else (_HIT if answer else _MISS)

    def on_schedule_end(self, context: Any) -> None:
        batch = self._lookups.take_batch()
        if batch and not self._closed:
            self._loop.spawn(lambda: self._ask(batch))

    def on_request_finished(self, req_context: VllmReqContext) -> None:
        self._lookups.release(req_context.req_id)

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_load=True)

    def get_finished_jobs(self) -> Iterable[VllmJobResult]:
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._open_jobs)

    def drain_jobs(self) -> None:
        """Wait until every submitted job has been reported (never aborts one)."""
        with self._lock:
            self._lock.wait_for(lambda: not self._open_jobs)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events is None:
            return ()
        with self._lock:
            events, self._events = self._events, []
        return events

    def shutdown(self) -> None:
        """Let jobs in flight finish for up to `shutdown_grace` seconds, cancel the
        rest (each reported failed), close the tier, stop the loop thread."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._lock.wait_for(lambda: not self._open_jobs, timeout=self._shutdown_grace)
        try:
            self._loop.run(self._close(), timeout=self._shutdown_grace + 30.0)
        except Exception:
            logger.exception("tierkv tier %s did not close cleanly", self._name)
        finally:
            self._loop.stop()
            for job_id in list(self._open_jobs):
                self._finish(job_id, None, "tierkv tier shut down before the job ended")
            self._release_slab()

    def _release_slab(self) -> None:
        """Let go of vLLM's slab explicitly (vLLM unmaps it right after): the view
        every tier object reads through is released, so nothing that outlives this
        adapter (a caller holding `tierkv_tier`, a worker thread left on a frozen
        socket, whose `SlotGuard` is closed) keeps the region mapped, and no cycle
        waits for the garbage collector."""
        view, self._view, self._tier = self._view, None, None
        if view is not None:
            try:
                view.release()
            except BufferError:
                logger.exception(
                    "tierkv tier %s: a buffer taken from vLLM's primary is still in use; "
                    "vLLM will keep the region mapped",
                    self._name,
                )

    # -- jobs ----------------------------------------------------------------------------
    def _submit(self, job: TransferJob, *, is_load: bool) -> None:
        keys = tuple(job.keys)
        nbytes = len(keys) * self._row_bytes
        with self._lock:
            self._open_jobs[job.job_id] = (is_load, nbytes, keys)
            if not is_load:
                self._store_bytes += nbytes
            too_much = not is_load and self._store_bytes > self._max_inflight
        if self._closed or not self._up:
            self._finish(job.job_id, None, f"tierkv tier {self._name} is not serving")
            return
        if too_much and nbytes < self._store_bytes:
            self._finish(job.job_id, None, "dropped: max_inflight_bytes already in flight")
            return
        try:
            ctx = ReqContext(
                request_id=job.req_context.req_id,
                tags=MappingProxyType({"engine": "vllm"}),
            )
            tk_job = JobMetadata(job.job_id, keys, tuple(job.chunk_ids.tolist()), ctx)
        except (ValueError, TypeError) as exc:
            self._finish(job.job_id, None, f"malformed job: {exc}")
            return
        self._loop.spawn(lambda: self._run(tk_job, is_load))

    async def _run(self, job: JobMetadata, is_load: bool) -> None:
        """One tier job on the loop thread; reports its outcome whatever happens."""
        tier = self._tier
        started = time.monotonic()
        result: JobResult | None = None
        error: str | None = None
        try:
            assert tier is not None
            with anyio.fail_after(self._timeout):
                result = await (tier.load(job) if is_load else tier.store(job))
        except TimeoutError:
            error = f"no result within job_timeout={self._timeout:g}s"
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        finally:
            # also on cancellation (shutdown): report, then let the cancel go on
            self._finish(job.job_id, result, error, time.monotonic() - started)

    def _finish(
        self,
        job_id: int,
        result: JobResult | None,
        error: str | None,
        elapsed: float | None = None,
    ) -> None:
        """Report `job_id` once: the first call wins, later ones do nothing."""
        with self._lock:
            opened = self._open_jobs.pop(job_id, None)
            if opened is None:
                return
            is_load, nbytes, keys = opened
            if not is_load:
                self._store_bytes -= nbytes
        ok = set(result.ok_keys) & set(keys) if result is not None else set()
        failed = [k for k in keys if k not in ok]
        if error or failed:
            logger.debug(
                "tierkv tier %s: %s job %d: %d of %d keys failed: %s",
                self._name,
                "load" if is_load else "store",
                job_id,
                len(failed),
                len(keys),
                error or (result.error if result is not None else None),
            )
        # facts first, so the lookup that follows the result already knows them
        if is_load and failed:
            self._lookups.forget(failed)
        if not is_load and ok:
            self._lookups.learn_stored(ok)
        successful = None
        if is_load and failed and ok:
            successful = tuple(k for k in keys if k in ok)
        report = VllmJobResult(
            job_id=job_id,
            success=not failed,
            successful_keys=successful,
            transfer_time=elapsed,
            transfer_bytes=len(ok) * self._row_bytes if ok else None,
        )
        with self._lock:
            if self._events is not None and not is_load and ok:  # in the job's order
                self._events.append(self._event([k for k in keys if k in ok], removed=False))
            self._finished.append(report)
            self._lock.notify_all()

    # -- lookups and tier life on the loop thread --------------------------------------
    async def _ask(self, batch: dict[str, list[tuple[OffloadKey, object]]]) -> None:
        async def one(request_id: str, pairs: list[tuple[OffloadKey, object]]) -> None:
            keys = [k for k, _ in pairs]
            try:
                assert self._tier is not None
                with anyio.fail_after(self._timeout):
                    found = await self._tier.lookup(keys, ReqContext(request_id=request_id))
                if len(found) != len(keys):
                    raise TierUnavailable(f"answered {len(found)} of {len(keys)} keys")
            except Exception as exc:
                logger.warning("tierkv tier %s lookup failed (a miss): %s", self._name, exc)
                found = [False] * len(keys)
            self._lookups.deliver((k, token, bool(f)) for (k, token), f in zip(pairs, found))

        async with anyio.create_task_group() as group:
            for request_id, pairs in batch.items():
                group.start_soon(one, request_id, pairs)

    def _on_removed(self, keys: tuple[OffloadKey, ...]) -> None:
        """The tier dropped these blocks on its own (eviction, expiry, a bad read)."""
        self._lookups.forget(keys)
        if self._events is not None:
            with self._lock:
                self._events.append(self._event(list(keys), removed=True))

    def _event(self, keys: list[OffloadKey], *, removed: bool) -> OffloadingEvent:
        return OffloadingEvent(
            keys=keys,
            medium=self.medium,
            removed=removed,
            locality=self.locality,
            ownership=self.tier_type,
        )

    async def _reopen(self, every: float) -> None:
        while not self._closed and not self._up:
            await anyio.sleep(every)
            try:
                assert self._tier is not None
                await self._tier.open()
                self._up = True
                logger.info("tierkv tier %s opened", self._name)
            except Exception as exc:
                logger.debug("tierkv tier %s still does not open: %s", self._name, exc)

    async def _close(self) -> None:
        await self._loop.cancel_spawned()
        if self._tier is not None and self._up:
            with anyio.move_on_after(30.0):
                await self._tier.close()
