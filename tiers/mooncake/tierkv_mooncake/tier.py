"""`mooncake`: framed KV blocks as objects in Mooncake Store, shared across a fleet.

One object per block, named `<key_prefix><namespace tag>/<key hex>` (`names.py`),
holding the `tierkv.contract.framing` header and the block bytes. Mooncake Store is a
master that places objects in memory segments its clients mount (this process lends
`segment_size` of its memory; 0 lends none), moved over TCP or RDMA, with replicas,
leases and its own eviction. tierkv adds what Mooncake does not give: the frame's
checksum and, with `mac_key_env`, a keyed MAC (Mooncake's own CRCs are opt-in and
keyless), so bytes read back are untrusted: a value failing any frame check fails its
key, is deleted and `report_removed`; one signed by another trust domain is left to it
and counted (`report_foreign`). Nothing is ever unpickled.

Zero copy, batched. At `open` the primary slab and a small header arena (one row per
slot) are registered with the store (`register_buffer`). A store frames each block's
header into its slot's header row (checksum and MAC computed over the slot in place)
and puts header and payload as one object straight from the two buffers
(`batch_put_from_multi_buffers`); a load gets each object back into the same two
buffers (`batch_get_into_multi_buffers`), then checks the header and the payload where
it landed, in the slot. A job moves `batch_blocks` blocks per call, `concurrency`
calls at a time (the contract's `run_job`), each call and its framing or checking in
one worker thread: one thread hop per batch, not per block.

A load writes the slot from inside the binding, so its thread is never abandoned: a
job cancelled at its deadline waits for the call to return (the contract's `in_thread`)
rather than let a late transfer write a slot the cache has reused. A store reads its
slots the same way. Mooncake bounds its calls itself: an unreachable master answers
`RPC_FAIL` at once (a put waits ~4 s for it); a transfer to a segment whose process
froze fails after the TCP progress timeout, ~30 s a block by default, which the client
sets to `transfer_timeout` (`client.TCP_TIMEOUT_VARIABLES`), so such a job ends at most
about `transfer_timeout` per block of its batch in flight after its deadline.

What the store does on its own terms is a miss here, never wrong bytes: an object it
evicted, whose lease expired, or that lived in a segment whose process left
(`OBJECT_NOT_FOUND`) fails its key and is `report_removed`. A master that restarts
comes back empty (it held the only index) and clients reconnect by themselves; until it
answers, lookups raise `TierUnavailable` and loads whose every key met `RPC_FAIL` raise
it too, so the cache's breaker opens; its probe closes it once the master is back. A
put of a name the store already holds keeps the object there (Mooncake's put does not
replace): keys are content hashes, so it holds the same bytes, and a damaged one is
deleted at its first load and written again by the next store. A put refused because no
segment has room (`NO_AVAILABLE_HANDLE`) fails its key as `NO_ROOM`: the store is full
of leased blocks, not down.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from tierkv.contract.framing import MAX_KEY_BYTES
from tierkv.tier import (
    NO_ROOM,
    Batch,
    CorruptBlock,
    ForeignBlock,
    InFlightJobs,
    JobAborted,
    JobMetadata,
    JobResult,
    OffloadKey,
    PrimaryView,
    ReqContext,
    SecondaryTierManager,
    TierConfig,
    TierUnavailable,
    in_batches,
    in_thread,
    run_job,
)
from tierkv_mooncake.client import (
    NO_AVAILABLE_HANDLE,
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    RPC_FAIL,
    StoreClient,
    address_of,
    describe_code,
)
from tierkv_mooncake.config import MooncakeTierConfig
from tierkv_mooncake.names import BlockNames

logger = logging.getLogger(__name__)

HEADER_ROW = 256
"""Bytes of header arena per slot: a frame header of a 36-byte key is 70 bytes, 110
with a MAC; keys up to HEADER_ROW - 110 bytes fit (longer ones fail their key)."""


@dataclass
class _Outcome:
    """What one batch did, judged in its worker thread, reported on the loop."""

    failed: dict[OffloadKey, str] = field(default_factory=dict)
    removed: list[OffloadKey] = field(default_factory=list)
    foreign: list[OffloadKey] = field(default_factory=list)
    unreachable: str | None = None


class MooncakeTier(SecondaryTierManager):
    """Blocks as Mooncake Store objects: shared by every server that mounts the store."""

    Config = MooncakeTierConfig
    config: MooncakeTierConfig
    shared_storage = True

    def __init__(self, config: TierConfig, primary: PrimaryView) -> None:
        super().__init__(config, primary)
        self._names = BlockNames(self.config.key_prefix, primary.namespace)
        self._client: StoreClient | None = None
        self._headers = bytearray(primary.num_blocks * HEADER_ROW)
        self._header_base = 0
        self._slab_base = 0
        self._threads = anyio.CapacityLimiter(self.config.concurrency)
        self._inflight = InFlightJobs(self.name)

    @staticmethod
    def get_tier_type() -> str:
        return "mooncake"

    def __repr__(self) -> str:
        c = self.config
        return f"MooncakeTier(master {c.master}, {c.protocol}, segment {int(c.segment_size)} B)"

    # -- life cycle -----------------------------------------------------------------
    async def open(self) -> None:
        """Set up the client (mounting `segment_size` of memory when > 0) and register
        the slab. Raises TierUnavailable, naming the address, when the master or the
        metadata server cannot be reached, or the binding is not installed."""
        if self._client is not None:
            return
        self._inflight.closing = False
        self._client = await in_thread(self._connect)
        logger.info("mooncake tier open: %r", self)

    def _connect(self) -> StoreClient:
        client = StoreClient(self.config)
        try:
            view = self.primary
            self._slab_base = address_of(view.block(0))
            client.register(self._slab_base, view.num_blocks * view.block_bytes)
            self._header_base = address_of(memoryview(self._headers))
            client.register(self._header_base, len(self._headers))
        except BaseException:
            client.close()
            raise
        return client

    async def close(self) -> None:
        await self._inflight.drain()
        client, self._client = self._client, None
        if client is not None:
            with anyio.CancelScope(shield=True):
                await in_thread(client.close)

    def _require(self) -> StoreClient:
        if self._client is None:
            raise TierUnavailable(f"tier {self.name!r} is not open; call open() first")
        return self._client

    # -- jobs -----------------------------------------------------------------------
    async def store(self, job: JobMetadata) -> JobResult:
        async with self._inflight.job():
            return await self._run(job, self._store_batch, "store")

    async def load(self, job: JobMetadata) -> JobResult:
        async with self._inflight.job():
            return await self._run(job, self._load_batch, "load")

    async def _run(self, job: JobMetadata, move: Any, verb: str) -> JobResult:
        client = self._require()
        unreachable: list[str] = []

        async def work(batch: Batch) -> dict[OffloadKey, str] | None:
            outcome: _Outcome = await in_thread(move, client, batch, limiter=self._threads)
            self.report_removed(outcome.removed)
            self.report_foreign(outcome.foreign)
            if outcome.unreachable is not None:
                unreachable.append(outcome.unreachable)
                raise JobAborted(outcome.unreachable)
            return outcome.failed

        result = await run_job(
            job,
            work,
            label=f"mooncake {verb}",
            concurrency=self.config.concurrency,
            timeout=self.config.job_timeout,
            batches=in_batches(job, self.config.batch_blocks),
        )
        if unreachable and not result.ok_keys and job.keys:
            raise TierUnavailable(unreachable[0])
        return result

    def _layout(self, key: OffloadKey, slot: int) -> tuple[int, int]:
        """(header row address, slot address) of `slot`."""
        return (
            self._header_base + slot * HEADER_ROW,
            self._slab_base + slot * self.primary.block_bytes,
        )

    def _store_batch(self, client: StoreClient, batch: Batch) -> _Outcome:
        """Worker thread: frame each block's header into its row and put the batch."""
        out = _Outcome()
        block_bytes = self.primary.block_bytes
        names: list[str] = []
        pointers: list[list[int]] = []
        sizes: list[list[int]] = []
        keys: list[OffloadKey] = []
        for key, slot in batch:
            if self.framer.header_bytes(key) > HEADER_ROW or len(key) > MAX_KEY_BYTES:
                out.failed[key] = f"mooncake: a key of {len(key)} bytes does not fit a header row"
                continue
            header = self.framer.encode_header(key, self.primary.block(slot))
            row = slot * HEADER_ROW
            self._headers[row : row + len(header)] = header
            names.append(self._names.name(key))
            pointers.append(list(self._layout(key, slot)))
            sizes.append([len(header), block_bytes])
            keys.append(key)
        if not names:
            return out
        codes = client.put(names, pointers, sizes)
        for key, name, code in zip(keys, names, codes):
            if code in (0, OBJECT_ALREADY_EXISTS):
                continue
            if code == RPC_FAIL:
                out.unreachable = f"mooncake master {self.config.master} did not answer a put"
            if code == NO_AVAILABLE_HANDLE:
                out.failed[key] = f"{NO_ROOM}: mooncake has no segment with room for {name}"
            else:
                out.failed[key] = f"mooncake put of {name}: {describe_code(code)}"
        return out

    def _load_batch(self, client: StoreClient, batch: Batch) -> _Outcome:
        """Worker thread: get the batch into header rows and slots, then check each."""
        out = _Outcome()
        block_bytes = self.primary.block_bytes
        names = [self._names.name(key) for key, _slot in batch]
        header_sizes = [self.framer.header_bytes(key) for key, _slot in batch]
        pointers = [list(self._layout(key, slot)) for key, slot in batch]
        sizes = [[h, block_bytes] for h in header_sizes]
        codes = client.get_into(names, pointers, sizes)
        bad: list[tuple[OffloadKey, str]] = []
        for (key, slot), name, size, code in zip(batch, names, header_sizes, codes):
            try:
                if code == size + block_bytes:
                    row = slot * HEADER_ROW
                    header = self.framer.parse_header(memoryview(self._headers)[row : row + size])
                    self.framer.check(header, key, block_bytes)
                    self.framer.verify(header, self.primary.block(slot))
                elif code == OBJECT_NOT_FOUND:
                    out.failed[key] = f"{name} is not in mooncake (evicted, expired or removed)"
                    out.removed.append(key)
                elif code == RPC_FAIL:
                    out.unreachable = f"mooncake master {self.config.master} did not answer a get"
                    out.failed[key] = out.unreachable
                elif code >= 0 or client.size_of(name) not in (-1, size + block_bytes):
                    # a value of another size than our frame (the get fails with
                    # INVALID_PARAMS or TRANSFER_FAIL): read it whole to judge it
                    self.framer.decode_into(key, client.get_bytes(name), self.primary.block(slot))
                else:
                    out.failed[key] = f"mooncake get of {name}: {describe_code(code)}"
            except ForeignBlock as exc:
                out.failed[key] = f"{name}: {exc}"
                out.foreign.append(key)
            except CorruptBlock as exc:
                out.failed[key] = f"corrupt block deleted: {name}: {exc}"
                bad.append((key, name))
        if bad:
            codes = client.remove([name for _key, name in bad])
            for (key, name), code in zip(bad, codes):
                if code in (0, OBJECT_NOT_FOUND):
                    out.removed.append(key)
                else:
                    logger.warning(
                        "mooncake: could not delete corrupt %s: %s", name, describe_code(code)
                    )
        return out

    # -- lookup and remove ----------------------------------------------------------
    async def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[bool]:
        """One batched existence query. Raises TierUnavailable when the master does not
        answer; a key the store could not answer for counts as absent."""
        if not keys:
            return []
        async with self._inflight.job():
            client = self._require()
            names = [self._names.name(key) for key in keys]
            codes = await in_thread(client.exists, names, limiter=self._threads)
            if RPC_FAIL in codes:
                raise TierUnavailable(f"mooncake master {self.config.master} did not answer")
            return [code == 1 for code in codes]

    async def remove(self, keys: Sequence[OffloadKey]) -> None:
        """Delete the objects, leased or not; raises TierUnavailable when the master
        does not confirm."""
        if not keys:
            return
        async with self._inflight.job():
            client = self._require()
            names = [self._names.name(key) for key in keys]
            codes = await in_thread(client.remove, names, limiter=self._threads)
            failed = [(n, c) for n, c in zip(names, codes) if c not in (0, OBJECT_NOT_FOUND)]
            if failed:
                name, code = failed[0]
                raise TierUnavailable(
                    f"mooncake did not remove {len(failed)} of {len(names)} objects, e.g. "
                    f"{name}: {describe_code(code)}"
                )

    def describe(self) -> dict[str, Any]:
        c = self.config
        return {
            "type": "mooncake",
            "master": c.master,
            "metadata_server": c.metadata_server,
            "protocol": c.protocol,
            "segment_size": int(c.segment_size),
            "replicas": c.replicas,
            "names": f"{self._names.prefix}<key hex>",
            "batch_blocks": c.batch_blocks,
            "concurrency": c.concurrency,
            "mac": self.framer.mac,
            "open": self._client is not None,
        }
