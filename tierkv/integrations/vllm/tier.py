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
Reuse vLLM reports (`touch`) is forwarded to the tier once per step; `get_stats`
adds what only the tier knows to vLLM's metrics (`metrics.py`); `drain_jobs` is
bounded by `drain_timeout`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Iterable, Mapping
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

from tierkv.contract.errors import TierUnavailable
from tierkv.contract.jobs import JobMetadata, JobResult, ReqContext
from tierkv.contract.keys import OffloadKey
from tierkv.contract.slab import PrimaryView
from tierkv.contract.tier import SecondaryTierManager
from tierkv.integrations.vllm import metrics
from tierkv.integrations.vllm.lookups import LookupBook
from tierkv.integrations.vllm.loop import LoopThread
from tierkv.integrations.vllm.settings import geometry_of, resolve_entry
from tierkv.registry import get_tier_class

logger = logging.getLogger(__name__)

_HIT, _MISS, _RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
MAX_TOUCHED = 1 << 16
"""Keys of reuse kept for one step's `touch` at most (beyond, the rest is dropped:
recency is a hint)."""


def _index_of(offloading_spec: Any, entry: Mapping[str, Any]) -> int | None:
    """The position in `secondary_tiers` of the entry vLLM built us from."""
    configs = getattr(offloading_spec, "secondary_tier_configs", None) or []
    for i, config in enumerate(configs):
        if isinstance(config, Mapping) and all(
            config.get(k) is v or config.get(k) == v for k, v in entry.items()
        ):
            return i
    return None


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
        row_bytes = self.block_size_bytes
        index = _index_of(offloading_spec, entry)
        resolved = resolve_entry(
            entry,
            geometry_of(offloading_spec, row_bytes),
            where=f"secondary_tiers[{'?' if index is None else index}]",
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
        self._shutdown_grace = resolved.shutdown_grace
        self._drain_timeout = (
            self._timeout + self._shutdown_grace
            if resolved.drain_timeout is None
            else resolved.drain_timeout
        )
        # labelled as vLLM labels this tier in its own metrics, so the two join
        self._metrics = metrics.TierMetrics(f"{'?' if index is None else index + 1}:{tier_type}")
        self._touched: list[OffloadKey] = []
        self._max_inflight = int(resolved.tier.max_inflight_bytes)
        self._row_bytes = row_bytes
        self._view: PrimaryView | None = PrimaryView(primary_kv_view, row_bytes, self.namespace)
        tier_cls = get_tier_class(resolved.tier.type)
        self._tier: SecondaryTierManager | None = tier_cls(resolved.tier, self._view)
        self._removal_expected = bool(tier_cls.reports_evictions)
        self._lookups = LookupBook()
        self._tier.set_removal_listener(self._on_removed)
        self._events: list[OffloadingEvent] | None = (
            [] if offloading_spec.kv_events_config.enable_kv_cache_events else None
        )
        self._removed_inbox: list[tuple[OffloadKey, ...]] = []

        # job bookkeeping shared by the scheduler thread and the loop thread
        self._lock = threading.Condition()
        self._open_jobs: dict[int, tuple[bool, int, tuple[OffloadKey, ...]]] = {}
        self._scopes: dict[int, anyio.CancelScope] = {}  # running jobs (loop thread)
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
        if self._touched:
            touched, self._touched = tuple(dict.fromkeys(self._touched)), []
            if not self._closed and self._up:
                self._loop.spawn(lambda: self._touch(touched))

    def touch(self, keys: Collection[OffloadKey], req_context: VllmReqContext) -> None:
        """Reuse vLLM saw (served from the primary or promoted): the tier's eviction
        order learns it with the step's other touches, on the loop thread."""
        if not self._closed and len(self._touched) < MAX_TOUCHED:
            self._touched.extend(keys)

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        return dict(metrics.metric_definitions())

    def get_stats(self) -> Any:
        """What only the tier knows, since the last call (see `metrics.py`)."""
        with self._lock:
            in_flight = self._store_bytes
        return self._metrics.take(up=self._up and not self._closed, store_bytes_in_flight=in_flight)

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
        """Wait until every submitted job has been reported; bounded, because vLLM
        calls this under its manager lock (`reset_cache`): a stuck tier must not
        freeze the engine.

        Jobs get `drain_timeout` to finish. Those still running then are cancelled
        (a tier job may be: it leaves no partial block in the tier, and a cancelled
        load is reported failed, so vLLM never reads its slots) and get
        `shutdown_grace` to report. If the loop thread is gone, nothing can finish
        them: they are reported failed at once. A job that outlives even that (a
        thread stuck in the kernel) raises RuntimeError: returning while it may still
        write into the primary would corrupt it silently."""
        with self._lock:
            self._wait_for_jobs(self._drain_timeout)
            late = list(self._open_jobs)
        if not late:
            return
        logger.warning(
            "tierkv tier %s: %d jobs still running after drain_timeout=%gs; cancelling them",
            self._name,
            len(late),
            self._drain_timeout,
        )
        self._cancel_jobs(late)
        with self._lock:
            self._wait_for_jobs(self._shutdown_grace)
            stuck = list(self._open_jobs)
        if not stuck:
            return
        if not self._loop.is_alive():
            for job_id in stuck:
                self._finish(job_id, None, "the tier's event-loop thread is gone", reason="error")
            return
        raise RuntimeError(
            f"tierkv tier {self._name}: {len(stuck)} jobs did not end within "
            f"drain_timeout={self._drain_timeout:g}s + shutdown_grace="
            f"{self._shutdown_grace:g}s even when cancelled (I/O stuck in the kernel?); "
            "not returning while they may still write into vLLM's primary"
        )

    def _wait_for_jobs(self, timeout: float) -> None:
        """Under `_lock`: until no job is open, `timeout` passed or the loop died."""
        deadline = time.monotonic() + timeout
        while self._open_jobs and self._loop.is_alive():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._lock.wait(min(left, 0.05))

    def _cancel_jobs(self, job_ids: list[int]) -> None:
        def cancel() -> None:
            for job_id in job_ids:
                scope = self._scopes.get(job_id)
                if scope is not None:
                    scope.cancel()

        if self._loop.is_alive():
            self._loop.loop.call_soon_threadsafe(cancel)

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
            self._wait_for_jobs(self._shutdown_grace)
        try:
            if self._loop.is_alive():
                self._loop.run(self._close(), timeout=self._shutdown_grace + 30.0)
            else:
                logger.warning("tierkv tier %s: its loop thread is gone; not closed", self._name)
        except Exception:
            logger.exception("tierkv tier %s did not close cleanly", self._name)
        finally:
            self._loop.stop()
            for job_id in list(self._open_jobs):
                self._finish(
                    job_id, None, "tierkv tier shut down before the job ended", reason="shutdown"
                )
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
            self._finish(
                job.job_id, None, f"tierkv tier {self._name} is not serving", reason="not_serving"
            )
            return
        if too_much and nbytes < self._store_bytes:
            self._finish(
                job.job_id,
                None,
                "dropped: max_inflight_bytes already in flight",
                reason="max_inflight",
            )
            return
        try:
            ctx = ReqContext(
                request_id=job.req_context.req_id,
                tags=MappingProxyType({"engine": "vllm"}),
            )
            tk_job = JobMetadata(job.job_id, keys, tuple(job.chunk_ids.tolist()), ctx)
        except (ValueError, TypeError) as exc:
            self._finish(job.job_id, None, f"malformed job: {exc}", reason="error")
            return
        self._loop.spawn(lambda: self._run(tk_job, is_load))

    async def _run(self, job: JobMetadata, is_load: bool) -> None:
        """One tier job on the loop thread; reports its outcome whatever happens."""
        tier = self._tier
        started = time.monotonic()
        result: JobResult | None = None
        error: str | None = None
        reason = "error"
        scope = anyio.CancelScope()
        self._scopes[job.job_id] = scope
        try:
            assert tier is not None
            with scope, anyio.fail_after(self._timeout):
                result = await (tier.load(job) if is_load else tier.store(job))
            if scope.cancelled_caught:
                error, reason = "cancelled: drain_jobs waited past drain_timeout", "shutdown"
        except TimeoutError:
            error = f"no result within job_timeout={self._timeout:g}s"
            reason = "timeout"
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        finally:
            # also on cancellation (shutdown): report, then let the cancel go on
            self._scopes.pop(job.job_id, None)
            if result is None and error is None:
                error, reason = "cancelled by shutdown", "shutdown"
            self._finish(job.job_id, result, error, time.monotonic() - started, reason=reason)

    def _finish(
        self,
        job_id: int,
        result: JobResult | None,
        error: str | None,
        elapsed: float | None = None,
        *,
        reason: str = "error",
    ) -> None:
        """Report `job_id` once: the first call wins, later ones do nothing. `reason`
        labels a failure in the metrics (`metrics.FAILURE_REASONS`)."""
        with self._lock:
            opened = self._open_jobs.pop(job_id, None)
            if opened is None:
                return
            is_load, nbytes, keys = opened
            if not is_load:
                self._store_bytes -= nbytes
        ok = set(result.ok_keys) & set(keys) if result is not None else set()
        failed = [k for k in keys if k not in ok]
        if failed:
            op = "load" if is_load else "store"
            self._metrics.count(metrics.FAILED_JOBS, 1, op, reason if error else "keys_failed")
            self._metrics.count(metrics.FAILED_BLOCKS, len(failed), op)
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
            self._lookups.load_failed(failed)
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
                self._metrics.count(metrics.LOOKUP_ERRORS, len(keys))
            self._metrics.count(metrics.LOOKUP_KEYS, len(keys))
            self._metrics.count(metrics.LOOKUP_HITS, sum(map(bool, found)))
            self._lookups.deliver((k, token, bool(f)) for (k, token), f in zip(pairs, found))

        async with anyio.create_task_group() as group:
            for request_id, pairs in batch.items():
                group.start_soon(one, request_id, pairs)

    def _on_removed(self, keys: tuple[OffloadKey, ...]) -> None:
        """The tier dropped these blocks on its own (eviction, expiry, a bad read)."""
        self._lookups.forget(keys)
        self._metrics.count(metrics.REMOVED_BLOCKS, len(keys))
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
            # the tier reports every block it drops: subscribers may wait for it
            removal_expected=self._removal_expected and not removed,
        )

    async def _touch(self, keys: tuple[OffloadKey, ...]) -> None:
        try:
            assert self._tier is not None
            with anyio.fail_after(self._timeout):
                await self._tier.touch(keys)
        except Exception as exc:  # recency is a hint: never a failure
            logger.debug("tierkv tier %s: touch failed: %s", self._name, exc)
            return
        self._metrics.count(metrics.TOUCHED_BLOCKS, len(keys))

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
