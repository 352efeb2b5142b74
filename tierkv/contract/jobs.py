"""What a tier job carries in and what it reports back.

A job moves the blocks named by `keys` between a tier and the primary slots named by
`slots` (same order). Partial success is normal: a `JobResult` names exactly which
keys made it and which did not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from tierkv.contract.keys import OffloadKey


@dataclass(frozen=True)
class ReqContext:
    """Who a lookup or job is for: the request id, its tenant, and free-form tags.

    `tenant` names who the request serves (an API key's customer, a LoRA adapter):
    None is the default tenant (`tierkv.contract.tenants.DEFAULT_TENANT` in reports).
    It is a name that may show in metrics and logs, never a secret: an engine's cache
    salt becomes a tenant through `tierkv.contract.tenants.salt_tenant` (a digest).
    The cache counts per tenant (`TieredCache.stats().tenants`); tiers may use it for
    tracing, priorities or their own accounting.
    """

    request_id: str | None = None
    tags: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    tenant: str | None = None


@dataclass(frozen=True)
class JobMetadata:
    """One batched tier job: move `keys[i]` to or from primary slot `slots[i]`."""

    job_id: int
    keys: tuple[OffloadKey, ...]
    slots: tuple[int, ...]
    ctx: ReqContext = field(default_factory=ReqContext)

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", tuple(self.keys))
        object.__setattr__(self, "slots", tuple(self.slots))
        if len(self.keys) != len(self.slots):
            raise ValueError(
                f"job {self.job_id}: {len(self.keys)} keys but {len(self.slots)} slots"
            )
        if len(set(self.keys)) != len(self.keys):
            raise ValueError(f"job {self.job_id}: a key appears twice")
        if set(map(type, self.keys)) - {bytes}:  # one C pass for plain bytes keys
            for key in self.keys:
                if not isinstance(key, bytes):
                    raise ValueError(f"job {self.job_id}: keys must be bytes, got {key!r}")


@dataclass(frozen=True)
class JobResult:
    """The one answer of a job. `ok_keys` and `failed_keys` split the job's keys."""

    job_id: int
    ok_keys: tuple[OffloadKey, ...] = ()
    failed_keys: tuple[OffloadKey, ...] = ()
    error: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "ok_keys", tuple(self.ok_keys))
        object.__setattr__(self, "failed_keys", tuple(self.failed_keys))
        if not (self.ok_keys and self.failed_keys):  # the common case: nothing to cross
            return
        overlap = set(self.ok_keys).intersection(self.failed_keys)
        if overlap:
            raise ValueError(f"job {self.job_id}: keys both ok and failed: {sorted(overlap)!r}")

    @property
    def ok(self) -> bool:
        """True when no key failed."""
        return not self.failed_keys

    @classmethod
    def success(cls, job: JobMetadata) -> JobResult:
        return cls(job.job_id, ok_keys=job.keys)

    @classmethod
    def failure(cls, job: JobMetadata, error: str) -> JobResult:
        return cls(job.job_id, failed_keys=job.keys, error=error)

    @classmethod
    def partial(
        cls,
        job: JobMetadata,
        failed: Mapping[OffloadKey, str] | Sequence[OffloadKey],
        error: str | None = None,
    ) -> JobResult:
        """A result where `failed` keys failed and every other key of `job` is ok.

        With a mapping of key to reason, the reasons are joined into `error`.
        Nothing failed costs no pass over the keys (a tier answers a job of hundreds
        of blocks this way, on the event loop).
        """
        if not failed:
            return cls(job.job_id, ok_keys=job.keys)
        failed_set = set(failed)
        unknown = failed_set - set(job.keys)
        if unknown:
            raise ValueError(f"job {job.job_id}: failed keys not in the job: {sorted(unknown)!r}")
        if error is None and isinstance(failed, Mapping) and failed:
            reasons = sorted(set(failed.values()))
            error = "; ".join(reasons[:5]) + (
                f"; and {len(reasons) - 5} more" if len(reasons) > 5 else ""
            )
        return cls(
            job.job_id,
            ok_keys=tuple(k for k in job.keys if k not in failed_set),
            failed_keys=tuple(k for k in job.keys if k in failed_set),
            error=error if failed_set else None,
        )
