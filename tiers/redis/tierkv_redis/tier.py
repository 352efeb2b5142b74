"""`redis`: framed KV blocks in a Redis server or cluster, shared by many inference servers.

One block is one Redis value: the `tierkv.framing` header (format version, namespace,
key, length, checksum) followed by the block bytes, written with a single SET. A frame
larger than `part_size` is split into parts under one logical key (`names.py`); the
first part is written last, and a lookup sees a block only when every part exists, so
a half-written or half-evicted block is a miss, never a corrupt read.

Bytes read back are untrusted: a value failing any frame check (checksum, and the MAC
when `mac_key_env` is set) fails its key, is deleted and is `report_removed`; so is a
block a load finds gone (expired by `ttl`, evicted by Redis's maxmemory policy) or
half gone. Nothing is ever unpickled.

A job's blocks are sent as commands of `pipeline_size` (1 by default: concurrent single
commands, which beat pipelines for MiB-sized values), at most `max_connections` at a
time, by the contract's `run_job`. The first connection-level failure of a job
(refused, reset, timed out, auth) aborts it: every key not yet done fails with a
message naming the server, so a dead Redis answers a job within about
`socket_timeout`. The client reconnects by itself on the next job once Redis is back.

Stores and loads run whole in worker threads, one hop per batch: framing, checksums,
MACs, the copies that join a frame, and the network I/O itself through redis-py's
synchronous client (its own blocking connection pool of `max_connections`). On the
event loop they cost ~0.4 ms to frame and ~0.3 ms to check a 2 MiB block, plus the
asyncio client's own sends and reply parsing: 13-27 ms of stall per 64-block job, during
which no other request of the server progresses. Lookups and removals are small and
stay on the asyncio client.

A thread waiting on a frozen Redis cannot be interrupted, so a job at its deadline
leaves it behind (`IOThreads`): its socket timeout, at most
`job_timeout`, frees it soon after, and it touches the job's slots only under the job's
`SlotGuard`, which the job closes before it returns. A late store may still land in
Redis (as with any client whose command was sent); a late load never writes a slot.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeAlias

import anyio
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.client import Redis as SyncRedis
from redis.cluster import RedisCluster as SyncRedisCluster
from redis.connection import BlockingConnectionPool
from redis.exceptions import (
    AuthenticationError,
    ConnectionError,
    OutOfMemoryError,
    RedisClusterException,
    RedisError,
    ResponseError,
)
from redis.retry import Retry as SyncRetry

from tierkv.tier import (
    Batch,
    CorruptBlock,
    ForeignBlock,
    InFlightJobs,
    IOThreads,
    JobAborted,
    JobMetadata,
    JobResult,
    OffloadKey,
    PrimaryView,
    ReqContext,
    SecondaryTierManager,
    SlotGuard,
    TierConfig,
    TierUnavailable,
    detached,
    in_thread,
    run_job,
)
from tierkv_redis.config import RedisTierConfig
from tierkv_redis.names import BlockNames
from tierkv_redis.wire import pack_set, send_sets

logger = logging.getLogger(__name__)

Client: TypeAlias = Redis | RedisCluster
SyncClient: TypeAlias = SyncRedis | SyncRedisCluster
BatchOp: TypeAlias = Callable[[Client, Batch, SlotGuard], Awaitable[dict[OffloadKey, str]]]

# Bytes read from the socket per parser feed: redis-py's 64 KiB default costs about a
# third more CPU per MiB-sized GET than 256 KiB (measured, hiredis parser).
_SOCKET_READ_SIZE = 256 * 1024

# Errors that say "the server is not answering" rather than "this command failed".
# (A cluster client that cannot reach any node to refresh its topology raises
# RedisClusterException, which is not a RedisError.)
_UNREACHABLE = (RedisError, RedisClusterException, OSError, TimeoutError)


def _is_command_error(exc: BaseException) -> bool:
    """A per-command error (OOM, WRONGTYPE, ...): the server is up, this key failed."""
    return isinstance(exc, ResponseError)


def _command_error(exc: BaseException) -> str:
    if isinstance(exc, OutOfMemoryError):
        return f"redis is out of memory (maxmemory reached, nothing evictable): {exc}"
    return f"redis refused the command: {type(exc).__name__}: {exc}"


class RedisTier(SecondaryTierManager):
    """Blocks in Redis: one framed value per block, shared across processes and machines."""

    Config = RedisTierConfig
    config: RedisTierConfig
    shared_storage = True

    def __init__(self, config: TierConfig, primary: PrimaryView) -> None:
        super().__init__(config, primary)
        self._names = BlockNames(
            self.config.key_prefix,
            primary.namespace,
            primary.block_bytes,
            int(self.config.part_size),
            mac=self.framer.mac,
        )
        ttl = self.config.ttl
        self._ttl_ms: int | None = None if ttl is None else max(1, round(ttl * 1000))
        self._client: Client | None = None  # lookups, removals, deletions
        self._sync: SyncClient | None = None  # stores and loads, in worker threads
        # commands in flight across all jobs and lookups of this tier; never more
        # than the connection pool holds
        self._gate: anyio.Semaphore | None = None
        # one worker thread per connection (a thread holds its connection for its
        # batch); made by open(), let go by close()
        self._threads: IOThreads | None = None
        self._inflight = InFlightJobs(self.name)

    @staticmethod
    def get_tier_type() -> str:
        return "redis"

    def __repr__(self) -> str:
        return f"RedisTier({self.config.safe_url!r}, prefix={self._names.prefix!r})"

    # -- life cycle -----------------------------------------------------------------
    def _make_client(self) -> Client:
        c = self.config
        kwargs: dict[str, Any] = {
            "max_connections": c.max_connections,
            "socket_timeout": c.socket_timeout,
            "socket_connect_timeout": c.socket_timeout,
            "socket_read_size": _SOCKET_READ_SIZE,
            # one immediate retry on a fresh connection absorbs a pooled connection
            # that a Redis restart closed; timeouts are not retried (they would
            # double the time a dead server takes to fail a job)
            "retry": Retry(NoBackoff(), 1, supported_errors=(ConnectionError,)),
        }
        if c.password is not None:
            kwargs["password"] = c.password.get_secret_value()
        if c.cluster:
            return RedisCluster.from_url(c.url, **kwargs)
        return Redis.from_url(c.url, **kwargs)

    def _make_sync_client(self) -> SyncClient:
        """Worker thread (a cluster client connects while it is made): the synchronous
        client of stores and loads. Its socket timeout is at most `job_timeout`: a
        thread a job left behind on a frozen server is freed about when the job was."""
        c = self.config
        timeout = min(c.socket_timeout, c.job_timeout)
        kwargs: dict[str, Any] = {
            "max_connections": c.max_connections,
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            # as the asyncio client: one immediate retry of a connection a restart
            # closed, none of a timeout
            "retry": SyncRetry(NoBackoff(), 1, supported_errors=(ConnectionError,)),
        }
        if c.password is not None:
            kwargs["password"] = c.password.get_secret_value()
        if c.cluster:
            return SyncRedisCluster.from_url(c.url, **kwargs)
        pool = BlockingConnectionPool.from_url(
            c.url,
            # a thread waits this long for a connection that threads a job left
            # behind on a frozen server still hold
            timeout=timeout,
            socket_read_size=_SOCKET_READ_SIZE,
            **kwargs,
        )
        return SyncRedis(connection_pool=pool)

    async def open(self) -> None:
        """Connect and PING. Raises TierUnavailable when Redis is unreachable or
        refuses the credentials; the tier may be opened again later."""
        if self._client is not None:
            return
        self._inflight.closing = False
        client = self._make_client()
        try:
            with anyio.fail_after(self.config.socket_timeout * 2):
                if isinstance(client, RedisCluster):
                    await client.initialize()
                await client.ping()
                sync = await in_thread(self._make_sync_client)
        except AuthenticationError as exc:
            await client.aclose()
            raise TierUnavailable(
                f"redis at {self.config.safe_url} refused the credentials ({exc}); "
                "check the password in the tier's `url` or `password`"
            ) from None
        except Exception as exc:
            await client.aclose()
            raise TierUnavailable(
                f"redis at {self.config.safe_url} is unreachable: {type(exc).__name__}: {exc}"
            ) from None
        self._client = client
        self._sync = sync
        self._threads = IOThreads(self.config.max_connections, f"tierkv-{self.name}")
        self._gate = anyio.Semaphore(self.config.max_connections)
        logger.info("redis tier open: %s, names %s*", self.config.safe_url, self._names.prefix)

    async def close(self) -> None:
        await self._inflight.drain()
        client, self._client = self._client, None
        sync, self._sync = self._sync, None
        threads, self._threads = self._threads, None
        if threads is not None:
            threads.close()
        if client is not None:
            await client.aclose()
        if sync is not None:
            await in_thread(sync.close)

    def _require_client(self) -> tuple[Client, anyio.Semaphore]:
        if self._inflight.closing:
            raise TierUnavailable(f"tier {self.name!r} is closed")
        if self._client is None or self._gate is None:
            raise TierUnavailable(f"tier {self.name!r} is not open; call open() first")
        return self._client, self._gate

    def _unreachable(self, exc: BaseException) -> str:
        if isinstance(exc, AuthenticationError):
            return f"redis at {self.config.safe_url} refused the credentials: {exc}"
        return f"redis at {self.config.safe_url} unreachable: {type(exc).__name__}: {exc}"

    # -- jobs -----------------------------------------------------------------------
    def _plan(self, job: JobMetadata) -> list[Batch]:
        """Group a job's (key, slot) pairs into batches, one pipeline (or command) each.
        A block in several parts always gets a batch of its own, so its parts go
        down one connection in order."""
        size = self.config.pipeline_size
        batches: list[Batch] = []
        current: list[tuple[OffloadKey, int]] = []
        for key, slot in zip(job.keys, job.slots):
            if self._names.parts_of(key) > 1:
                batches.append([(key, slot)])
                continue
            current.append((key, slot))
            if len(current) >= size:
                batches.append(current)
                current = []
        if current:
            batches.append(current)
        return batches

    async def _run_job(self, job: JobMetadata, op: BatchOp, verb: str) -> JobResult:
        client, gate = self._require_client()
        guard = SlotGuard()

        cluster = isinstance(client, RedisCluster)

        async def work(batch: Batch) -> dict[OffloadKey, str]:
            try:
                async with gate:
                    return await op(client, batch, guard)
            except _UNREACHABLE as exc:
                if cluster:  # one node (this batch's slot owner), not the tier
                    reason = self._unreachable(exc)
                    return {key: reason for key, _ in batch}
                raise JobAborted(self._unreachable(exc)) from None  # the server: abort

        try:
            return await run_job(
                job,
                work,
                label=f"redis {verb}",
                concurrency=self.config.max_connections,
                timeout=self.config.job_timeout,
                batches=self._plan(job),
            )
        finally:
            guard.close()  # threads left behind by the deadline touch no slot from now on

    # -- stores and loads: one worker-thread hop per batch, I/O included ------------
    def _sync_client(self) -> tuple[SyncClient, IOThreads]:
        if self._sync is None or self._threads is None:
            raise TierUnavailable(f"tier {self.name!r} is not open; call open() first")
        return self._sync, self._threads

    async def store(self, job: JobMetadata) -> JobResult:
        async with self._inflight.job():
            return await self._run_job(job, self._store_batch, "store")

    async def _store_batch(
        self, client: Client, batch: Batch, guard: SlotGuard
    ) -> dict[OffloadKey, str]:
        sync, threads = self._sync_client()
        return await threads.run(self._store_in_thread, sync, batch, guard)

    def _store_in_thread(
        self, sync: SyncClient, batch: Batch, guard: SlotGuard
    ) -> dict[OffloadKey, str]:
        """Worker thread: frame each block of `batch` (reading its slot while the job
        lives) and SET it; the keys Redis refused, with the reason."""
        px = self._ttl_ms
        ended = {key: "redis store: the job ended before this block was read" for key, _ in batch}
        if isinstance(sync, SyncRedis):
            packed: list[bytes] = []
            owners: list[OffloadKey] = []  # which key each packed command belongs to
            for key, slot in batch:
                with guard.hold() as alive:
                    if not alive:
                        return ended
                    payload = self.primary.block(slot)
                    header = self.framer.encode_header(key, payload)
                    block_commands = self._pack_block(key, header, payload, px)
                    # the slot's view must not outlive the guard: the send below may
                    # outlast the job (an abandoned thread) and the slab's owner
                    # cannot unmap it while any view of it lives
                    del payload
                packed.extend(block_commands)
                owners.extend([key] * len(block_commands))
            outcomes = send_sets(sync.connection_pool, packed)
            refused: dict[OffloadKey, str] = {}
            for key, exc in zip(owners, outcomes):
                if exc is not None and key not in refused:
                    refused[key] = _command_error(exc)
            return refused
        frames = []
        for key, slot in batch:
            with guard.hold() as alive:
                if not alive:
                    return ended
                frames.append(self.framer.encode(key, self.primary.block(slot)))
        pipe = sync.pipeline(transaction=False)  # type: ignore[no-untyped-call]
        commands: list[OffloadKey] = []  # which key each queued command belongs to
        for (key, _slot), whole in zip(batch, frames):
            names = self._names.all(key)
            frame = memoryview(whole)
            bounds = self._names.part_bounds(key)
            # later parts first, the main name last: a block becomes visible to
            # lookups only when all of it is there
            for i in (*range(1, len(names)), 0):
                start, end = bounds[i]
                pipe.set(names[i], frame[start:end], px=px)
                commands.append(key)
        results = pipe.execute(raise_on_error=False)
        errors: dict[OffloadKey, str] = {}
        for key, result in zip(commands, results):
            if isinstance(result, BaseException) and key not in errors:
                if not _is_command_error(result):
                    raise result
                errors[key] = _command_error(result)
        return errors

    def _pack_block(
        self, key: OffloadKey, header: bytes, payload: memoryview, px: int | None
    ) -> list[bytes]:
        """The packed SETs of one block: one command, or one per part with the later
        parts first and the main name (header and first bytes) last, so a lookup sees
        the block only once all of it is there. Each command is one exact `bytes`: the
        payload is copied once, into it."""
        names = self._names.all(key)
        if len(names) == 1:
            return [pack_set(names[0].encode(), header, payload, px)]
        skip = len(header)  # frame offsets -> payload offsets
        bounds = self._names.part_bounds(key)
        commands = [
            pack_set(names[i].encode(), b"", payload[start - skip : end - skip], px)
            for i, (start, end) in enumerate(bounds)
            if i
        ]
        first_end = bounds[0][1]
        commands.append(pack_set(names[0].encode(), header, payload[: first_end - skip], px))
        return commands

    async def load(self, job: JobMetadata) -> JobResult:
        async with self._inflight.job():
            return await self._run_job(job, self._load_batch, "load")

    async def _load_batch(
        self, client: Client, batch: Batch, guard: SlotGuard
    ) -> dict[OffloadKey, str]:
        sync, threads = self._sync_client()
        errors, doomed, gone = await threads.run(self._load_in_thread, sync, batch, guard)
        if doomed:
            try:
                await self._unlink(client, doomed)
            except _UNREACHABLE as exc:  # the loads themselves are done; just say so
                logger.warning("redis: could not delete %d bad blocks: %s", len(doomed), exc)
        # gone, or deleted here: either way this tier no longer holds them
        self.report_removed([*gone, *(k for k in doomed if k not in gone)])
        return errors

    def _load_in_thread(
        self, sync: SyncClient, batch: Batch, guard: SlotGuard
    ) -> tuple[dict[OffloadKey, str], list[OffloadKey], list[OffloadKey]]:
        """Worker thread: GET each block of `batch`, check its frame and copy its payload
        into its slot while the job lives. Returns (failed keys with the reason, keys
        whose stored values must be deleted, keys Redis no longer has)."""
        values: list[Any]
        if len(batch) == 1 and self._names.parts_of(batch[0][0]) == 1:
            name = self._names.main(batch[0][0])
            try:
                if self._ttl_ms is None:
                    values = [sync.get(name)]
                else:
                    values = [sync.getex(name, px=self._ttl_ms)]
            except ResponseError as exc:
                values = [exc]
        else:
            pipe = sync.pipeline(transaction=False)
            for key, _ in batch:
                for name in self._names.all(key):
                    self._queue_get(pipe, name)
            values = pipe.execute(raise_on_error=False)
        errors: dict[OffloadKey, str] = {}
        doomed: list[OffloadKey] = []  # keys whose stored values must go
        gone: list[OffloadKey] = []  # keys Redis no longer has (expired, evicted)
        at = 0
        for key, slot in batch:
            count = self._names.parts_of(key)
            parts = values[at : at + count]
            at += count
            bad = next((p for p in parts if isinstance(p, BaseException)), None)
            if bad is not None:
                if not _is_command_error(bad):
                    raise bad
                errors[key] = _command_error(bad)
                continue
            if parts[0] is None:
                errors[key] = "not in redis"
                gone.append(key)
                if count > 1 and any(p is not None for p in parts):
                    doomed.append(key)
                continue
            if any(p is None for p in parts):
                missing = sum(p is None for p in parts)
                errors[key] = f"{missing} of {count} parts missing (evicted or expired); deleted"
                doomed.append(key)
                continue
            with guard.hold() as alive:
                if not alive:
                    errors[key] = "redis load: the job ended before this block was written"
                    continue
                try:
                    if count == 1:
                        self.framer.decode_into(key, parts[0], self.primary.block(slot))
                    else:  # straight from the parts into the slot, no joined copy
                        self.framer.decode_parts_into(key, parts, self.primary.block(slot))
                except ForeignBlock as exc:  # another trust domain's block: left in place
                    errors[key] = f"not this server's block: {exc}"
                    self.report_foreign([key])
                except CorruptBlock as exc:
                    errors[key] = f"corrupt block deleted: {exc}"
                    doomed.append(key)
        return errors, doomed, gone

    def _queue_get(self, pipe: Any, name: str) -> None:
        if self._ttl_ms is None:
            pipe.get(name)
        else:  # a hit keeps the block alive for another ttl
            pipe.getex(name, px=self._ttl_ms)

    async def _unlink(self, client: Client, keys: Sequence[OffloadKey]) -> None:
        pipe = client.pipeline(transaction=False)
        for key in keys:
            # execute_command, not pipe.unlink: a cluster pipeline's unlink() is a
            # coroutine that splits keys by slot; one block is one slot anyway
            pipe.execute_command("UNLINK", *self._names.all(key))
        await pipe.execute(raise_on_error=True)

    # -- lookup and remove ----------------------------------------------------------
    async def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[bool]:
        """Pipelined EXISTS over every part of each block; raises TierUnavailable
        when Redis does not answer."""
        if not keys:
            return []
        async with self._inflight.job():
            client, gate = self._require_client()
            answer = [False] * len(keys)
            problems: list[BaseException] = []
            orphans: list[OffloadKey] = []  # split blocks whose main value lost a part
            step = self.config.lookup_batch
            # on a cluster, one pipeline per slot owner: a dead node costs its keys only
            groups = self._by_node(client, keys, step)
            failed_groups: list[BaseException] = []

            async def run(lo: int, indices: list[int] | None = None) -> None:
                async with gate:
                    if problems:
                        return
                    pipe = client.pipeline(transaction=False)
                    counts = []
                    chosen = keys[lo : lo + step] if indices is None else [keys[i] for i in indices]
                    for key in chosen:
                        names = self._names.all(key)
                        pipe.execute_command("EXISTS", *names)
                        counts.append(len(names))
                        if len(names) > 1:  # and the main value on its own
                            pipe.execute_command("EXISTS", names[0])
                    try:
                        found = await pipe.execute()
                    except _UNREACHABLE as exc:
                        if indices is not None:  # this node's keys stay misses
                            failed_groups.append(detached(exc))
                            return
                        problems.append(detached(exc))
                        return
                at = 0
                for i, need in enumerate(counts):
                    where = lo + i if indices is None else indices[i]
                    have = found[at]
                    at += 1
                    if need > 1:
                        # the main value is written last: with it there and a part
                        # gone, the part was evicted or expired and the rest is an
                        # orphan (parts without their main may be a store in progress)
                        if found[at] and have < need:
                            orphans.append(keys[where])
                        at += 1
                    answer[where] = have == need

            with anyio.move_on_after(self.config.job_timeout) as scope:
                async with anyio.create_task_group() as tg:
                    if groups is None:
                        for lo in range(0, len(keys), step):
                            tg.start_soon(run, lo)
                    else:
                        for indices in groups:
                            tg.start_soon(run, 0, indices)
            if groups is not None and failed_groups:
                if len(failed_groups) == len(groups):  # every node: the tier is down
                    problems.append(failed_groups[0])
                else:
                    logger.warning(
                        "redis cluster: %d of %d node groups unreachable, their keys "
                        "count as misses: %s",
                        len(failed_groups),
                        len(groups),
                        self._unreachable(failed_groups[0]),
                    )
            if problems:
                raise TierUnavailable(f"lookup failed: {self._unreachable(problems[0])}")
            if scope.cancelled_caught:
                raise TierUnavailable(
                    f"lookup in redis at {self.config.safe_url} did not finish within "
                    f"job_timeout={self.config.job_timeout}s"
                )
            if orphans:
                await self._remove_orphans(client, gate, orphans)
            return answer

    def _by_node(
        self, client: Client, keys: Sequence[OffloadKey], step: int
    ) -> list[list[int]] | None:
        """On a cluster, key indices grouped by the node owning their slot (at most
        `step` a group); None on a single server."""
        if not isinstance(client, RedisCluster):
            return None
        by_node: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            node = client.get_node_from_key(self._names.main(key))
            by_node.setdefault("?" if node is None else node.name, []).append(i)
        return [g[lo : lo + step] for g in by_node.values() for lo in range(0, len(g), step)]

    async def _remove_orphans(
        self, client: Client, gate: anyio.Semaphore, keys: list[OffloadKey]
    ) -> None:
        """Delete what is left of split blocks that lost a part (best effort, within
        `socket_timeout`), so their other parts do not hold memory until TTL or
        eviction; they are gone for this tier either way."""
        with anyio.move_on_after(self.config.socket_timeout):
            try:
                async with gate:
                    await self._unlink(client, keys)
            except _UNREACHABLE as exc:
                logger.warning("redis: could not delete %d partial blocks: %s", len(keys), exc)
        self.report_removed(keys)

    async def remove(self, keys: Sequence[OffloadKey]) -> None:
        if not keys:
            return
        async with self._inflight.job():
            client, gate = self._require_client()
            try:
                async with gate:
                    with anyio.fail_after(self.config.job_timeout):
                        await self._unlink(client, keys)
            except _UNREACHABLE as exc:  # includes the TimeoutError of fail_after
                raise TierUnavailable(f"remove failed: {self._unreachable(exc)}") from None

    def describe(self) -> dict[str, Any]:
        c = self.config
        return {
            "type": "redis",
            "url": c.safe_url,
            "cluster": c.cluster,
            "names": f"{self._names.prefix}*",
            "ttl": c.ttl,
            "max_connections": c.max_connections,
            "pipeline_size": c.pipeline_size,
            "part_size": int(c.part_size),
            "mac": self.framer.mac,
            "open": self._client is not None,
        }
