"""`GuardedTier`: one secondary tier as the cache and every engine adapter drive it.

Whatever a tier does (raises, hangs, answers for the wrong keys, goes down and comes
back), the driver turns it into a well-formed answer, so nothing above it has to
distrust the tier again. One owner per rule:

- **The job deadline** belongs to the tier's runner (`tierkv.contract.runner.run_job` fails the
  keys it has not finished by `job_timeout` and keeps the rest). The driver only
  backstops it at `job_timeout` plus a grace (`checks.backstop_after`): a tier still
  silent then broke the contract; its whole job fails and `deadline_breaches` counts it.
- **Two circuit breakers** (`tierkv.health`), one for reads (lookups, loads) and one
  for writes (stores): failures open one, a probe closes it; while one is open the
  tier is a miss for its side and its jobs are refused as `not_serving`. A tier that
  cannot write (a full disk, a read-only directory) keeps serving what it holds
  (`serving`: `read_only`). Every call that goes to the tier takes its permit here
  and reports here (`admit`/`run`/`withdraw`, `lookup`); `usable` only asks, so no
  caller can take a half-open probe that no call then reports on.
- **The in-flight budget** (`max_inflight_bytes`): stores past it are refused as
  `max_inflight` (`admit`/`release`), so a slow tier is skipped, not queued behind.
- **Answer checks** (`checks.checked_result`): every key exactly once; a block the
  tier removed while its store ran is not reported held.
- **Life**: `open` (a required tier that fails raises; an optional one is reopened by
  `keep_opening`), `close`.
- **Statistics** (`TierStats`), read by `TieredCache.stats()` and the adapters' metrics.

Every method runs on the event loop that runs the tier, except `admit`, `release` and
the state queries, which any thread may call (an engine refuses a job at once, on its
own thread); an adapter whose engine calls from its own threads crosses to that loop
for the rest (vLLM: `LoopThread`) and only translates. Nothing but cancellation raises
out of `run_job`, `lookup` and `touch`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import anyio

from tierkv.contract.errors import TierUnavailable
from tierkv.contract.jobs import JobMetadata, JobResult, ReqContext
from tierkv.contract.keys import OffloadKey
from tierkv.contract.slab import PrimaryView
from tierkv.contract.tier import NO_ROOM, SecondaryTierManager, TierConfig
from tierkv.driver.checks import backstop_after, checked_flags, checked_result, without_removed
from tierkv.health import BreakerState, CircuitBreaker, worst
from tierkv.quotas.book import tenant_name
from tierkv.quotas.config import TierQuotas
from tierkv.quotas.tiers import TierQuotaGate
from tierkv.registry import create_tier
from tierkv.stats import TierStats

__all__ = ["Failure", "GuardedTier", "JobKind", "JobOutcome", "Refusal", "Serving"]

logger = logging.getLogger(__name__)

JobKind = Literal["store", "load"]
Refusal = Literal["not_serving", "max_inflight"]
"""Why `admit` kept a job from the tier: it is not open or its breaker is open; its
stores in flight would pass `max_inflight_bytes`."""
Failure = Literal["keys_failed", "timeout", "error", "refused"]
"""Why a job failed keys: the tier reported them failed (late keys included); it gave
no answer by the backstop; it raised; or it was never sent (`run` without `admit`
found the tier not serving that side: nothing about its keys is known)."""
MAX_ABANDONED_LOOKUPS = 4
MAX_ABANDONED_JOBS = 4
"""Loads and stores a tier may have stuck past their backstop (each holding its
slots, and maybe a worker thread) before it is sent no more until one returns."""
"""Lookups a tier may have stuck past their timeout before it is not asked again
until one of them returns (each may hold a worker thread of the tier's)."""
_LATE = object()  # `_ask`'s answer when the tier did not answer by the timeout
_SIDES: tuple[tuple[JobKind, str], ...] = (("load", "reads"), ("store", "writes"))
Serving = Literal["read_write", "read_only", "write_only", "none"]
"""Which sides of a tier its breakers let through now (`GuardedTier.serving`)."""


@dataclass(frozen=True)
class JobOutcome:
    """A job's checked result and, when some key failed, why (`Failure`)."""

    result: JobResult
    failure: Failure | None = None
    declined: tuple[OffloadKey, ...] = ()
    """Keys of a store a tenant quota kept out of the tier (failed in `result` too,
    never sent, not held against the tier's health: `tierkv.quotas.tiers`)."""
    abandoned: AbandonedJob | None = None
    """Set when the caller asked to `abandon` a job stuck past its backstop: the job
    failed whole, and still runs in the tier, touching its slots until `ended`."""


class AbandonedJob:
    """A load or store the caller stopped waiting for, still running in the tier. Its
    slots are the tier's until it ends: a load may still write them, a store read
    them. The caller keeps them from every other use until `wait` returns."""

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self._task = task

    @property
    def ended(self) -> bool:
        return self._task.done()

    async def wait(self) -> None:
        """Return once the job has ended (its result is dropped)."""
        if not self._task.done():
            await asyncio.wait((self._task,))

    def on_end(self, fn: Callable[[], None]) -> None:
        """Call `fn()` on the event loop once the job has ended (soon, if it has)."""
        self._task.add_done_callback(lambda _task: fn())


class GuardedTier:
    """One secondary tier of a chain, guarded (see the module docstring)."""

    def __init__(
        self,
        tier: SecondaryTierManager,
        *,
        index: int = 0,
        name: str | None = None,
        on_removed: Callable[[GuardedTier, tuple[OffloadKey, ...]], None] | None = None,
    ) -> None:
        self.tier = tier
        self.config: TierConfig = tier.config
        self.index = index
        self.name = name or tier.name
        # a monotonic clock any thread may read: `admit` runs on engines' threads. A
        # probe out longer than the slowest call it can be (a job's backstop, twice)
        # was leaked by a caller: the breaker then lets another through
        lease = 2 * max(backstop_after(self.config.job_timeout), self.config.recovery_after)
        self.breakers: dict[JobKind, CircuitBreaker] = {
            kind: CircuitBreaker(
                f"tier {self.name} ({side})",
                self.config.failure_threshold,
                self.config.recovery_after,
                time.monotonic,
                probe_lease=lease,
            )
            for kind, side in _SIDES
        }
        self.stats = TierStats()
        self.block_bytes = tier.primary.block_bytes
        self.opened = False
        self.open_error: str | None = None  # why the last open failed (optional tiers)
        self.closed = False
        self._on_removed = on_removed
        # the breaker and the in-flight bytes: `admit` and `release` may come from
        # an engine's thread while the loop thread records results
        self._lock = threading.Lock()
        # keys the tier reported removed while a store job runs, per running job
        self._removed_during: dict[int, set[OffloadKey]] = {}
        self._abandoned: set[asyncio.Task[Any]] = set()
        # loads and stores left running past their backstop (`run`'s `abandon`)
        self._stuck: dict[JobKind, set[asyncio.Task[Any]]] = {"load": set(), "store": set()}
        self.quotas: TierQuotaGate | None = None  # tenant quotas (`set_quotas`)
        tier.set_removal_listener(self._removed)

    def set_quotas(self, quotas: TierQuotas | None) -> None:
        """Hold the tier's stores to per-tenant `quotas` (`tierkv.quotas.tiers`), or
        none. Every store job then runs through the quota's plan, whoever sends it
        (the cache's cascades, an engine adapter's stores)."""
        self.quotas = (
            None
            if quotas is None
            else TierQuotaGate(self.tier, quotas, self.block_bytes, name=self.name)
        )

    @classmethod
    def create(
        cls,
        config: TierConfig,
        primary: PrimaryView,
        *,
        index: int = 0,
        name: str | None = None,
        on_removed: Callable[[GuardedTier, tuple[OffloadKey, ...]], None] | None = None,
    ) -> GuardedTier:
        """The registered tier type of `config`, built over `primary` and guarded."""
        return cls(create_tier(config, primary), index=index, name=name, on_removed=on_removed)

    # -- what callers ask ---------------------------------------------------------------
    @property
    def bit(self) -> int:
        """This tier's bit in the cache's per-key `held` masks."""
        return 1 << self.index

    @property
    def policy(self) -> str:
        return self.config.write_policy

    def breaker(self, kind: JobKind) -> CircuitBreaker:
        """The breaker of one side: reads (`load`: lookups and loads) or writes
        (`store`)."""
        return self.breakers[kind]

    def usable(self, kind: JobKind) -> bool:
        """Open, and its `kind` side would let a call through now (a half-open probe
        not yet out counts). Only asks: the call itself takes the permit (`admit`,
        `run`, `lookup`), and may still be refused if another took the probe first."""
        return self.opened and self.breakers[kind].may_allow()

    def healthy(self, kind: JobKind) -> bool:
        """Open and its `kind` breaker closed; asks for no probe. A half-open side is
        still proving itself (its one probe may hang): write-back must not count on it."""
        return self.opened and self.breakers[kind].state is BreakerState.CLOSED

    @property
    def state(self) -> str:
        """The worse of the two breakers' states (`closed`, `half_open`, `open`), or
        `not_open` when the tier is not open: what `stats().tiers[name]["breaker"]`
        and the `tierkv_breaker_state` metric show."""
        if not self.opened:
            return "not_open"
        return worst(*(b.state for b in self.breakers.values())).value

    @property
    def serving(self) -> Serving:
        """Which sides serve now: `read_write`; `read_only` (stores fail: a full or
        read-only disk, and what it holds is still served); `write_only`; `none`."""
        if not self.opened:
            return "none"
        reads = self.breakers["load"].state is not BreakerState.OPEN
        writes = self.breakers["store"].state is not BreakerState.OPEN
        if reads:
            return "read_write" if writes else "read_only"
        return "write_only" if writes else "none"

    def refresh_stats(self) -> TierStats:
        """Copy the breakers' states into `stats` (for a snapshot) and return it."""
        stats = self.stats
        stats.breaker = self.state
        stats.read_breaker = self.breakers["load"].state.value if self.opened else "not_open"
        stats.write_breaker = self.breakers["store"].state.value if self.opened else "not_open"
        stats.serving = self.serving
        stats.lost_probes = sum(b.lost_probes for b in self.breakers.values())
        stats.data_path = self.tier.data_path
        return stats

    def admit(self, kind: JobKind, keys: int, nbytes: int) -> Refusal | None:
        """Whether a job of `keys` blocks (`nbytes`) may go to the tier now: None, and a
        store's bytes count as in flight until `release`; or why not (counted).
        Admitted, the job takes its side's permit (the probe, while half-open): pass
        it to `run(..., admitted=True)`, or give it back with `withdraw`."""
        stats = self.stats
        breaker = self.breakers[kind]
        with self._lock:
            if not (self.opened and breaker.allow()):
                stats.skipped_unhealthy += keys
                return "not_serving"
            if kind == "load":
                return None
            in_flight = stats.inflight_bytes
            if in_flight and in_flight + nbytes > self.config.max_inflight_bytes:
                breaker.abandon()  # a half-open probe taken above is not spent
                stats.drops += keys
                return "max_inflight"
            stats.inflight_bytes += nbytes
            return None

    def release(self, kind: JobKind, nbytes: int) -> None:
        """An admitted job ended (whatever its result)."""
        if kind == "store":
            with self._lock:
                self.stats.inflight_bytes -= nbytes

    def withdraw(self, kind: JobKind, nbytes: int) -> None:
        """An admitted job will not run after all (it could not be built or handed
        over): its bytes are released and a half-open probe `admit` took is given
        back, so the next job can probe."""
        self.release(kind, nbytes)
        self._record(kind, None)

    def _record(self, kind: JobKind, ok: bool | None) -> None:
        """Tell `kind`'s breaker: success, failure, or None (the call was abandoned)."""
        breaker = self.breakers[kind]
        with self._lock:
            if ok is None:
                breaker.abandon()
            elif ok:
                breaker.record_success()
            else:
                breaker.record_failure()

    # -- jobs ----------------------------------------------------------------------------
    async def run_job(
        self, kind: JobKind, job: JobMetadata, *, admitted: bool = False
    ) -> JobResult:
        """Run one job; every key of the result reported exactly once. Never raises
        (except cancellation)."""
        return (await self.run(kind, job, admitted=admitted)).result

    async def run(
        self, kind: JobKind, job: JobMetadata, *, admitted: bool = False, abandon: bool = False
    ) -> JobOutcome:
        """`run_job`, with why keys failed (for an adapter's metrics). `admitted`:
        the caller took the job's permit with `admit`; otherwise the job takes it here,
        and a tier whose `kind` side is not serving fails the job at once, unsent
        (`refused`, counted in `skipped_unhealthy`). A store on a tier with quotas
        first makes its tenant's room, and what has none is `declined`.

        `abandon`: a job with no answer by its backstop is left running in the tier
        (on asyncio) instead of waited for, its keys failed, and the outcome's
        `abandoned` says when it ends: the caller must keep the job's slots from any
        other use until then (a load may still write them). Only a caller that owns
        its slots may ask (the cache's promotions and cascades); an engine's pages
        are the engine's, so an adapter waits. While MAX_ABANDONED_JOBS of a side
        are out, that side is sent no job asking to abandon (`refused`)."""
        if abandon and len(self._stuck[kind]) >= MAX_ABANDONED_JOBS:
            self.stats.skipped_unhealthy += len(job.keys)
            error = (
                f"tier {self.name}: {MAX_ABANDONED_JOBS} {kind} jobs are stuck in it past "
                "their deadline; no more are sent until one returns"
            )
            return JobOutcome(JobResult.failure(job, error), "refused")
        gate = self.quotas
        if kind != "store" or gate is None or not job.keys:
            return await self._run(kind, job, admitted, abandon)
        tenant = job.ctx.tenant
        pending = -(-self.stats.inflight_bytes // self.block_bytes)
        if admitted:  # the job's own bytes are in flight already
            pending -= len(job.keys)
        plan = gate.plan(job.keys, tenant, max(0, pending))
        stored: Sequence[OffloadKey] = ()
        try:  # the plan's blocks are pending until settled here, whatever happens
            if plan.victims:
                await self._remove_for_quota(plan.victims)
            if not plan.declined:
                outcome = await self._run(kind, job, admitted, abandon)
                stored = outcome.result.ok_keys
                return outcome
            gate.book.note_declined(tenant_name(tenant), len(plan.declined))
            reason = (
                f"tenant {tenant_name(tenant)!r} holds its quota of tier {self.name} "
                "(tenants.quotas) and none of its own blocks there can give way"
            )
            declined = tuple(plan.declined)
            out = set(declined)
            keep = [i for i, key in enumerate(job.keys) if key not in out]
            if not keep:  # nothing to send: the tier is not asked, its health not judged
                return JobOutcome(JobResult.failure(job, reason), "keys_failed", declined)
            sent = replace(
                job, keys=tuple(job.keys[i] for i in keep), slots=tuple(job.slots[i] for i in keep)
            )
            outcome = await self._run(kind, sent, admitted, abandon)
            stored = outcome.result.ok_keys
            failed = dict.fromkeys(outcome.result.failed_keys, outcome.result.error or "failed")
            failed.update(dict.fromkeys(declined, reason))
            result = JobResult.partial(job, failed)
            failure = outcome.failure or "keys_failed"
            return JobOutcome(result, failure, declined, outcome.abandoned)
        finally:
            gate.stored(tenant, plan, stored)

    async def _remove_for_quota(self, victims: list[OffloadKey]) -> None:
        """Remove the blocks a quota chose to make room (so the tier's own eviction,
        which knows no tenants, has nothing to take), and report them gone. A tier
        that fails to remove them evicts in its own order instead."""
        try:
            await self.tier.remove(victims)
        except anyio.get_cancelled_exc_class():
            self.tier.report_removed(victims)  # memory and nvme drop them before awaiting
            raise
        except Exception as exc:
            logger.warning(
                "tier %s: removing %d blocks for a tenant quota failed (%s); the tier "
                "evicts in its own order",
                self.name,
                len(victims),
                exc,
            )
            if self.quotas is not None:
                self.quotas.unmark(victims)
            return
        self.tier.report_removed(victims)

    async def _run(
        self, kind: JobKind, job: JobMetadata, admitted: bool, abandon: bool = False
    ) -> JobOutcome:
        """`run` without quotas."""
        stats = self.stats
        if not admitted:
            with self._lock:
                allowed = self.opened and self.breakers[kind].allow()
            if not allowed:
                stats.skipped_unhealthy += len(job.keys)
                error = f"tier {self.name} is not serving {kind}s now (breaker open or not open)"
                return JobOutcome(JobResult.failure(job, error), "refused")
        started = anyio.current_time()
        stats.inflight_jobs += 1
        if kind == "store":
            self._removed_during[job.job_id] = set()
        try:
            outcome = await self._call(kind, job, abandon)
        finally:
            stats.inflight_jobs -= 1
            removed = self._removed_during.pop(job.job_id, None)
        result = outcome.result
        elapsed = anyio.current_time() - started
        if not job.keys:
            self._record(kind, None)  # asked nothing: proves nothing either way
        elif self._failed_whole(kind, job, outcome, elapsed):
            stats.errors += 1
            self._record(kind, False)
        else:
            self._record(kind, True)
        if removed:
            result = without_removed(job, result, removed, self.name)
            failure = outcome.failure or ("keys_failed" if result.failed_keys else None)
            outcome = JobOutcome(result, failure, outcome.declined, outcome.abandoned)
        self._count(kind, result, elapsed)
        return outcome

    async def _call(self, kind: JobKind, job: JobMetadata, abandon: bool = False) -> JobOutcome:
        op = self.tier.store if kind == "store" else self.tier.load
        limit = backstop_after(self.config.job_timeout)
        answer: object = None
        if abandon:
            try:
                loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            except RuntimeError:  # not asyncio: waited for, as without `abandon`
                loop = None
            if loop is not None:
                scope = anyio.CancelScope()

                async def in_scope() -> object:
                    with scope:
                        return await op(job)
                    return None  # cancelled through the scope: the caller raises

                task = loop.create_task(in_scope())
                return await self._call_abandoning(kind, job, task, scope, limit)
        try:
            # the backstop's own scope: a TimeoutError the tier raises is its error
            with anyio.move_on_after(limit) as backstop:
                answer = await op(job)
        except anyio.get_cancelled_exc_class():
            self._record(kind, None)
            raise
        except Exception as exc:
            error = f"tier {self.name}: {kind} failed: {type(exc).__name__}: {exc}"
            return JobOutcome(JobResult.failure(job, error), "error")
        if backstop.cancelled_caught:
            return JobOutcome(self._breach(kind, job, limit), "timeout")
        result = checked_result(job, answer, self.name)
        return JobOutcome(result, "keys_failed" if result.failed_keys else None)

    async def _call_abandoning(
        self,
        kind: JobKind,
        job: JobMetadata,
        task: asyncio.Task[Any],
        scope: anyio.CancelScope,
        limit: float,
    ) -> JobOutcome:
        """`_call` with the tier's job as a task of its own, left running at the
        backstop (`run`'s `abandon`). A cancelled caller cancels the job and waits for
        it, as without `abandon`: its slots must be free of it when the caller ends.
        The job is cancelled through its anyio `scope`, never `task.cancel()`: a native
        cancel goes through the shields a tier keeps around a thread call (an nvme
        chunk), so the task would end with its thread still writing slots."""
        try:
            done, _ = await asyncio.wait((task,), timeout=limit)
        except BaseException:
            scope.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait((task,))
            self._record(kind, None)
            raise
        if not done:
            self._abandon_job(kind, task)
            return JobOutcome(
                self._breach(kind, job, limit), "timeout", abandoned=AbandonedJob(task)
            )
        try:
            answer = task.result()
        except (Exception, asyncio.CancelledError) as exc:
            error = f"tier {self.name}: {kind} failed: {type(exc).__name__}: {exc}"
            return JobOutcome(JobResult.failure(job, error), "error")
        result = checked_result(job, answer, self.name)
        return JobOutcome(result, "keys_failed" if result.failed_keys else None)

    def _abandon_job(self, kind: JobKind, task: asyncio.Task[Any]) -> None:
        """Leave a stuck load or store running: count it, hold its side back while
        MAX_ABANDONED_JOBS are out, drop what it answers. It is never cancelled: a
        cancelled task may end while a worker thread it started still writes its
        slots, and its end is what gives the slots back."""
        self.stats.abandoned_jobs += 1
        stuck = self._stuck[kind]
        stuck.add(task)

        def ended(done: asyncio.Task[Any]) -> None:
            stuck.discard(done)
            if not done.cancelled():
                done.exception()  # retrieved: a late error is not logged as unhandled

        task.add_done_callback(ended)
        if len(stuck) == MAX_ABANDONED_JOBS:
            logger.warning(
                "tier %s: %d %s jobs stuck past their deadline; none is sent until one "
                "returns (their slots stay held meanwhile)",
                self.name,
                MAX_ABANDONED_JOBS,
                kind,
            )

    def _breach(self, kind: JobKind, job: JobMetadata, limit: float) -> JobResult:
        """The tier gave no answer by the backstop: its job fails whole."""
        self.stats.deadline_breaches += 1
        timeout = self.config.job_timeout
        logger.warning(
            "tier %s broke its deadline: a %s job of %d keys gave no answer within "
            "job_timeout=%gs and %gs of grace; all its keys failed (a tier reports the "
            "keys it has not finished by job_timeout itself: tierkv.tier.run_job does)",
            self.name,
            kind,
            len(job.keys),
            timeout,
            limit - timeout,
        )
        return JobResult.failure(
            job, f"tier {self.name}: {kind} timed out after {limit:g}s (job_timeout={timeout:g}s)"
        )

    def _failed_whole(
        self, kind: JobKind, job: JobMetadata, outcome: JobOutcome, elapsed: float
    ) -> bool:
        """Whether the job counts against the tier's health: it raised or broke its
        deadline; a store that stored nothing and said why (unless only that the tier
        is full of blocks it may not evict); or a job that ran to its deadline and
        moved nothing. A job that moved part of its keys is progress."""
        result = outcome.result
        if outcome.failure in ("timeout", "error"):
            return True
        if not job.keys or result.ok_keys:
            return False
        if kind == "store" and result.error:
            # a tier that can store nothing is down, raised or not; one that refused
            # for room (`NO_ROOM`, first of the job's sorted reasons) is full, not down
            return not result.error.startswith(NO_ROOM)
        return elapsed >= self.config.job_timeout

    def _count(self, kind: JobKind, result: JobResult, elapsed: float) -> None:
        stats = self.stats
        stats.job_latency.add(elapsed)
        moved = len(result.ok_keys) * self.block_bytes
        if kind == "store":
            stats.store_jobs += 1
            stats.blocks_stored += len(result.ok_keys)
            stats.bytes_in += moved
        else:
            stats.load_jobs += 1
            stats.blocks_loaded += len(result.ok_keys)
            stats.bytes_out += moved
        stats.failed_keys += len(result.failed_keys)
        if result.failed_keys and result.error:
            logger.debug("tier %s %s job: %s", self.name, kind, result.error)

    # -- lookups and hints -------------------------------------------------------------
    async def lookup(
        self,
        keys: Sequence[OffloadKey],
        ctx: ReqContext,
        timeout: float | None,
        on_answer: Callable[[list[bool]], None] | None = None,
    ) -> list[bool] | None:
        """The tier's answer, one flag per key; None when it is unusable, slow (past
        `timeout`) or broken. `on_answer(flags)` runs the moment the tier answers in
        time, before anything else runs on the loop: where a caller claims the hits
        (a cascade's eviction must not come between the answer and the claim).

        `timeout` bounds the answer whatever the tier does: a tier stuck in a blocking
        client call (a dead Mooncake master takes 4-5 s to fail each call; cancelling
        a worker thread waits for it) is left behind at `timeout`, still running, its
        late answer dropped and counted (`abandoned_lookups`). A lookup touches no slot, so
        nothing is at risk. While MAX_ABANDONED_LOOKUPS of them are still out, the
        tier is not asked again (counted `skipped_unhealthy`) until one returns."""
        stats = self.stats
        if len(self._abandoned) >= MAX_ABANDONED_LOOKUPS:
            stats.skipped_unhealthy += 1
            return None
        if self.admit("load", 1, 0) is not None:  # down or breaker open: counted skipped
            return None
        started = anyio.current_time()
        stats.lookups += 1
        stats.lookup_keys += len(keys)
        flags: list[bool] | None = None
        try:
            answer = await self._ask(keys, ctx, timeout, on_answer)
            if answer is not _LATE:
                flags = answer
        except anyio.get_cancelled_exc_class():
            self._record("load", None)
            raise
        except Exception as exc:
            logger.warning("tier %s lookup failed: %s: %s", self.name, type(exc).__name__, exc)
            stats.errors += 1
            self._record("load", False)
            return None
        if flags is None:  # past `timeout`
            stats.lookup_timeouts += 1
            stats.errors += 1
            self._record("load", False)
            return None
        self._record("load", True)
        stats.lookup_latency.add(anyio.current_time() - started)
        return flags

    async def _ask(
        self,
        keys: Sequence[OffloadKey],
        ctx: ReqContext,
        timeout: float | None,
        on_answer: Callable[[list[bool]], None] | None,
    ) -> Any:
        """The tier's checked flags by `timeout`, or `_LATE`. On asyncio the lookup runs
        as a task of its own, so neither the timeout nor the caller's cancellation
        waits for it: a task still running then is left to end on its own
        (`_abandon`), and its answer reaches no one. A tier that answers from memory
        (`lookup_answers_from_memory`), or another event loop, is awaited under the
        timeout directly (one loop step less)."""
        left = False  # the caller stopped waiting: a late answer claims nothing

        async def asked() -> list[bool]:
            flags = checked_flags(await self.tier.lookup(keys, ctx), keys)
            if on_answer is not None and not left:
                on_answer(flags)  # in the tier's answer's own step
            return flags

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not asyncio: a cancel scope (which waits for threads)
            loop = None
        if loop is None or self.tier.lookup_answers_from_memory:
            with anyio.move_on_after(timeout):  # nothing to wait for but the tier's index
                return await asked()
            return _LATE
        task = loop.create_task(asked())
        try:
            done, _ = await asyncio.wait((task,), timeout=timeout)
        except BaseException:
            left = True
            if not task.done():
                self._abandon(task)
            raise
        if not done:
            left = True
            self._abandon(task)
            return _LATE
        return task.result()

    def _abandon(self, task: asyncio.Task[Any]) -> None:
        """Leave a lookup the caller stopped waiting for: count it, let it run to its
        end (so `abandoned_now` counts lookups really still in the tier), drop what it
        answers; cancelled only if still running a job backstop later (a coroutine
        that would wait for ever)."""
        self.stats.abandoned_lookups += 1
        self._abandoned.add(task)
        later = asyncio.get_running_loop().call_later(
            backstop_after(self.config.job_timeout), task.cancel
        )

        def ended(done: asyncio.Task[Any]) -> None:
            self._abandoned.discard(done)
            later.cancel()
            if not done.cancelled():
                done.exception()  # retrieved: a late error is not logged as unhandled

        task.add_done_callback(ended)
        if len(self._abandoned) == MAX_ABANDONED_LOOKUPS:
            logger.warning(
                "tier %s: %d lookups are stuck in the tier past lookup_timeout; it is not "
                "asked again until one returns",
                self.name,
                MAX_ABANDONED_LOOKUPS,
            )

    @property
    def abandoned_now(self) -> int:
        """Lookups left behind at their timeout that have not ended yet."""
        return len(self._abandoned)

    async def touch(self, keys: Sequence[OffloadKey], timeout: float | None) -> bool:
        """Forward reuse to the tier's eviction order; a hint, so a failure is only
        logged. True when the tier took it. Not sent to a tier whose breaker is not
        closed (a hung tier would gather a touch per scheduler step)."""
        if not self.healthy("load"):
            return False
        try:
            with anyio.fail_after(timeout):
                await self.tier.touch(keys)
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:
            logger.debug("tier %s: touch failed: %s", self.name, exc)
            return False
        return True

    # -- claims (who holds which: `tierkv.driver.claims.ClaimLedger`) ---------------------
    @property
    def claim_lease(self) -> float:
        """Seconds a claim on this tier lasts; 0 when it takes none (the tier does not
        protect claims, or `claim_lease: 0`)."""
        return float(self.config.claim_lease) if self.tier.protects_claims else 0.0

    def protect(self, keys: Sequence[OffloadKey], lease: float) -> bool:
        """Claim `keys`, which the tier just reported held. Whatever the breaker says
        (the tier answered); a tier that raises is logged, its keys unclaimed: a claim
        keeps a hit, it is never an error. True when the tier took them."""
        if not keys or self.closed:
            return False
        try:
            self.tier.protect(keys, lease)
        except Exception as exc:
            logger.warning("tier %s: protect failed: %s: %s", self.name, type(exc).__name__, exc)
            return False
        self.stats.protected += len(keys)
        self.stats.claims_held += len(keys)
        return True

    def unprotect(self, keys: Sequence[OffloadKey], *, expired: bool = False) -> None:
        """Claims on `keys` end: let go (whatever the breaker says: bookkeeping, no
        I/O), or, `expired`, counted as lease-expired (the tier drops them itself)."""
        self.stats.claims_held -= len(keys)
        if expired:
            self.stats.lease_expired += len(keys)
            return
        try:
            self.tier.unprotect(keys)
        except Exception as exc:  # its lease still bounds the claim
            logger.warning("tier %s: unprotect failed: %s: %s", self.name, type(exc).__name__, exc)

    # -- removals ------------------------------------------------------------------------
    def _removed(self, keys: tuple[OffloadKey, ...]) -> None:
        """The tier's `report_removed`: stores running now must not count these keys;
        then the owner forgets them."""
        for removed in self._removed_during.values():
            removed.update(keys)
        if self.quotas is not None:
            self.quotas.removed(keys)
        if self._on_removed is not None:
            self._on_removed(self, keys)

    # -- life ----------------------------------------------------------------------------
    async def open(self) -> bool:
        """Open the tier. A required tier that fails raises `TierUnavailable` (the
        tier's error chained); an optional one is logged and returns False (serve
        without it; `keep_opening` retries)."""
        self.closed = False
        try:
            await self.tier.open()
        except Exception as exc:
            message = f"tier {self.name!r} failed to open: {type(exc).__name__}: {exc}"
            self.open_error = f"{type(exc).__name__}: {exc}"
            if self.config.required:
                raise TierUnavailable(message) from exc
            logger.error(
                "%s; running without it and retrying every %gs",
                message,
                self.config.recovery_after,
            )
            return False
        self.opened = True
        self.open_error = None
        return True

    async def keep_opening(self) -> None:
        """Retry opening every `recovery_after` until it works or `close` is called."""
        while not self.opened and not self.closed:
            await anyio.sleep(max(self.config.recovery_after, 0.01))
            if self.closed:
                return
            try:
                await self.tier.open()
            except Exception as exc:
                logger.debug("tier %s still fails to open: %s", self.name, exc)
                continue
            self.opened = True
            self.open_error = None
            logger.warning("tier %s opened; it is used from now on", self.name)

    async def close(self, timeout: float | None = None) -> None:
        """Close the tier if it is open (bounded by `timeout`); errors are logged."""
        self.closed = True
        if not self.opened:
            return
        self.opened = False
        try:
            with anyio.move_on_after(timeout):
                await self.tier.close()
        except Exception:
            logger.exception("tier %s failed to close", self.name)
