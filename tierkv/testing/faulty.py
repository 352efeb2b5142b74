"""`FaultyTier`: the `memory` tier plus switches to make it slow, down, hung or lying,
for the cache's own tests and for demos of failure handling."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Sequence

import anyio
from pydantic import Field

from tierkv.contract.errors import TierUnavailable
from tierkv.contract.jobs import JobMetadata, JobResult, ReqContext
from tierkv.contract.keys import OffloadKey
from tierkv.contract.runner import Batch, run_job
from tierkv.contract.slab import PrimaryView
from tierkv.contract.tier import TierConfig
from tierkv.contract.units import Duration
from tierkv.memory_tier import MemoryTier, MemoryTierConfig


class FaultyTierConfig(MemoryTierConfig):
    delay: Duration = Field(default=0.0, description="added to every store and load job")
    lookup_delay: Duration = Field(default=0.0, description="added to every lookup")
    stall_after_keys: int | None = Field(
        default=None,
        ge=0,
        description="a store or load job moves this many keys, then stalls on the next "
        "one; it runs key by key under `run_job` and its job_timeout, as a well-behaved "
        "tier does, so the stalled keys fail as late and the moved ones are kept",
    )


class FaultyTier(MemoryTier):
    """The `memory` tier plus switches to make it slow, down, hung or lying.

    Register it with `tierkv.register_tier(FaultyTier)` and use `type: faulty`.
    Switches (set on the instance, e.g. `cache.tier("faulty").down = True`):
    `down` (every call raises TierUnavailable), `fail_jobs` (the next N jobs raise),
    `hang` (jobs wait until `hang` is cleared... or forever), `gate` (jobs wait for this
    event), `lie_about` (lookup claims these keys; their loads fail), `full` (stores
    fail every key as a full disk does, lookups and loads still served), `stuck` (a
    `threading.Event`: jobs block in a worker thread until it is set, as in a client
    library that ignores cancellation; a load then writes 0xEE over its slots before
    answering, as a late write would). `calls` logs (operation, keys) of every call,
    `tenants` (operation, `ctx.tenant`).
    """

    Config = FaultyTierConfig
    config: FaultyTierConfig
    lookup_answers_from_memory = False  # it plays a remote tier: it may hang or sleep

    def __init__(self, config: TierConfig, primary: PrimaryView) -> None:
        super().__init__(config, primary)
        self.down = False
        self.fail_jobs = 0
        self.hang = False
        self.gate: anyio.Event | None = None
        self.lie_about: set[OffloadKey] = set()
        self.full = False
        self.stuck: threading.Event | None = None
        self.calls: list[tuple[str, tuple[OffloadKey, ...]]] = []
        self.tenants: list[tuple[str, str | None]] = []

    @staticmethod
    def get_tier_type() -> str:
        return "faulty"

    async def _misbehave(self, op: str, keys: Sequence[OffloadKey]) -> None:
        self.calls.append((op, tuple(keys)))
        if self.down:
            raise TierUnavailable("faulty tier is down")
        if op != "lookup":
            if self.fail_jobs > 0:
                self.fail_jobs -= 1
                raise TierUnavailable("faulty tier failed this job")
            if self.gate is not None:
                await self.gate.wait()
            if self.stuck is not None:  # a worker thread cancellation waits for
                await anyio.to_thread.run_sync(self.stuck.wait)
            while self.hang:
                await anyio.sleep(0.01)
            if self.config.delay:
                await anyio.sleep(self.config.delay)
        elif self.config.lookup_delay:
            await anyio.sleep(self.config.lookup_delay)

    async def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[bool]:
        self.tenants.append(("lookup", ctx.tenant))
        await self._misbehave("lookup", keys)
        found = await super().lookup(keys, ctx)
        return [f or k in self.lie_about for k, f in zip(keys, found)]

    async def store(self, job: JobMetadata) -> JobResult:
        self.tenants.append(("store", job.ctx.tenant))
        await self._misbehave("store", job.keys)
        if self.full:
            return JobResult.failure(job, "faulty tier is full: No space left on device (ENOSPC)")
        if self.config.stall_after_keys is not None:
            return await self._key_by_key(job, super().store)
        return await super().store(job)

    async def _key_by_key(
        self, job: JobMetadata, move: Callable[[JobMetadata], Awaitable[JobResult]]
    ) -> JobResult:
        """`move` one key at a time under the job's deadline, stalling (until the
        deadline) after `stall_after_keys` of them."""
        moved = 0

        async def work(batch: Batch) -> dict[OffloadKey, str]:
            nonlocal moved
            if moved >= (self.config.stall_after_keys or 0):
                await anyio.sleep_forever()
            moved += len(batch)
            keys, slots = zip(*batch)
            result = await move(JobMetadata(job.job_id, tuple(keys), tuple(slots), job.ctx))
            return {k: result.error or "failed" for k in result.failed_keys}

        return await run_job(
            job, work, label="faulty", concurrency=1, timeout=self.config.job_timeout
        )

    async def load(self, job: JobMetadata) -> JobResult:
        self.tenants.append(("load", job.ctx.tenant))
        await self._misbehave("load", job.keys)
        lies = [k for k in job.keys if k in self.lie_about and k not in self._frames]
        if self.config.stall_after_keys is not None:
            result = await self._key_by_key(job, super().load)
        else:
            result = await super().load(job)
        if self.stuck is not None:  # the late write of a job its caller left behind
            for slot in job.slots:
                block = self.primary.block(slot)
                block[:] = b"\xee" * len(block)
        if not lies:
            return result
        return JobResult.partial(job, {k: "faulty tier lied" for k in result.failed_keys})

    def stored_keys(self) -> set[OffloadKey]:
        return set(self._frames)
