"""`memory`: the reference secondary tier, a bounded LRU of framed blocks in RAM.

It stores exactly what a real tier stores (header + payload, `self.framer`, with a MAC
when `mac_key_env` is set) and checks it on the way back, so tests and examples
exercise the real format with no server. It is also the smallest complete example of
the tier contract: blocks it evicts to stay under `capacity`, and blocks it deletes
after a failed check, are reported with `report_removed`; blocks a lookup claimed are
passed over by that eviction (`protects_claims`), and a store that would need one of
them fails its key instead. It names its eviction candidates (`room`,
`eviction_candidates`), so `admission: tinylfu` weighs a new block against the block
it would displace.

Framing here runs on the event loop, a few blocks between yields: the memory tier is
for tests, examples and small blocks; a tier that moves MiB-sized blocks over a wire
frames them in worker threads (`tierkv_redis`, `tierkv_s3`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

import anyio
from pydantic import ByteSize, Field

from tierkv.contract.tier import (
    NO_ROOM,
    CorruptBlock,
    InFlightJobs,
    JobMetadata,
    JobResult,
    OffloadKey,
    PrimaryView,
    ReqContext,
    SecondaryTierManager,
    Size,
    TierConfig,
    TierRoom,
    TierUnavailable,
)

_YIELD_EVERY = 8  # blocks copied between yields to the event loop
_TYPICAL_KEY_BYTES = 36  # a sha256 block hash and its group: the frame size before any store


class MemoryTierConfig(TierConfig):
    capacity: Size = Field(
        default=ByteSize(1 << 30), gt=0, description="bytes of framed blocks held"
    )


class MemoryTier(SecondaryTierManager):
    """Framed blocks in an in-process LRU; evicts the least recently used past capacity."""

    Config = MemoryTierConfig
    config: MemoryTierConfig
    reports_evictions = True
    protects_claims = True
    lookup_answers_from_memory = True  # a dict probe
    names_eviction_candidates = True
    accepts_regions = True  # a block of several regions is framed from them in place

    def __init__(self, config: TierConfig, primary: PrimaryView) -> None:
        super().__init__(config, primary)
        self._frames: OrderedDict[OffloadKey, bytes] = OrderedDict()
        self._bytes = 0
        self._frame_bytes = self.framer.frame_bytes(
            bytes(_TYPICAL_KEY_BYTES), primary.block_bytes
        )  # one block's frame: the last one stored (a 36-byte key's before any)
        self._inflight = InFlightJobs(self.name)

    @staticmethod
    def get_tier_type() -> str:
        return "memory"

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._frames)

    async def close(self) -> None:
        await self._inflight.drain()
        self.claims.clear()
        self._frames.clear()
        self._bytes = 0

    def _check_open(self) -> None:
        if self._inflight.closing:
            raise TierUnavailable(f"tier {self.name!r} is closed")

    async def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[bool]:
        self._check_open()
        return [key in self._frames for key in keys]

    def room(self) -> TierRoom:
        capacity, frame = int(self.config.capacity), self._frame_bytes
        return TierRoom(max(0, capacity - self._bytes) // frame, capacity // frame)

    def eviction_candidates(self) -> Iterator[OffloadKey]:
        """Least recently used first, claimed blocks passed over (as `_put` evicts)."""
        claims = self.claims
        if not claims:  # nothing claimed: the order itself
            return iter(self._frames)
        return (key for key in self._frames if not claims.is_protected(key))

    async def touch(self, keys: Sequence[OffloadKey]) -> None:
        frames = self._frames
        for key in keys:
            if key in frames:
                frames.move_to_end(key)

    def _put(self, key: OffloadKey, frame: bytes) -> list[OffloadKey] | None:
        """Hold `frame` under `key`; return the keys evicted to make room (least
        recently used first, claimed blocks passed over), or None, changing nothing,
        when only evicting claimed blocks would make room."""
        frames, claims = self._frames, self.claims
        old = frames.get(key)
        excess = self._bytes - (len(old) if old is not None else 0) + len(frame)
        excess -= int(self.config.capacity)
        victims: list[OffloadKey] = []
        for victim, victim_frame in frames.items():  # oldest first
            if excess <= 0:
                break
            if victim == key or claims.is_protected(victim):
                continue
            victims.append(victim)
            excess -= len(victim_frame)
        if excess > 0:
            return None
        for victim in victims:
            self._bytes -= len(frames.pop(victim))
        if old is not None:
            self._bytes -= len(frames.pop(key))
        frames[key] = frame
        self._bytes += len(frame)
        self._frame_bytes = len(frame)
        return victims

    async def store(self, job: JobMetadata) -> JobResult:
        failed: dict[OffloadKey, str] = {}
        async with self._inflight.job():
            for i, (key, slot) in enumerate(zip(job.keys, job.slots)):
                frame = self.framer.encode(key, self.primary.payload(slot))
                if len(frame) > self.config.capacity:
                    failed[key] = (
                        f"block frame of {len(frame)} bytes exceeds the memory tier "
                        f"capacity of {int(self.config.capacity)} bytes"
                    )
                    continue
                evicted = self._put(key, frame)
                if evicted is None:
                    failed[key] = (
                        f"{NO_ROOM}: the memory tier is full of blocks claimed by lookups "
                        "until their loads (or claim_lease) end; retry later or raise "
                        "`capacity`"
                    )
                    continue
                self.report_removed(evicted)
                if i % _YIELD_EVERY == _YIELD_EVERY - 1:
                    await anyio.sleep(0)
        return JobResult.partial(job, failed)

    async def load(self, job: JobMetadata) -> JobResult:
        failed: dict[OffloadKey, str] = {}
        async with self._inflight.job():
            for i, (key, slot) in enumerate(zip(job.keys, job.slots)):
                frame = self._frames.get(key)
                if frame is None:
                    failed[key] = "not in the memory tier"
                    continue
                try:
                    self.framer.decode_into(key, frame, self.primary.payload(slot))
                except CorruptBlock as exc:
                    failed[key] = f"corrupt block deleted: {exc}"
                    self._bytes -= len(self._frames.pop(key))
                    self.report_removed([key])
                    continue
                self._frames.move_to_end(key)
                if i % _YIELD_EVERY == _YIELD_EVERY - 1:
                    await anyio.sleep(0)
        return JobResult.partial(job, failed)

    async def remove(self, keys: Sequence[OffloadKey]) -> None:
        self._check_open()
        for key in keys:
            frame = self._frames.pop(key, None)
            if frame is not None:
                self._bytes -= len(frame)

    def describe(self) -> dict[str, object]:
        return {
            "type": "memory",
            "blocks": len(self._frames),
            "used_bytes": self._bytes,
            "capacity": int(self.config.capacity),
            "mac": self.framer.mac,
        }
