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
it landed, in the slot (`Framer.check_frame`: one unpack and compare per header, then
the payload's xxh3, the one cost per byte the tier adds to Mooncake's call). A job
moves `batch_blocks` blocks per call in `concurrency` lanes: a lane is one worker
thread call that takes the job's next batch from a queue the lanes share, moves it
(framing or checking included) and takes the next, so a job of many batches costs
`concurrency` thread hops, not one per batch (measured: ~0.2 ms of event-loop CPU a
hop on the dev VM, 13 ms of a 64 MiB job of 64 KiB blocks before). Between batches a
lane gives its thread back when another call of the tier waits for one (a lookup,
another job) and queues again for the rest: a long store holds a load up by one batch,
as it did with one call per batch.

Under an engine (`PrimaryView.engine_owned`: SGLang's and LMCache's adapters) the
slots are the engine's pages, which it hands out again once a call answers, at the
deadline at the latest, while a transfer a frozen peer holds up may still be running.
There a load lands in a staging arena of the tier's own, registered beside the slab
(2 x `concurrency` parts of `batch_blocks` blocks: one per running lane, and as many
again for lanes an engine's call left behind in a held-up transfer), is checked there,
and is copied into the engine's page only while its job is on time: a transfer that
ends after the deadline writes nothing the engine sees. A lane that finds every part
taken fails its batch. Stores need no staging: a late put of a page the engine reused
fails its frame's checksum at the next load, a miss.

A load writes the slot from inside the binding, so its thread is never abandoned: a job
cancelled, or past its deadline, stops taking batches and waits for the batch in flight
(the thread sees the cancellation through `anyio.from_thread.check_cancelled` and keeps
the deadline itself) rather than let a late transfer write a slot the cache has reused;
keys of batches done before are reported done, the rest late. A store reads its slots
the same way. Mooncake bounds its calls itself: an unreachable master answers
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

import ctypes
import enum
import logging
import math
import queue
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import anyio.from_thread

from tierkv.contract.framing import MAX_KEY_BYTES
from tierkv.tier import (
    NO_ROOM,
    Batch,
    CorruptBlock,
    ForeignBlock,
    InFlightJobs,
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


T = TypeVar("T")


@dataclass
class _Outcome:
    """What one batch (or lane) did, judged in its worker thread, reported on the loop."""

    failed: dict[OffloadKey, str] = field(default_factory=dict)
    removed: list[OffloadKey] = field(default_factory=list)
    foreign: list[OffloadKey] = field(default_factory=list)
    unreachable: str | None = None


_Move = Callable[[StoreClient, Batch, "_JobState"], _Outcome]
"""Moves one batch in a worker thread (`_store_batch`, `_load_batch`)."""


class _Stop(enum.Enum):
    """Why a lane's thread returned before its last batch."""

    LATE = "the job's deadline passed, or it was cancelled"
    ABORTED = "the master did not answer"
    TURN = "another call waits for a thread"


@dataclass
class _JobState:
    """What the lanes of one job share."""

    queue: deque[Batch]  # batches no lane has taken yet (popleft is thread-safe)
    deadline: float | None  # on the event loop's clock
    thread_deadline: float | None  # the same on time.monotonic(), for the threads
    cancelled: type[BaseException]  # the event loop's cancellation exception
    aborted: str | None = None  # set by a thread whose batch met an unreachable master
    waiting: int = 0  # lanes of this job waiting for a thread (in `MooncakeTier._waiting`)
    logged: bool = False

    def past_deadline(self) -> bool:
        return self.thread_deadline is not None and time.monotonic() >= self.thread_deadline

    def host_cancelled(self) -> bool:
        """Worker thread: whether the task waiting for this thread was cancelled (the
        job ended for another reason than its deadline, e.g. the driver's backstop)."""
        try:
            anyio.from_thread.check_cancelled()
        except self.cancelled:
            return True
        return False


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
        self._rows = memoryview(self._headers)
        self._header_base = 0
        self._slab_base = 0
        self._staging: bytearray | None = None
        """Under an engine (`engine_owned`): where loads land before their pages."""
        self._staging_base = 0
        self._staging_parts: queue.SimpleQueue[int] = queue.SimpleQueue()
        """Parts of the staging arena free for a lane (one per running lane thread)."""
        self._threads = anyio.CapacityLimiter(self.config.concurrency)
        """The tier's `concurrency` threads, taken by `_acquire` (which counts waiters)."""
        self._spare = anyio.CapacityLimiter(self.config.concurrency)
        """What `in_thread` takes once a call holds one of `_threads` (never waits)."""
        self._waiting = 0
        """Calls waiting for one of `_threads` (only the event loop changes it)."""
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
            if view.engine_owned:  # loads land here first (the module's docstring)
                lanes, part = 2 * self.config.concurrency, self._staging_part_bytes
                self._staging = bytearray(lanes * part)
                self._staging_base = address_of(memoryview(self._staging))
                client.register(self._staging_base, len(self._staging))
                for lane in range(lanes):
                    self._staging_parts.put(lane)
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

    async def _run(self, job: JobMetadata, move: _Move, verb: str) -> JobResult:
        """Move `job` in `concurrency` lanes: each lane is one thread call that takes the
        job's next batch from a queue the lanes share until none is left (`_lane`): one
        thread hop per lane, not per batch, and a lane that moves faster takes more
        batches. A lane's thread gives its turn back between batches when another call
        of this tier waits for a thread, then queues again for the rest, so a long job
        holds a short one up by one batch at most, as with one call per batch."""
        client = self._require()
        timeout = self.config.job_timeout
        state = _JobState(
            queue=deque(in_batches(job, self.config.batch_blocks)),
            deadline=None if timeout is None else anyio.current_time() + timeout,
            thread_deadline=None if timeout is None else time.monotonic() + timeout,
            cancelled=anyio.get_cancelled_exc_class(),
        )
        lanes = min(self.config.concurrency, len(state.queue))

        async def lane(failed: dict[OffloadKey, str]) -> None:
            while state.queue and state.aborted is None:
                acquired = False
                with anyio.move_on_at(math.inf if state.deadline is None else state.deadline):
                    await self._acquire(state)
                    acquired = True
                if not acquired:
                    return  # the deadline passed while this lane waited for a thread
                try:
                    if not state.queue:
                        return  # the other lanes took the rest meanwhile
                    outcome, stop = await in_thread(
                        self._lane, move, client, state, limiter=self._spare
                    )
                finally:
                    self._threads.release()
                self.report_removed(outcome.removed)
                self.report_foreign(outcome.foreign)
                failed.update(outcome.failed)
                if outcome.unreachable is not None and not state.logged:
                    state.logged = True
                    logger.warning(
                        "mooncake %s job %d aborted: %s", verb, job.job_id, outcome.unreachable
                    )
                if stop is _Stop.LATE:
                    return

        async def work(_pairs: Batch) -> dict[OffloadKey, str]:
            failed: dict[OffloadKey, str] = {}
            if lanes == 1:
                await lane(failed)
            else:
                async with anyio.create_task_group() as tg:
                    for _ in range(lanes):
                        tg.start_soon(lane, failed)
            if state.aborted is not None:
                why = f"not tried: {state.aborted}"
            else:
                why = f"mooncake {verb} did not finish within job_timeout={timeout}s"
            for batch in state.queue:  # batches no lane started
                failed.update((key, why) for key, _slot in batch)
            return failed

        result = await run_job(
            job,
            work,
            label=f"mooncake {verb}",
            concurrency=1,
            timeout=None,  # the lanes keep the deadline (`_lane`) and report late keys
            batches=[list(zip(job.keys, job.slots))] if job.keys else [],
        )
        if state.aborted is not None and not result.ok_keys and job.keys:
            raise TierUnavailable(state.aborted)
        return result

    async def _acquire(self, state: _JobState | None = None) -> None:
        """One of the tier's `concurrency` threads, counting who waits (a lane gives its
        turn back to them, unless they are lanes of its own job: `_lane`)."""
        try:
            self._threads.acquire_nowait()
        except anyio.WouldBlock:
            self._waiting += 1
            if state is not None:
                state.waiting += 1
            try:
                await self._threads.acquire()
            finally:
                self._waiting -= 1
                if state is not None:
                    state.waiting -= 1

    async def _in_thread(self, func: Callable[..., T], *args: Any) -> T:
        """`func(*args)` in one of the tier's threads (lookups, removes)."""
        await self._acquire()
        try:
            return await in_thread(func, *args, limiter=self._spare)
        finally:
            self._threads.release()

    def _lane(
        self, move: _Move, client: StoreClient, state: _JobState
    ) -> tuple[_Outcome, _Stop | None]:
        """Worker thread: move the job's batches from its queue, in order, until none is
        left or, between batches, until the job's deadline passed or it was cancelled
        (the batch in flight ends first: a load writes its slots from inside the
        binding), the job was aborted (the master did not answer: the batch that met
        it fails whole, the rest are not tried), or a call other than this job's own
        lanes waits for a thread (after one batch at least). What it did, and why it
        stopped early."""
        out = _Outcome()
        queue = state.queue
        first = True
        while True:
            if state.aborted is not None:
                return out, _Stop.ABORTED
            if state.past_deadline() or state.host_cancelled():
                return out, _Stop.LATE
            if not first and self._waiting > state.waiting:
                return out, _Stop.TURN
            try:
                batch = queue.popleft()
            except IndexError:
                return out, None
            first = False
            part = move(client, batch, state)
            out.removed += part.removed
            out.foreign += part.foreign
            if part.unreachable is not None:
                # as run_job's JobAborted: the batch fails whole, later ones are not tried
                out.unreachable = part.unreachable
                if state.aborted is None:
                    state.aborted = part.unreachable
                out.failed.update((key, part.unreachable) for key, _slot in batch)
                return out, _Stop.ABORTED
            out.failed.update(part.failed)

    def _layout(self, key: OffloadKey, slot: int) -> tuple[int, int]:
        """(header row address, slot address) of `slot`."""
        return (
            self._header_base + slot * HEADER_ROW,
            self._slab_base + slot * self.primary.block_bytes,
        )

    @property
    def _staging_part_bytes(self) -> int:
        """Staging bytes of one lane: a batch of blocks."""
        return self.config.batch_blocks * self.primary.block_bytes

    def _store_batch(self, client: StoreClient, batch: Batch, state: _JobState) -> _Outcome:
        """Worker thread: frame each block's header into its row and put the batch."""
        out = _Outcome()
        block_bytes = self.primary.block_bytes
        header_base, slab_base, rows = self._header_base, self._slab_base, self._rows
        prefix = self._names.prefix
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
            rows[row : row + len(header)] = header
            names.append(prefix + key.hex())
            pointers.append([header_base + row, slab_base + slot * block_bytes])
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

    def _load_batch(self, client: StoreClient, batch: Batch, state: _JobState) -> _Outcome:
        """Worker thread: get the batch into header rows and slots, then check each
        frame where it landed (`Framer.check_frame`: one unpack and compare per header,
        the payload's checksum, and the MAC where the tier has a key). Under an engine
        the payloads land in the lane's part of the staging arena and reach their pages
        only while the job is on time (`_copy_in`)."""
        out = _Outcome()
        block_bytes = self.primary.block_bytes
        header_base, slab_base, rows = self._header_base, self._slab_base, self._rows
        prefix = self._names.prefix
        framer = self.framer
        header_size = framer.header_bytes
        part = None
        if self._staging is not None:
            try:
                part = self._staging_parts.get_nowait()
            except queue.Empty:
                why = "not tried: every staging part is held by a transfer past its deadline"
                out.failed.update((key, why) for key, _slot in batch)
                return out
        try:
            if part is None or self._staging is None:
                landing = [slab_base + slot * block_bytes for _key, slot in batch]
                staged = None
            else:
                start = part * self._staging_part_bytes
                landing = [self._staging_base + start + i * block_bytes for i in range(len(batch))]
                staged = memoryview(self._staging)[start : start + self._staging_part_bytes]
            names = [prefix + key.hex() for key, _slot in batch]
            sizes = [[header_size(key), block_bytes] for key, _slot in batch]
            pointers = [
                [header_base + slot * HEADER_ROW, address]
                for (_key, slot), address in zip(batch, landing)
            ]
            codes = client.get_into(names, pointers, sizes)
            bad: list[tuple[OffloadKey, str]] = []
            arrived: list[tuple[OffloadKey, int, int]] = []  # key, page address, landing
            for i, ((key, slot), name, (size, _), code) in enumerate(
                zip(batch, names, sizes, codes)
            ):
                if staged is None:
                    dest = self.primary.block(slot)
                else:
                    dest = staged[i * block_bytes : (i + 1) * block_bytes]
                try:
                    if code == size + block_bytes:
                        row = slot * HEADER_ROW
                        framer.check_frame(rows[row : row + size], key, dest)
                    elif code == OBJECT_NOT_FOUND:
                        out.failed[key] = f"{name} is not in mooncake (evicted, expired or removed)"
                        out.removed.append(key)
                        continue
                    elif code == RPC_FAIL:
                        master = self.config.master
                        out.unreachable = f"mooncake master {master} did not answer a get"
                        out.failed[key] = out.unreachable
                        continue
                    elif code >= 0 or client.size_of(name) not in (-1, size + block_bytes):
                        # a value of another size than our frame (the get fails with
                        # INVALID_PARAMS or TRANSFER_FAIL): read it whole to judge it
                        framer.decode_into(key, client.get_bytes(name), dest)
                    else:
                        out.failed[key] = f"mooncake get of {name}: {describe_code(code)}"
                        continue
                except ForeignBlock as exc:
                    out.failed[key] = f"{name}: {exc}"
                    out.foreign.append(key)
                    continue
                except CorruptBlock as exc:
                    out.failed[key] = f"corrupt block deleted: {name}: {exc}"
                    bad.append((key, name))
                    continue
                if staged is not None:
                    arrived.append((key, slab_base + slot * block_bytes, landing[i]))
            if arrived:
                self._copy_in(arrived, state, out)
        finally:
            if part is not None:
                self._staging_parts.put(part)
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

    def _copy_in(
        self, arrived: list[tuple[OffloadKey, int, int]], state: _JobState, out: _Outcome
    ) -> None:
        """Worker thread: copy blocks checked in staging into their pages, each only
        while the job is on time (the engine answers a miss past the deadline and may
        hand the page out again: a block late here fails its key and writes nothing).
        The copies release the GIL (`ctypes.memmove`)."""
        late = f"mooncake load did not finish within job_timeout={self.config.job_timeout}s"
        cancelled = state.host_cancelled()
        block_bytes = self.primary.block_bytes
        for key, page, staged in arrived:
            if cancelled or state.past_deadline():
                out.failed[key] = late
                continue
            ctypes.memmove(page, staged, block_bytes)

    # -- lookup and remove ----------------------------------------------------------
    async def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[bool]:
        """One batched existence query. Raises TierUnavailable when the master does not
        answer; a key the store could not answer for counts as absent."""
        if not keys:
            return []
        async with self._inflight.job():
            client = self._require()
            names = [self._names.name(key) for key in keys]
            codes = await self._in_thread(client.exists, names)
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
            codes = await self._in_thread(client.remove, names)
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
            "staged_loads": self._staging is not None,
            "open": self._client is not None,
        }
