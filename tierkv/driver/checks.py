"""What the driver holds a tier's answers to, as plain functions of the job and the
answer (no state, no I/O), so every engine adapter gets the same verdicts."""

from __future__ import annotations

from collections.abc import Sequence

from tierkv.contract.jobs import JobMetadata, JobResult
from tierkv.contract.keys import OffloadKey

BACKSTOP_GRACE_SHARE = 0.5
"""The backstop's grace as a share of `job_timeout`, bounded by the two below."""
BACKSTOP_GRACE_MIN = 0.25
BACKSTOP_GRACE_MAX = 5.0


def backstop_after(job_timeout: float) -> float:
    """Seconds after which the driver stops waiting for a tier's job: `job_timeout`
    plus a grace.

    The deadline itself belongs to the tier's runner (`tierkv.contract.runner.run_job`), which
    fails the keys it has not finished by then and keeps the rest. The grace leaves it
    room to cancel its batches and let its threads return (a block's I/O: milliseconds);
    a tier still silent after that broke the contract and loses the whole job."""
    grace = min(max(job_timeout * BACKSTOP_GRACE_SHARE, BACKSTOP_GRACE_MIN), BACKSTOP_GRACE_MAX)
    return job_timeout + grace


def checked_result(job: JobMetadata, result: object, tier_name: str) -> JobResult:
    """Hold a tier to 'every key of the job exactly once'; a key it did not report ok
    (forgot, named twice, or never asked for) failed."""
    if not isinstance(result, JobResult) or result.job_id != job.job_id:
        return JobResult.failure(job, f"tier {tier_name} returned a result for another job")
    if not result.failed_keys and result.ok_keys == job.keys:  # the usual: one C pass
        return result
    keys = set(job.keys)
    ok = list(dict.fromkeys(k for k in result.ok_keys if k in keys))  # once each
    if len(ok) == len(job.keys) == len(result.ok_keys) and not result.failed_keys:
        return result
    ok_set, reported = set(ok), set(result.failed_keys)
    failed = [k for k in job.keys if k not in ok_set]
    error = result.error
    if error is None and failed:
        unreported = any(k not in reported for k in failed)
        error = f"tier {tier_name} " + (
            "did not report every key" if unreported else "failed keys without a reason"
        )
    return JobResult(job.job_id, tuple(k for k in job.keys if k in ok_set), tuple(failed), error)


def without_removed(
    job: JobMetadata, result: JobResult, removed: set[OffloadKey], tier_name: str
) -> JobResult:
    """`result` with the keys the tier reported removed while the store ran moved to
    failed: a block evicted before its own store was answered is not held, whatever
    the answer says."""
    if not removed or removed.isdisjoint(result.ok_keys):
        return result
    return JobResult(
        job.job_id,
        tuple(k for k in result.ok_keys if k not in removed),
        (*result.failed_keys, *(k for k in result.ok_keys if k in removed)),
        result.error or f"tier {tier_name} removed a block before its store was answered",
    )


def checked_flags(flags: Sequence[object], keys: Sequence[OffloadKey]) -> list[bool]:
    """A lookup answer as one bool per key; a wrong count is the tier's bug."""
    answer = [bool(f) for f in flags]
    if len(answer) != len(keys):
        raise RuntimeError(f"answered {len(answer)} flags for {len(keys)} keys")
    return answer
