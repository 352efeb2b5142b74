"""`TierkvSecondaryTier`: any tierkv tier as one of vLLM's secondary KV-offload tiers.

vLLM (0.33, `vllm.v1.kv_offload.tiering`) keeps its CPU primary (a shared-memory
slab of chunk rows) and its GPU worker; its `TieringOffloadingManager` calls a
secondary tier synchronously from the scheduler, under its lock, and expects every
call to return at once. This class is that tier. It wraps vLLM's slab in a tierkv
`PrimaryView` (zero-copy: a tier reads and writes the rows in place), drives the
tierkv tier through the shared guarded-tier driver (`tierkv.driver.GuardedTier`: its
breaker, in-flight budget, answer checks, deadline backstop, reopen) on one event-loop
thread of its own, and turns the outcomes into vLLM's `JobResult`s, each job reported
exactly once: done, failed, past its `job_timeout`, refused (tier down, too many bytes
in flight) or cut off by shutdown. It only translates and crosses threads.

Lookups are batched per scheduler step (`lookups.LookupBook`): RETRY while the tier
is being asked, then the answer, which a failed load or a removal reported by the
tier turns into a MISS so a block that cannot be read is not promoted again. A hit
is claimed in the tier the moment it answers (`tierkv.driver.claims`: a tier that
evicts by itself keeps it until the request's load has read it, the request ends, or
`claim_lease` runs out), so a store cascade in between cannot evict what the lookup
promised. Reuse vLLM reports (`touch`) is forwarded to the tier once per step; `get_stats`
adds what only the tier knows to vLLM's metrics (`metrics.py`); `drain_jobs` is
bounded by `drain_timeout`. Each request's tenant (its `cache_salt` or LoRA name, as
`tenant_from` says: `tenants.py`) rides on its lookups and jobs (`ReqContext.tenant`),
and the entry's `quotas` hold each store job to its tenant's share of the tier (the
driver's `set_quotas`; a job's keys a quota declined fail with reason `quota`).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Collection, Iterable, Sequence
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

from tierkv.contract.jobs import JobMetadata, JobResult, ReqContext
from tierkv.contract.keys import OffloadKey
from tierkv.contract.slab import PrimaryView
from tierkv.contract.tier import SecondaryTierManager
from tierkv.driver import GuardedTier, JobKind
from tierkv.driver.claims import ClaimLedger
from tierkv.driver.engine_jobs import EngineJobs
from tierkv.driver.loop_thread import LoopThread
from tierkv.integrations.vllm import metrics
from tierkv.integrations.vllm.lookups import LookupBook
from tierkv.integrations.vllm.settings import geometry_of, index_of, resolve_entry
from tierkv.integrations.vllm.tenants import install_hook, tenant_of

logger = logging.getLogger(__name__)

_HIT, _MISS, _RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
MAX_TOUCHED = 1 << 16
"""Keys of reuse kept for one step's `touch` at most (beyond, the rest is dropped:
recency is a hint)."""


_VLLM_TAGS = MappingProxyType({"engine": "vllm"})
_REFUSALS = {
    "not_serving": "tierkv tier {} is not serving (not open, its breaker open, or shut down)",
    "max_inflight": "dropped: max_inflight_bytes already in flight to tierkv tier {}",
}
"""Messages of the jobs `_submit` refuses, by `Refusal`."""

_OpenJob = tuple[JobKind, int, tuple[OffloadKey, ...], bool]
"""What the adapter keeps of a job until it is reported: its kind, its bytes, its keys
and whether the driver admitted it (its bytes then count in flight until it ends)."""


def _error_of(result: JobResult | None) -> str | None:
    return result.error if result is not None else None


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
        index = index_of(offloading_spec, entry)
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
        self._drain_timeout = resolved.drain_seconds
        # labelled as vLLM labels this tier in its own metrics, so the two join
        self._metrics = metrics.TierMetrics(f"{'?' if index is None else index + 1}:{tier_type}")
        self._touched: list[OffloadKey] = []
        self._tenant_from = resolved.tenant_from
        # request id -> its tenant, for requests that have one (lookups name only ids)
        self._tenants: dict[str, str] = {}
        if self._tenant_from != "none" and not install_hook():
            logger.warning(
                "tierkv tier %s: this vLLM does not build offloading contexts where tierkv "
                "can read a request's %s; every request counts as the default tenant",
                resolved.name,
                self._tenant_from,
            )
        self._row_bytes = row_bytes
        self._view: PrimaryView | None = PrimaryView(primary_kv_view, row_bytes, self.namespace)
        self._driver: GuardedTier | None = GuardedTier.create(
            resolved.tier,
            self._view,
            index=index or 0,
            name=self._name,
            on_removed=self._on_removed,
        )
        # each tenant held to its share of the tier (`tierkv.quotas.tiers`): every store
        # job, whoever's request it cascades, runs inside its tenant's quota
        self._driver.set_quotas(resolved.quotas)
        self._removal_expected = bool(type(self._driver.tier).reports_evictions)
        self._lookups = LookupBook()
        # a hit the tier reported stays in it until its load (tierkv.driver.claims):
        # request id -> the owners its lookup rounds claimed under; on the loop thread
        self._claims = ClaimLedger({self._driver.index: self._driver})
        self._claim_owners: dict[str, list[str]] = {}
        self._claim_rounds = itertools.count()
        self._events: list[OffloadingEvent] | None = (
            [] if offloading_spec.kv_events_config.enable_kv_cache_events else None
        )

        self._finished: list[VllmJobResult] = []
        self._closed = False
        self._loop = LoopThread(f"tierkv-vllm-{self._name}")
        # job id -> (kind, bytes, keys, admitted by the driver); its lock also guards
        # the finished results and the events
        self._jobs: EngineJobs[_OpenJob] = EngineJobs(self._loop, self._name)
        self._lock = self._jobs.lock
        self._open(self._driver, resolved.tier.required)
        logger.info("tierkv tier %s under vLLM, namespace %r", self._name, self.namespace)

    def _open(self, driver: GuardedTier, required: bool) -> None:
        """Open the tier on the loop thread. A required tier that fails (or hangs past
        a minute) raises; an optional one serves as a miss and reopens in the
        background every `recovery_after`."""
        try:
            self._loop.run(driver.open(), timeout=max(60.0, self._timeout))
        except Exception as exc:
            if required:
                self._loop.stop()
                raise
            logger.warning("tierkv tier %s did not open (%s); it serves as a miss", self._name, exc)
        if not driver.opened:
            self._loop.spawn(driver.keep_opening)

    # -- what tests and logs look at ---------------------------------------------------
    @property
    def driver(self) -> GuardedTier:
        """The guarded tier this adapter drives: `admit` runs on vLLM's scheduler
        thread, everything else on the loop thread."""
        assert self._driver is not None, "the tier was shut down"
        return self._driver

    @property
    def tierkv_tier(self) -> SecondaryTierManager:
        """The tierkv tier this adapter drives (its methods run on the loop thread)."""
        return self.driver.tier

    @property
    def loop(self) -> LoopThread:
        return self._loop

    def _breaker_open(self) -> bool:
        """The tier failed and waits out `recovery_after`: a miss without asking."""
        driver = self._driver
        return driver is not None and driver.breaker("load").state.value == "open"

    @property
    def _up(self) -> bool:
        return self._driver is not None and self._driver.opened

    def describe(self) -> dict[str, Any]:
        tier = self._driver.tier.describe() if self._driver is not None else {}
        return {"namespace": self.namespace, "up": self._up, **tier}

    # -- vLLM's secondary-tier interface ---------------------------------------------
    def on_new_request(self, req_context: VllmReqContext) -> RequestOffloadingContext:
        tenant = tenant_of(req_context, self._tenant_from)
        if tenant is not None:
            self._tenants[req_context.req_id] = tenant
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: VllmReqContext) -> LookupResult:
        if self._closed or not self._up or self._breaker_open():
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
        in_flight = self._driver.stats.inflight_bytes if self._driver is not None else 0
        return self._metrics.take(up=self._up and not self._closed, store_bytes_in_flight=in_flight)

    def on_request_finished(self, req_context: VllmReqContext) -> None:
        self._lookups.release(req_context.req_id)
        request_id = req_context.req_id
        self._tenants.pop(request_id, None)
        if not self._closed and self._loop.is_alive():

            async def end_claims() -> None:
                self._let_go(request_id)

            self._loop.spawn(end_claims)

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_load=True)

    def get_finished_jobs(self) -> Iterable[VllmJobResult]:
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def has_pending_work(self) -> bool:
        return self._jobs.pending()

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
        self._jobs.drain(self._drain_timeout, self._shutdown_grace, self._fail)

    def _fail(self, job_id: int, error: str) -> None:
        self._finish(job_id, None, error, reason="error")

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
        self._jobs.wait(self._shutdown_grace)
        try:
            if self._loop.is_alive():
                self._loop.run(self._close(), timeout=self._shutdown_grace + 30.0)
            else:
                logger.warning("tierkv tier %s: its loop thread is gone; not closed", self._name)
        except Exception:
            logger.exception("tierkv tier %s did not close cleanly", self._name)
        finally:
            self._loop.stop()
            for job_id in self._jobs.open_ids():
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
        view, self._view, self._driver = self._view, None, None
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
        """On the scheduler thread: refuse at once what cannot run (a malformed job,
        the tier down or its breaker open, stores in flight past `max_inflight_bytes`,
        the loop thread gone), or hand the job to the loop thread."""
        kind: JobKind = "load" if is_load else "store"
        keys = tuple(job.keys)
        nbytes = len(keys) * self._row_bytes
        try:  # built first: a job that cannot run never takes the breaker's probe
            ctx = ReqContext(
                request_id=job.req_context.req_id,
                tags=_VLLM_TAGS,
                tenant=self._tenant(job.req_context),
            )
            tk_job = JobMetadata(job.job_id, keys, tuple(job.chunk_ids.tolist()), ctx)
        except (ValueError, TypeError) as exc:
            self._jobs.add(job.job_id, (kind, nbytes, keys, False))
            self._finish(job.job_id, None, f"malformed job: {exc}", reason="error")
            return
        driver = self._driver
        serving = not self._closed and driver is not None and self._loop.is_alive()
        refused = driver.admit(kind, len(keys), nbytes) if serving and driver else "not_serving"
        self._jobs.add(job.job_id, (kind, nbytes, keys, refused is None))
        if refused is not None:
            self._finish(job.job_id, None, _REFUSALS[refused].format(self._name), reason=refused)
            return
        try:
            self._loop.spawn(lambda: self._run(tk_job, kind))
        except RuntimeError as exc:  # the loop closed meanwhile: the job never ran
            self._jobs.add(job.job_id, (kind, nbytes, keys, False))  # released here:
            assert driver is not None
            driver.withdraw(kind, nbytes)
            self._finish(job.job_id, None, f"the tier's event loop is gone: {exc}", reason="error")

    async def _run(self, job: JobMetadata, kind: JobKind) -> None:
        """One tier job on the loop thread; reports its outcome whatever happens."""
        driver = self._driver
        started = time.monotonic()
        result: JobResult | None = None
        error: str | None = None
        reason = "error"
        try:
            assert driver is not None
            with self._jobs.cancellable(job.job_id) as scope:
                try:
                    outcome = await driver.run(kind, job, admitted=True)
                finally:
                    if kind == "load":  # read, failed or cancelled: its claims are done
                        self._let_go(job.ctx.request_id, job.keys)
                result = outcome.result
                if outcome.failure in ("timeout", "error"):
                    error, reason = result.error, outcome.failure
                elif outcome.declined and set(result.failed_keys) <= set(outcome.declined):
                    reason = "quota"  # the tenant's quota kept them out: not a tier fault
            if scope.cancelled_caught:
                error, reason = "cancelled: drain_jobs waited past drain_timeout", "shutdown"
        finally:
            # also on cancellation (shutdown): report, then let the cancel go on
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
        with self._jobs.ending(job_id) as opened:
            if opened is None:
                return
            kind, nbytes, keys, admitted = opened
            if admitted and self._driver is not None:
                self._driver.release(kind, nbytes)
            ok = set(result.ok_keys) & set(keys) if result is not None else set()
            failed = [k for k in keys if k not in ok]
            label = reason if error or reason == "quota" else "keys_failed"
            self._metrics.job_failed(kind, len(failed), label)
            if error or failed:
                why = error or _error_of(result)
                logger.debug(
                    "tierkv tier %s: %s job %d: %d of %d keys failed: %s",
                    self._name,
                    kind,
                    job_id,
                    len(failed),
                    len(keys),
                    why,
                )
            # facts first, so the lookup that follows the result already knows them
            if kind == "load" and failed:
                self._lookups.load_failed(failed)
            if kind == "store" and ok:
                self._lookups.learn_stored(ok)
            report = VllmJobResult(
                job_id=job_id,
                success=not failed,
                successful_keys=tuple(k for k in keys if k in ok)
                if kind == "load" and failed and ok
                else None,
                transfer_time=elapsed,
                transfer_bytes=len(ok) * self._row_bytes if ok else None,
            )
            with self._lock:
                if self._events is not None and kind == "store" and ok:  # the job's order
                    self._events.append(self._event([k for k in keys if k in ok], removed=False))
                self._finished.append(report)

    # -- lookups and tier life on the loop thread --------------------------------------
    async def _ask(self, batch: dict[str, list[tuple[OffloadKey, object]]]) -> None:
        async def one(request_id: str, pairs: list[tuple[OffloadKey, object]]) -> None:
            keys = [k for k, _ in pairs]
            found = None
            driver = self._driver
            if driver is not None:
                ctx = ReqContext(request_id=request_id, tenant=self._tenants.get(request_id))

                def claim(flags: list[bool]) -> None:  # as the tier answers: nothing
                    self._claim(driver, request_id, keys, flags)  # evicted yet

                found = await driver.lookup(keys, ctx, self._timeout, claim)
            if found is None:  # down, slow or broken: a miss (the driver logged why)
                found = [False] * len(keys)
                self._metrics.count(metrics.LOOKUP_ERRORS, len(keys))
            self._metrics.count(metrics.LOOKUP_KEYS, len(keys))
            self._metrics.count(metrics.LOOKUP_HITS, sum(found))
            self._lookups.deliver((k, token, f) for (k, token), f in zip(pairs, found))

        async with anyio.create_task_group() as group:
            for request_id, pairs in batch.items():
                group.start_soon(one, request_id, pairs)

    def _tenant(self, req_context: VllmReqContext) -> str | None:
        """The request's tenant: noted when it arrived, else read from its context (a
        store vLLM submits after the request finished)."""
        tenant = self._tenants.get(req_context.req_id)
        return tenant if tenant is not None else tenant_of(req_context, self._tenant_from)

    def _claim(
        self, driver: GuardedTier, request_id: str, keys: list[OffloadKey], found: list[bool]
    ) -> None:
        """Claim the hits of one lookup round in the tier, under an owner of their own
        (a request's rounds ask about different keys, and each keeps its claims)."""
        hits = [k for k, f in zip(keys, found) if f]
        taken = self._claims.take(driver, hits) if hits else None
        if taken is None:  # no hit, or a tier that takes no claims
            return
        owner = f"{request_id}#{next(self._claim_rounds)}"
        self._claims.keep(owner, [taken], dict.fromkeys(hits, driver.index))
        self._claim_owners.setdefault(request_id, []).append(owner)

    def _let_go(self, request_id: str | None, keys: Sequence[OffloadKey] | None = None) -> None:
        """End `request_id`'s claims on `keys` (every claim when None): its load is
        over, or the request is. A claim whose lease ran out is only counted."""
        owners = self._claim_owners.get(request_id) if request_id is not None else None
        if not owners:
            return
        for owner in owners:
            self._claims.let_go(owner, keys)
        if keys is None or not any(self._claims.held(owner) for owner in owners):
            del self._claim_owners[request_id]  # type: ignore[arg-type]

    def _on_removed(self, driver: GuardedTier, keys: tuple[OffloadKey, ...]) -> None:
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
        if self._driver is not None and await self._driver.touch(keys, self._timeout):
            self._metrics.count(metrics.TOUCHED_BLOCKS, len(keys))

    async def _close(self) -> None:
        await self._loop.cancel_spawned()
        self._claims.let_go_all()
        self._claim_owners.clear()
        if self._driver is not None:
            await self._driver.close(timeout=30.0)
