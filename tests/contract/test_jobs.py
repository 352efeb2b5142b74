"""Job metadata and results: every key accounted for exactly once."""

from __future__ import annotations

import pytest

from tierkv.contract.jobs import JobMetadata, JobResult, ReqContext

K1, K2, K3 = b"k1\0\0\0\0", b"k2\0\0\0\0", b"k3\0\0\0\0"


def test_job_pairs_keys_with_slots() -> None:
    job = JobMetadata(7, [K1, K2], [3, 4], ReqContext("req-1"))  # type: ignore[arg-type]
    assert job.keys == (K1, K2) and job.slots == (3, 4) and job.ctx.request_id == "req-1"


@pytest.mark.parametrize(
    ("keys", "slots", "message"),
    [
        ((K1, K2), (1,), "2 keys but 1 slots"),
        ((K1, K1), (1, 2), "a key appears twice"),
        (("text",), (1,), "keys must be bytes"),
    ],
)
def test_bad_jobs_are_rejected(
    keys: tuple[object, ...], slots: tuple[int, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        JobMetadata(1, keys, slots)  # type: ignore[arg-type]


def test_result_constructors() -> None:
    job = JobMetadata(1, (K1, K2, K3), (0, 1, 2))
    assert JobResult.success(job) == JobResult(1, (K1, K2, K3), (), None)
    assert JobResult.success(job).ok
    failure = JobResult.failure(job, "tier down")
    assert failure.failed_keys == (K1, K2, K3) and failure.error == "tier down" and not failure.ok
    partial = JobResult.partial(job, {K2: "checksum mismatch", K3: "not found"})
    assert partial.ok_keys == (K1,) and partial.failed_keys == (K2, K3)
    assert partial.error == "checksum mismatch; not found"
    assert JobResult.partial(job, []).error is None


def test_result_rejects_overlap_and_foreign_keys() -> None:
    with pytest.raises(ValueError, match="both ok and failed"):
        JobResult(1, (K1,), (K1,))
    job = JobMetadata(1, (K1,), (0,))
    with pytest.raises(ValueError, match="not in the job"):
        JobResult.partial(job, [K2])
