"""The tier contract: what a secondary-tier plugin implements.

This module is the whole public API a plugin author needs (`tierkv.testing` holds the
conformance suite). A tier moves bytes only between itself and primary slots: on
`store` it reads `primary.block(slot)`, on `load` it writes it. Everything async;
nothing blocks the event loop.

The contract is torch-free and imports nothing of the cache: it is this module and its
siblings in `tierkv.contract` (`slab`, `keys`, `jobs`, `events`, `errors`, `framing`,
`mac`, `runner`, `units`, `redact`, `claims`; checked by import-linter, see pyproject.toml).
Plugin authors import these names from `tierkv.tier`, which re-exports `__all__`.

Register a tier with an entry point:

    [project.entry-points."tierkv.tiers"]
    mytier = "my_package:MyTier"
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar, Literal, NamedTuple

import anyio
from pydantic import BaseModel, ByteSize, ConfigDict, Field, PositiveInt, field_validator

from tierkv.contract.claims import ClaimTable
from tierkv.contract.errors import (
    ConfigError,
    CorruptBlock,
    ForeignBlock,
    TierUnavailable,
    detached,
)
from tierkv.contract.framing import Framer
from tierkv.contract.jobs import JobMetadata, JobResult, ReqContext
from tierkv.contract.keys import OffloadKey
from tierkv.contract.mac import MacKey, load_mac_key
from tierkv.contract.private import (
    DIRECTORY_MODE,
    FILE_MODE,
    directory_problem,
    make_directories,
)
from tierkv.contract.redact import redact_url
from tierkv.contract.runner import (
    Batch,
    BlockThreads,
    FreeSlots,
    IOThreads,
    JobAborted,
    SlotGuard,
    in_batches,
    in_thread,
    per_key,
    run_job,
)
from tierkv.contract.slab import GatherView, Lane, PrimaryView, Regions, StridedView
from tierkv.contract.units import Duration, Size

__all__ = [
    "redact_url",
    "Batch",
    "BlockThreads",
    "ClaimTable",
    "CorruptBlock",
    "detached",
    "directory_problem",
    "DIRECTORY_MODE",
    "Duration",
    "FILE_MODE",
    "ForeignBlock",
    "Framer",
    "FreeSlots",
    "InFlightJobs",
    "IOThreads",
    "JobAborted",
    "JobMetadata",
    "JobResult",
    "Lane",
    "NO_ROOM",
    "OffloadKey",
    "GatherView",
    "PrimaryView",
    "Regions",
    "StridedView",
    "RemovalListener",
    "ReqContext",
    "SecondaryTierManager",
    "SlotGuard",
    "Size",
    "TierConfig",
    "TierRoom",
    "TierUnavailable",
    "WritePolicy",
    "in_batches",
    "in_thread",
    "make_directories",
    "per_key",
    "run_job",
]

WritePolicy = Literal["write_through", "write_back", "write_through_selective"]
Admission = Literal["all", "reuse", "tinylfu", "adaptive"]

RemovalListener = Callable[[tuple[OffloadKey, ...]], None]
"""Called with the keys a tier reports it no longer holds (see `report_removed`)."""

NO_ROOM = "no room"
"""How a tier's reason begins when it refuses to store a key only because it is full of
blocks it may not evict (claimed by lookups, being read or written): the tier is full,
not down, and a store job that stored nothing for that reason does not count against
its circuit breaker (`tierkv.driver.GuardedTier`)."""


class TierRoom(NamedTuple):
    """A tier's room in blocks of the primary's `block_bytes` (`SecondaryTierManager.room`)."""

    free_blocks: int
    """Blocks it takes before its eviction must make room (the cache subtracts the
    stores it has in flight to the tier)."""
    capacity_blocks: int
    """Blocks it holds when full."""


class TierConfig(BaseModel):
    """Fields every tier's YAML section has. A plugin subclasses it for its own
    fields; unknown fields are rejected, not ignored. Give each field a
    `Field(description=...)`: `tierkv plugins` lists it beside the field's default.
    Sizes are `Size` (YAML `4GiB`; bits are refused, decimal units warned about) and
    durations `Duration` (`250ms`)."""

    model_config = ConfigDict(extra="forbid")

    type: str = Field(description="the tier type, as registered in `tierkv.tiers`")
    name: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$",
        description="how stats, metrics and events name this tier (unique in a chain); "
        "default: its type, or type-i when the chain has several of that type",
    )
    write_policy: WritePolicy = Field(
        default="write_through",
        description="write_through: every stored block; write_back: only blocks the "
        "primary evicts; write_through_selective: blocks looked up at least min_hits times",
    )
    min_hits: PositiveInt = Field(
        default=2, description="lookups before write_through_selective writes a block"
    )
    admission: Admission = Field(
        default="all",
        description="which stored blocks a write_through tier is written: all; reuse: "
        "a block seen in at least 2 requests (remembered past its eviction), or new blocks "
        "of a request that hit at least half its blocks (a continuing conversation); "
        "tinylfu: every block while the tier has room, then as reuse, or a block seen "
        "more often than the one the tier would evict for it (tiers that cannot name "
        "that block, such as redis and s3, get reuse); adaptive: tinylfu or every block, "
        "whichever two sampled shadow chains say serves more on the recent asks (tiers "
        "that cannot name their evictions: reuse or every block)",
    )
    job_timeout: Duration = Field(
        default=30.0,
        gt=0,
        description="the job's deadline, kept by the tier's runner: keys not done by then "
        "fail as late and the rest are kept; a tier silent past a grace after it (half of "
        "it, 0.25-5s) loses the whole job",
    )
    required: bool = Field(
        default=True,
        description="false: a tier that fails to open does not stop the cache; it is "
        "skipped and reopened in the background every recovery_after until it works",
    )
    max_inflight_bytes: Size = Field(
        default=ByteSize(256 << 20),
        gt=0,
        description="cascades beyond this many bytes in flight to the tier are dropped",
    )
    failure_threshold: PositiveInt = Field(
        default=3, description="consecutive errors that open the tier's circuit breaker"
    )
    recovery_after: Duration = Field(
        default=5.0, description="how long an open breaker waits before one probe"
    )
    claim_lease: Duration = Field(
        default=10.0,
        ge=0,
        description="how long a block a lookup reported in this tier is kept from the "
        "tier's own eviction when the request's load does not let it go first (0: no "
        "claims); only tiers that protect claims (memory, nvme, sqlite) keep them",
    )
    mac_key_env: str | None = Field(
        default=None,
        description="name of an environment variable holding a secret (at least 32 "
        "bytes): frames then carry a keyed MAC, and only frames whose MAC checks under "
        "it are accepted. For tiers shared by several servers (trust domains)",
    )

    @field_validator("admission")
    @classmethod
    def _admission_needs_write_through(cls, value: str, info: Any) -> str:
        policy = info.data.get("write_policy", "write_through")
        if value != "all" and policy != "write_through":
            raise ValueError(
                f"admission {value!r} applies to write_through tiers; this tier is "
                f"{policy} (write_through_selective already admits by min_hits)"
            )
        return value

    @field_validator("mac_key_env")
    @classmethod
    def _mac_key_is_set(cls, name: str | None) -> str | None:
        if name is not None:
            if not name or not name.replace("_", "").isalnum():
                raise ValueError(f"{name!r} is not an environment variable name")
            load_mac_key(name)  # a missing or short secret is an error here, not later
        return name

    def mac_key(self) -> MacKey | None:
        """The MAC key named by `mac_key_env`, read from the environment now."""
        if self.mac_key_env is None:
            return None
        try:
            return load_mac_key(self.mac_key_env)
        except ValueError as exc:
            raise ConfigError(f"mac_key_env: {exc}") from None


class SecondaryTierManager(ABC):
    """A storage tier below the primary. Subclass it, set `Config`, implement the
    abstract methods, and pass `tierkv.testing.TierConformanceSuite`.

    Rules every tier keeps:
    - `lookup` is batched: one answer per key, in order.
    - A job's result names every key exactly once, in `ok_keys` or `failed_keys`;
      partial success is normal.
    - Stored bytes are framed by `self.framer` (`tierkv.contract.framing`: a checksum
      always, a keyed MAC when the config sets `mac_key_env`); a load that reads bytes
      failing the check reports the key failed, deletes it and reports it removed. A
      `ForeignBlock` (signed by another trust domain's MAC key) fails its key too; a
      tier whose storage other servers share (`shared_storage = True`) leaves it in
      place and counts it with `report_foreign`.
    - Per-key work goes through `run_job` (concurrency, deadline, late keys failed,
      partial results); blocking calls and whole-block CPU work (framing, checksums,
      copies) through `in_thread`, never on the event loop.
    - A tier that is down raises `TierUnavailable` or reports keys failed; it never
      hangs past its `job_timeout`.
    - `close` finishes (or fails) in-flight jobs before releasing resources.
    - A job may be cancelled (its `job_timeout`, the cache closing). After it returns
      or is cancelled it must not touch its slots again: run blocking I/O through
      `anyio.to_thread.run_sync`, which waits for the thread when cancelled.
    - Blocks that leave the tier by the tier's own doing (its capacity eviction, an
      expiry, a deletion after a failed check) are reported with `report_removed`, so
      the cache forgets them and emits `removed` events for this tier. Blocks the
      cache asked to `remove` need no report.
    - A tier that evicts by itself may keep claimed blocks (`protects_claims`): its
      eviction passes over the keys `self.claims.is_protected` names, and a store that
      finds no other room fails its key (a reason starting `NO_ROOM`) rather than
      evict a claimed block.
    """

    Config: ClassVar[type[TierConfig]] = TierConfig
    reports_evictions: ClassVar[bool] = False
    """True when the tier evicts blocks itself (a capacity bound) and reports every
    block that leaves it with `report_removed`, so a consumer of its events may expect
    a removal for each block stored (vLLM's `removal_expected`). False for a tier
    whose blocks vanish unseen (a Redis evicting under maxmemory, a TTL) or never."""
    shared_storage: ClassVar[bool] = False
    """True when other servers read and write the same stored blocks (a Redis, a
    bucket): a block signed by another MAC key is theirs, and is left in place. False
    for storage private to this tier (its memory, its directory), where such a block
    can only be this tier's own under an earlier key and is deleted like a corrupt one."""
    protects_claims: ClassVar[bool] = False
    """True when the tier keeps blocks a lookup reported from its own eviction until
    the request's load has read them (`protect` / `unprotect`, `tierkv.contract.claims`):
    its eviction skips `self.claims.is_protected` keys. False (the default) for a tier
    that cannot (a Redis or a bucket evicts on the server's own terms) or never evicts:
    `protect` and `unprotect` then do nothing, and the cache sends it no claims."""
    names_eviction_candidates: ClassVar[bool] = False
    """True when the tier evicts by itself in an order it can tell ahead, in memory and
    at once: `room` says how many more blocks it takes before it must evict, and
    `eviction_candidates` which blocks its eviction would take next. `admission:
    tinylfu` then weighs each new block against the block it would displace
    (`tierkv.policies.admission`). False (the default) for a tier that cannot say (a
    Redis evicting under maxmemory, a bucket with no bound): `tinylfu` falls back to
    the `reuse` rule there."""

    accepts_regions: ClassVar[bool] = False
    """True when the tier moves a block through `primary.regions(slot)` (one or more
    writable regions, whose joined bytes are the block: `tierkv.contract.slab`), so it
    may be given a `StridedView`, whose blocks are several regions of one buffer.
    False (the default): the tier reads and writes `primary.block(slot)`, and is only
    ever given views whose blocks are one run of bytes."""

    lookup_answers_from_memory: ClassVar[bool] = False
    """True when `lookup` answers from an index in memory and never waits on I/O, a
    server or a thread (the memory and nvme tiers): the driver then awaits it directly.
    False (the default, right for any tier that asks a server or a client library):
    the driver runs it as a task of its own, so `lookup_timeout` bounds it whatever it
    does (`tierkv.driver.GuardedTier.lookup`)."""

    def __init__(self, config: TierConfig, primary: PrimaryView) -> None:
        if not isinstance(config, self.Config):
            raise TypeError(
                f"{type(self).__name__} needs a {self.Config.__name__}, got {type(config).__name__}"
            )
        if primary.region_count > 1 and not self.accepts_regions:
            raise TypeError(
                f"tier {self.get_tier_type()!r} moves a block as one run of bytes; this "
                f"primary's blocks are {primary.region_count} regions each "
                f"({type(primary).__name__}): "
                "give it a plain PrimaryView, or use a tier that accepts_regions"
            )
        self.config = config
        self.primary = primary
        self.framer = Framer(primary.namespace, config.mac_key())
        """Writes and checks this tier's frames (with a MAC when `mac_key_env` is set)."""
        self._removal_listener: RemovalListener | None = None
        self._foreign_lock = threading.Lock()
        self.foreign_blocks = 0
        """Loads that found a block signed by another MAC key (`report_foreign`)."""
        self.claims = ClaimTable()
        """Blocks lookups claimed in this tier (used when `protects_claims`)."""

    @staticmethod
    @abstractmethod
    def get_tier_type() -> str:
        """The name used in YAML `type:` and in the entry point."""

    @property
    def name(self) -> str:
        """How logs and events name this tier."""
        return self.get_tier_type()

    async def open(self) -> None:  # noqa: B027 - optional hook
        """Connect, recover an index, check health. Default: nothing to do."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Finish in-flight work and release everything. Default: nothing to do."""

    @abstractmethod
    async def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[bool]:
        """For each key, whether this tier holds it."""

    @abstractmethod
    async def store(self, job: JobMetadata) -> JobResult:
        """Copy `primary.block(slot)` into the tier for each key/slot of `job`."""

    @abstractmethod
    async def load(self, job: JobMetadata) -> JobResult:
        """Copy each key's bytes from the tier into `primary.block(slot)`.

        The slot of a key reported failed may hold anything (a zero-copy read may
        have filled it before the check failed); the cache never reads it."""

    @abstractmethod
    async def remove(self, keys: Sequence[OffloadKey]) -> None:
        """Delete `keys`; keys not held are ignored."""

    async def evict(self, keys: Sequence[OffloadKey]) -> None:
        """Drop `keys` to make room for this tier's own next store: what a caller that
        bounds several tiers' bytes together does (LMCache's shared budget, evicting
        for a store of this tier). Like `remove`, but the tier may keep their space
        for that store (the nvme slab reuses the slots in place rather than punch
        them out and allocate them again) and gives back what its next store did not
        reuse once that store ends. Keys not held are ignored. Default: `remove`."""
        await self.remove(keys)

    async def touch(self, keys: Sequence[OffloadKey]) -> None:  # noqa: B027 - optional hook
        """These blocks were just reused, served from a tier above this one: a tier
        that evicts by recency counts it as a use (a block hot in the primary is not
        the coldest down here). Keys not held are ignored; cheap and best effort, no
        I/O of block bytes. Default: nothing."""

    def room(self) -> TierRoom:
        """How many more blocks of `primary.block_bytes` this tier takes before its
        eviction must make room, and how many it holds when full (used when
        `names_eviction_candidates`). Called on the event-loop thread; in memory, no
        I/O, O(1)."""
        raise NotImplementedError(f"tier {self.name!r} does not name its eviction candidates")

    def eviction_candidates(self) -> Iterator[OffloadKey]:
        """The blocks this tier's eviction would take next, the next victim first,
        lazily (used when `names_eviction_candidates`); blocks its eviction passes over
        (claimed, being read) are left out. The caller takes a few at once and drops
        the iterator before its next await (the order changes as the tier works).
        Default: none."""
        return iter(())

    def protect(self, keys: Sequence[OffloadKey], lease: float) -> None:
        """A lookup just reported `keys` held here and a load will read them: keep them
        from this tier's own eviction until `unprotect`, or for `lease` seconds at most.
        Called on the event-loop thread right after the lookup answered, once per claim
        (a key claimed twice needs two `unprotect`s). Cheap, in memory, no I/O. Default:
        `self.claims` keeps them when `protects_claims`, else nothing."""
        if self.protects_claims:
            self.claims.protect(keys, lease)

    def unprotect(self, keys: Sequence[OffloadKey]) -> None:
        """One claim on each of `keys` ends (its load read it, failed, or its request
        ended); keys not claimed are ignored. Default: as for `protect`."""
        if self.protects_claims:
            self.claims.unprotect(keys)

    def set_removal_listener(self, listener: RemovalListener | None) -> None:
        """Where `report_removed` goes: the cache sets it when it adopts the tier."""
        self._removal_listener = listener

    def report_removed(self, keys: Iterable[OffloadKey]) -> None:
        """Tell the cache these blocks are gone from this tier (own eviction, expiry,
        deletion after a failed check). Call it from the event-loop thread, after the
        thread that did the deleting has returned."""
        removed = tuple(keys)
        if removed and self._removal_listener is not None:
            self._removal_listener(removed)

    def report_foreign(self, keys: Iterable[OffloadKey]) -> None:
        """Count blocks a load found signed by another trust domain's key (failed for
        this tier, left in place). Safe from any thread."""
        n = sum(1 for _ in keys)
        if n:
            with self._foreign_lock:
                self.foreign_blocks += n

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary for `tierkv plugins` and logs (no secrets)."""
        return {"type": self.get_tier_type()}

    data_path: str | None = None
    """What moves this tier's bytes, where a tier has more than one way (the nvme
    tier: `native`, its compiled core, or `python`); set by `open`. Shown in
    `stats()` and as the `tierkv_data_path{path}` metric. None: the one way there is."""

    @classmethod
    def installation(cls) -> dict[str, str]:
        """Facts about how this tier type is installed that a user should see in
        `tierkv plugins` (e.g. whether a compiled core was built, and if not why).
        Nothing by default."""
        return {}


class InFlightJobs:
    """Counts a tier's running jobs so `close` can wait for them to finish.

    async with self._inflight.job():   # raises TierUnavailable once closing
        ...
    await self._inflight.drain()       # in close(): refuse new jobs, wait
    """

    def __init__(self, tier_name: str) -> None:
        self._tier_name = tier_name
        self._count = 0
        self._idle = anyio.Event()
        self._idle.set()
        self.closing = False

    @property
    def count(self) -> int:
        return self._count

    def job(self) -> _OneJob:
        """`async with` around a job: counts it while it runs (a plain object, not an
        async generator: every job of every tier enters it)."""
        return _OneJob(self)

    def _enter(self) -> None:
        if self.closing:
            raise TierUnavailable(f"tier {self._tier_name!r} is closed")
        if self._count == 0:
            self._idle = anyio.Event()
        self._count += 1

    def _leave(self) -> None:
        self._count -= 1
        if self._count == 0:
            self._idle.set()

    async def drain(self) -> None:
        """Refuse new jobs and wait until the running ones have finished."""
        self.closing = True
        await self._idle.wait()


class _OneJob:
    """One job of `InFlightJobs.job()`."""

    __slots__ = ("_jobs",)

    def __init__(self, jobs: InFlightJobs) -> None:
        self._jobs = jobs

    async def __aenter__(self) -> None:
        self._jobs._enter()

    async def __aexit__(self, *exc_info: object) -> None:
        self._jobs._leave()
