"""Guarded tier calls: every call to a tier goes through its `TierHandle`, which adds
a deadline, the circuit breaker and the statistics, and turns whatever the tier does
(raises, hangs, answers for the wrong keys) into a well-formed answer. Nothing a tier
does raises past this module, except cancellation."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import anyio

from tierkv.contract.jobs import JobMetadata, JobResult, ReqContext
from tierkv.contract.keys import OffloadKey
from tierkv.contract.tier import SecondaryTierManager, TierConfig
from tierkv.health import CircuitBreaker
from tierkv.stats import TierStats

logger = logging.getLogger(__name__)


@dataclass
class TierHandle:
    """One secondary tier of the chain as the cache drives it."""

    index: int
    name: str
    tier: SecondaryTierManager
    config: TierConfig
    breaker: CircuitBreaker
    stats: TierStats
    opened: bool = False
    # keys the tier reported removed while a store job runs, per running job: a key
    # evicted before its own store was answered is not held, whatever the answer says
    _removed_during: dict[int, set[OffloadKey]] = field(default_factory=dict)

    @property
    def bit(self) -> int:
        return 1 << self.index

    @property
    def policy(self) -> str:
        return self.config.write_policy

    def note_removed(self, keys: Sequence[OffloadKey]) -> None:
        """The tier reported `keys` removed: running store jobs must not count them."""
        for removed in self._removed_during.values():
            removed.update(keys)

    def usable(self) -> bool:
        """Open and its breaker lets a request through (a half-open probe counts)."""
        return self.opened and self.breaker.allow()

    def healthy(self) -> bool:
        """Open and its breaker closed; asks for no probe. A half-open tier is still
        proving itself (its one probe may hang): write-back must not count on it."""
        return self.opened and self.breaker.state.value == "closed"

    async def run_job(
        self, kind: Literal["store", "load"], job: JobMetadata, block_bytes: int
    ) -> JobResult:
        """Run one job under `job_timeout`; never raises (except cancellation)."""
        stats = self.stats
        started = anyio.current_time()
        stats.inflight_jobs += 1
        healthy = True
        if kind == "store":
            self._removed_during[job.job_id] = set()
        try:
            with anyio.fail_after(self.config.job_timeout):
                op = self.tier.store if kind == "store" else self.tier.load
                result = await op(job)
            result = self._sanitize(job, result)
        except TimeoutError:
            healthy = False
            result = JobResult.failure(
                job, f"tier {self.name}: {kind} timed out after {self.config.job_timeout:g}s"
            )
        except anyio.get_cancelled_exc_class():
            self.breaker.abandon()
            raise
        except Exception as exc:
            healthy = False
            result = JobResult.failure(
                job, f"tier {self.name}: {kind} failed: {type(exc).__name__}: {exc}"
            )
        finally:
            stats.inflight_jobs -= 1
            removed = self._removed_during.pop(job.job_id, None)
        if kind == "store" and job.keys and not result.ok_keys and result.error:
            healthy = False  # a tier that can store nothing is down, raised or not
        if healthy:
            self.breaker.record_success()
        else:
            stats.errors += 1
            self.breaker.record_failure()
        if removed and not removed.isdisjoint(result.ok_keys):
            result = JobResult(
                job.job_id,
                tuple(k for k in result.ok_keys if k not in removed),
                (*result.failed_keys, *(k for k in result.ok_keys if k in removed)),
                result.error or f"tier {self.name} removed a block before its store was answered",
            )
        stats.job_latency.add(anyio.current_time() - started)
        moved = len(result.ok_keys) * block_bytes
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
        return result

    def _sanitize(self, job: JobMetadata, result: JobResult) -> JobResult:
        """Hold a tier to 'every key exactly once'; anything it forgot failed."""
        if not isinstance(result, JobResult) or result.job_id != job.job_id:
            return JobResult.failure(job, f"tier {self.name} returned a result for another job")
        keys = set(job.keys)
        ok = list(dict.fromkeys(k for k in result.ok_keys if k in keys))  # once each
        if len(ok) == len(job.keys) == len(result.ok_keys) and not result.failed_keys:
            return result
        ok_set = set(ok)
        failed = [k for k in job.keys if k not in ok_set]
        error = result.error or (f"tier {self.name} did not report every key" if failed else None)
        return JobResult(
            job.job_id, tuple(k for k in job.keys if k in ok_set), tuple(failed), error
        )

    async def lookup(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, timeout: float | None
    ) -> list[bool] | None:
        """The tier's answer, or None when it is unhealthy, slow or broken."""
        stats = self.stats
        if not self.usable():
            stats.skipped_unhealthy += 1
            return None
        started = anyio.current_time()
        stats.lookups += 1
        stats.lookup_keys += len(keys)
        try:
            with anyio.fail_after(timeout):
                flags = list(await self.tier.lookup(keys, ctx))
            if len(flags) != len(keys):
                raise RuntimeError(f"answered {len(flags)} flags for {len(keys)} keys")
        except TimeoutError:
            stats.lookup_timeouts += 1
            stats.errors += 1
            self.breaker.record_failure()
            return None
        except anyio.get_cancelled_exc_class():
            self.breaker.abandon()
            raise
        except Exception as exc:
            logger.warning("tier %s lookup failed: %s: %s", self.name, type(exc).__name__, exc)
            stats.errors += 1
            self.breaker.record_failure()
            return None
        self.breaker.record_success()
        stats.lookup_latency.add(anyio.current_time() - started)
        return flags
