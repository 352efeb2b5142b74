"""`redis`: framed KV blocks in a Redis server or cluster, shared by many inference servers.

One block is one Redis value: the `tierkv.contract.framing` header (format version, namespace,
key, length, checksum) followed by the block bytes, written with a single SET. A frame
larger than `part_size` is split into parts under one logical key (`names.py`); the
first part is written last, and a lookup sees a block only when every part exists, so
a half-written or half-evicted block is a miss, never a corrupt read.

Bytes read back are untrusted: a value failing any frame check (checksum, and the MAC
when `mac_key_env` is set) fails its key, is deleted and is `report_removed`; so is a
block a load finds gone (expired by `ttl`, evicted by Redis's maxmemory policy) or
half gone. Nothing is ever unpickled.

A job's blocks are sent in pipelines of `pipeline_size` commands (`auto`: blocks under
1 MiB in pipelines of about 2 MiB; MiB-sized blocks as concurrent single commands,
which beat pipelines for them), at most `max_connections` at a
time, by the contract's `run_job`. The first connection-level failure of a job
(refused, reset, timed out, auth) aborts it: every key not yet done fails with a
message naming the server, so a dead Redis answers a job within about
`socket_timeout`. The client reconnects by itself on the next job once Redis is back.

On a Redis Cluster (`cluster: true`) failures are per node instead (`cluster.py`):
lookups and jobs are split by the node serving each block's slot and sent to that
node's own clients, with the same single-server code per node. A node that fails
opens its breaker (`nodes.py`): its keys are misses and failed keys, naming it, until
a probe finds it back, while the other nodes' keys are served. Only when every node is
down does a lookup raise `TierUnavailable` and a job abort, so the cache's own breaker
still sees a dead Redis.

Stores and loads run whole in worker threads, one hop per batch: framing, checksums,
MACs, the copies that join a frame, and the network I/O itself over connections of
redis-py's blocking pool of `max_connections` (stores send packed SETs, `wire.py`;
loads read the values off the socket into a reused buffer, `gets.py`). On the
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

import itertools
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeAlias
from urllib.parse import urlsplit, urlunsplit

import anyio
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.client import Redis as SyncRedis
from redis.connection import BlockingConnectionPool
from redis.exceptions import (
    AskError,
    AuthenticationError,
    ClusterDownError,
    ConnectionError,
    OutOfMemoryError,
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
from tierkv_redis.cluster import MOVED_NOTE, ClusterNodes, Node, is_node_down
from tierkv_redis.config import RedisTierConfig, pipeline_blocks
from tierkv_redis.gets import pack_get, read_values
from tierkv_redis.names import BlockNames
from tierkv_redis.wire import pack_set, send_sets

logger = logging.getLogger(__name__)

# one server, or one node of a cluster: the cluster's routing is the tier's own
Client: TypeAlias = Redis
SyncClient: TypeAlias = SyncRedis
BatchOp: TypeAlias = Callable[
    [Client, SyncClient, Batch, SlotGuard], Awaitable[dict[OffloadKey, str]]
]

# Bytes read from the socket per parser feed: redis-py's 64 KiB default costs about a
# third more CPU per MiB-sized GET than 256 KiB (measured, hiredis parser).
_SOCKET_READ_SIZE = 256 * 1024

# Errors that say "the server is not answering" rather than "this command failed".
_UNREACHABLE = (RedisError, OSError, TimeoutError)


def _is_command_error(exc: BaseException) -> bool:
    """A per-command error (OOM, WRONGTYPE, MOVED, ...): the server is up, this key
    failed. CLUSTERDOWN is not: the node refuses every key, as if it were down."""
    return isinstance(exc, ResponseError) and not isinstance(exc, ClusterDownError)


def _command_error(exc: BaseException) -> str:
    if isinstance(exc, OutOfMemoryError):
        return f"redis is out of memory (maxmemory reached, nothing evictable): {exc}"
    if isinstance(exc, AskError):  # MOVED or ASK: the tier's slot map is out of date
        return f"{MOVED_NOTE}: slot {exc.slot_id} is served by {exc.host}:{exc.port} now"
    return f"redis refused the command: {type(exc).__name__}: {exc}"


class _NodeBatch(list[tuple[OffloadKey, int]]):
    """A batch of a cluster job: blocks of one shard, read from or written to `node`
    (its master, or a replica for a load with `read_from_replicas`); `master` deletes
    what a load found damaged. Both None: no node serves the blocks' slot."""

    def __init__(self, node: Node | None, master: Node | None) -> None:
        super().__init__()
        self.node = node
        self.master = master


def _with_address(url: str, host: str, port: int) -> str:
    """`url` (credentials, options) naming another host and port: a cluster node's."""
    parts = urlsplit(url)
    credentials, at, _address = parts.netloc.rpartition("@")
    host = f"[{host}]" if ":" in host else host
    return urlunsplit(parts._replace(netloc=f"{credentials}{at}{host}:{port}"))


def _readonly(connection: Any) -> None:
    """Connect hook with `read_from_replicas`: READONLY after the usual handshake, so a
    replica serves reads of its slots (a master ignores it)."""
    connection.on_connect()
    connection.send_command("READONLY")
    if connection.read_response() not in (b"OK", "OK"):
        raise ConnectionError("READONLY was refused")


async def _readonly_async(connection: Any) -> None:
    await connection.on_connect()
    await connection.send_command("READONLY")
    if await connection.read_response() not in (b"OK", "OK"):
        raise ConnectionError("READONLY was refused")


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
        self._pipeline = pipeline_blocks(self.config.pipeline_size, primary.block_bytes)
        self._client: Client | None = None  # lookups, removals, deletions
        self._sync: SyncClient | None = None  # stores and loads, in worker threads
        self._cluster: ClusterNodes | None = None  # on a cluster, both per node instead
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
    def _make_client(self, url: str) -> Client:
        """The asyncio client of lookups and removals for the server (or cluster
        node) at `url`."""
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
        if c.read_from_replicas:
            kwargs["redis_connect_func"] = _readonly_async
        return Redis.from_url(url, **kwargs)

    def _make_sync_client(self, url: str) -> SyncClient:
        """The synchronous client of stores and loads for the server (or cluster node)
        at `url`; connects nothing yet. Its socket timeout is at most `job_timeout`: a
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
        if c.read_from_replicas:
            kwargs["redis_connect_func"] = _readonly
        pool = BlockingConnectionPool.from_url(
            url,
            # a thread waits this long for a connection that threads a job left
            # behind on a frozen server still hold
            timeout=timeout,
            socket_read_size=_SOCKET_READ_SIZE,
            **kwargs,
        )
        return SyncRedis(connection_pool=pool)

    def _node_clients(self, host: str, port: int) -> tuple[Client, SyncClient]:
        """Both clients of one cluster node: the tier's URL (credentials, TLS options)
        with the node's address."""
        url = _with_address(self.config.url, host, port)
        return self._make_client(url), self._make_sync_client(url)

    async def open(self) -> None:
        """Connect and PING; on a cluster, read the slot map from the node the URL
        names. Raises TierUnavailable when Redis is unreachable, refuses the
        credentials, or is no cluster node while `cluster` says it is; the tier may be
        opened again later."""
        if self._client is not None or self._cluster is not None:
            return
        self._inflight.closing = False
        c = self.config
        client: Client | None = None
        sync: SyncClient | None = None
        nodes: ClusterNodes | None = None
        try:
            with anyio.fail_after(c.socket_timeout * 2):
                if c.cluster:
                    parts = urlsplit(c.url)
                    nodes = ClusterNodes(
                        parts.hostname or "127.0.0.1",
                        parts.port or 6379,
                        self._node_clients,
                        probe_after=c.recovery_after,
                        read_from_replicas=c.read_from_replicas,
                    )
                    await nodes.open()
                else:
                    client = self._make_client(c.url)
                    await client.ping()
                    sync = await in_thread(self._make_sync_client, c.url)
        except Exception as exc:
            if client is not None:
                await client.aclose()
            if nodes is not None:
                await nodes.close()
            raise TierUnavailable(self._open_error(exc)) from None
        self._client, self._sync, self._cluster = client, sync, nodes
        self._threads = IOThreads(c.max_connections, f"tierkv-{self.name}")
        self._gate = anyio.Semaphore(c.max_connections)
        where = f"cluster nodes {', '.join(nodes.summary())}" if nodes is not None else c.safe_url
        logger.info("redis tier open: %s, names %s*", where, self._names.prefix)

    def _open_error(self, exc: BaseException) -> str:
        url = self.config.safe_url
        if isinstance(exc, AuthenticationError):
            return (
                f"redis at {url} refused the credentials ({exc}); "
                "check the password in the tier's `url` or `password`"
            )
        if self.config.cluster and isinstance(exc, ResponseError):  # to CLUSTER SLOTS
            return (
                f"redis at {url} is not a Redis Cluster node ({exc}); "
                "set `cluster: false` for a single server"
            )
        return f"redis at {url} is unreachable: {type(exc).__name__}: {exc}"

    async def close(self) -> None:
        await self._inflight.drain()
        client, self._client = self._client, None
        sync, self._sync = self._sync, None
        nodes, self._cluster = self._cluster, None
        threads, self._threads = self._threads, None
        if threads is not None:
            threads.close()
        if client is not None:
            await client.aclose()
        if sync is not None:
            await in_thread(sync.close)
        if nodes is not None:
            await nodes.close()

    def _require_client(self) -> tuple[Client, anyio.Semaphore]:
        if self._inflight.closing:
            raise TierUnavailable(f"tier {self.name!r} is closed")
        if self._client is None or self._gate is None:
            raise TierUnavailable(f"tier {self.name!r} is not open; call open() first")
        return self._client, self._gate

    def _require_nodes(self) -> tuple[ClusterNodes, anyio.Semaphore]:
        if self._inflight.closing:
            raise TierUnavailable(f"tier {self.name!r} is closed")
        if self._cluster is None or self._gate is None:
            raise TierUnavailable(f"tier {self.name!r} is not open; call open() first")
        return self._cluster, self._gate

    def _unreachable(self, exc: BaseException) -> str:
        if isinstance(exc, AuthenticationError):
            return f"redis at {self.config.safe_url} refused the credentials: {exc}"
        return f"redis at {self.config.safe_url} unreachable: {type(exc).__name__}: {exc}"

    def _client_for(self, name: str) -> Client:
        """The asyncio client of the server, or cluster master, that holds the stored
        name `name` (for tests and tools)."""
        if self._cluster is not None:
            shard = self._cluster.shard(name)
            if shard:
                return shard[0].client
        client, _gate = self._require_client()
        return client

    # -- jobs -----------------------------------------------------------------------
    def _plan(self, job: JobMetadata) -> list[Batch]:
        return self._batches(zip(job.keys, job.slots))

    def _batches(self, pairs: Iterable[tuple[OffloadKey, int]]) -> list[Batch]:
        """Group (key, slot) pairs into batches, one pipeline (or command) each. A
        block in several parts always gets a batch of its own, so its parts go down
        one connection in order."""
        size = self._pipeline
        batches: list[Batch] = []
        current: list[tuple[OffloadKey, int]] = []
        for key, slot in pairs:
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
        if self.config.cluster:
            return await self._run_cluster_job(job, op, verb)
        client, gate = self._require_client()
        sync = self._sync
        if sync is None:
            raise TierUnavailable(f"tier {self.name!r} is not open; call open() first")
        guard = SlotGuard()

        async def work(batch: Batch) -> dict[OffloadKey, str]:
            try:
                async with gate:
                    return await op(client, sync, batch, guard)
            except _UNREACHABLE as exc:  # the server, not this batch: abort the job
                raise JobAborted(self._unreachable(exc)) from None

        return await self._run_batches(job, work, verb, self._plan(job), guard)

    def _plan_by_node(self, nodes: ClusterNodes, job: JobMetadata, *, read: bool) -> list[Batch]:
        """A cluster job's batches: each of one node's blocks (read from a replica when
        `read_from_replicas` allows), the nodes' batches interleaved so that every node
        works at once. Blocks whose slot no node serves form batches of no node."""
        groups: dict[str, tuple[Node | None, Node | None, list[tuple[OffloadKey, int]]]] = {}
        for key, slot in zip(job.keys, job.slots):
            shard = nodes.shard(self._names.main(key))
            if not shard:
                groups.setdefault("", (None, None, []))[2].append((key, slot))
                continue
            # a load that renews the ttl (GETEX) writes: the master only
            to = nodes.reader(shard) if read and self._ttl_ms is None else shard[0]
            groups.setdefault(to.name, (to, shard[0], []))[2].append((key, slot))
        per_node = []
        for node, master, pairs in groups.values():
            batches = []
            for plain in self._batches(pairs):
                batch = _NodeBatch(node, master)
                batch.extend(plain)
                batches.append(batch)
            per_node.append(batches)
        return [b for turn in itertools.zip_longest(*per_node) for b in turn if b is not None]

    async def _run_cluster_job(self, job: JobMetadata, op: BatchOp, verb: str) -> JobResult:
        """A job on a cluster: each batch goes to its own node; a node that fails (or
        whose breaker is open) fails its batches' keys, naming it, and the job goes on
        with the other nodes unless none is left."""
        nodes, gate = self._require_nodes()
        await nodes.refresh_if_due()
        guard = SlotGuard()

        async def work(batch: Batch) -> dict[OffloadKey, str]:
            assert isinstance(batch, _NodeBatch)
            node, master = batch.node, batch.master
            if node is None or master is None:
                why = "no node of the redis cluster serves this block's slot"
                return {key: why for key, _ in batch}
            why = ""
            # a read from a replica that is down is read from the master instead (a
            # load writes a slot only after all its reads came back: safe to repeat)
            for target in (node,) if node is master else (node, master):
                if not target.breaker.allow():
                    why = target.breaker.explain()
                    continue
                try:
                    async with gate:
                        errors = await op(master.client, target.sync, batch, guard)
                except _UNREACHABLE as exc:  # this node, not the job
                    why = nodes.failed(target, exc)
                    continue
                except BaseException:
                    target.breaker.abandon()
                    raise
                target.breaker.succeeded()
                if any(reason.startswith(MOVED_NOTE) for reason in errors.values()):
                    nodes.mark_stale()
                return errors
            if await nodes.every_node_down():
                raise JobAborted(nodes.down_message())
            return {key: why for key, _ in batch}

        batches = self._plan_by_node(nodes, job, read=verb == "load")
        return await self._run_batches(job, work, verb, batches, guard)

    async def _run_batches(
        self,
        job: JobMetadata,
        work: Callable[[Batch], Awaitable[dict[OffloadKey, str]]],
        verb: str,
        batches: list[Batch],
        guard: SlotGuard,
    ) -> JobResult:
        """The contract's `run_job` over `batches`, then the job's slots closed to any
        thread its deadline left behind."""
        try:
            return await run_job(
                job,
                work,
                label=f"redis {verb}",
                concurrency=self.config.max_connections,
                timeout=self.config.job_timeout,
                batches=batches,
            )
        finally:
            guard.close()  # threads left behind by the deadline touch no slot from now on

    # -- stores and loads: one worker-thread hop per batch, I/O included ------------
    def _io_threads(self) -> IOThreads:
        if self._threads is None:
            raise TierUnavailable(f"tier {self.name!r} is not open; call open() first")
        return self._threads

    async def store(self, job: JobMetadata) -> JobResult:
        async with self._inflight.job():
            return await self._run_job(job, self._store_batch, "store")

    async def _store_batch(
        self, client: Client, sync: SyncClient, batch: Batch, guard: SlotGuard
    ) -> dict[OffloadKey, str]:
        return await self._io_threads().run(self._store_in_thread, sync, batch, guard)

    def _store_in_thread(
        self, sync: SyncClient, batch: Batch, guard: SlotGuard
    ) -> dict[OffloadKey, str]:
        """Worker thread: frame each block of `batch` (reading its slot while the job
        lives) and SET it; the keys Redis refused, with the reason."""
        px = self._ttl_ms
        ended = {key: "redis store: the job ended before this block was read" for key, _ in batch}
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
                if not _is_command_error(exc):  # CLUSTERDOWN: the node, not this key
                    raise exc
                refused[key] = _command_error(exc)
        return refused

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
        self, client: Client, sync: SyncClient, batch: Batch, guard: SlotGuard
    ) -> dict[OffloadKey, str]:
        """`sync` reads (a replica's client with `read_from_replicas`), `client` deletes
        what failed its checks (the server's, or the master's)."""
        threads = self._io_threads()
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
        px = self._ttl_ms  # GETEX renews the ttl of a block read
        names = [name for key, _ in batch for name in self._names.all(key)]
        values = read_values(sync.connection_pool, [pack_get(n.encode(), px) for n in names])
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
            frames = [p for p in parts if isinstance(p, bytes | memoryview)]  # all of them
            with guard.hold() as alive:
                if not alive:
                    errors[key] = "redis load: the job ended before this block was written"
                    continue
                try:
                    if count == 1:
                        self.framer.decode_into(key, frames[0], self.primary.block(slot))
                    else:  # straight from the parts into the slot, no joined copy
                        self.framer.decode_parts_into(key, frames, self.primary.block(slot))
                except ForeignBlock as exc:  # another trust domain's block: left in place
                    errors[key] = f"not this server's block: {exc}"
                    self.report_foreign([key])
                except CorruptBlock as exc:
                    errors[key] = f"corrupt block deleted: {exc}"
                    doomed.append(key)
        return errors, doomed, gone

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
        when Redis (on a cluster: every node) does not answer."""
        if not keys:
            return []
        async with self._inflight.job():
            if self.config.cluster:
                return await self._lookup_cluster(keys)
            client, gate = self._require_client()
            answer = [False] * len(keys)
            problems: list[BaseException] = []
            orphans: list[OffloadKey] = []  # split blocks whose main value lost a part
            step = self.config.lookup_batch

            async def run(lo: int) -> None:
                async with gate:
                    if problems:
                        return
                    try:
                        found, lost = await self._exists(client, keys[lo : lo + step])
                    except _UNREACHABLE as exc:
                        problems.append(detached(exc))
                        return
                answer[lo : lo + len(found)] = found
                orphans.extend(lost)

            with anyio.move_on_after(self.config.job_timeout) as scope:
                async with anyio.create_task_group() as tg:
                    for lo in range(0, len(keys), step):
                        tg.start_soon(run, lo)
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

    async def _exists(
        self, client: Client, keys: Sequence[OffloadKey]
    ) -> tuple[list[bool], list[OffloadKey]]:
        """One pipeline of EXISTS: whether each block of `keys` is whole on the server
        of `client`, and the split blocks whose main value is there with a part gone."""
        pipe = client.pipeline(transaction=False)
        counts = []
        for key in keys:
            names = self._names.all(key)
            pipe.execute_command("EXISTS", *names)
            counts.append(len(names))
            if len(names) > 1:  # and the main value on its own
                pipe.execute_command("EXISTS", names[0])
        found = await pipe.execute()
        whole: list[bool] = []
        orphans: list[OffloadKey] = []
        at = 0
        for key, need in zip(keys, counts):
            have = found[at]
            at += 1
            if need > 1:
                # the main value is written last: with it there and a part gone, the
                # part was evicted or expired and the rest is an orphan (parts
                # without their main may be a store in progress)
                if found[at] and have < need:
                    orphans.append(key)
                at += 1
            whole.append(have == need)
        return whole, orphans

    async def _lookup_cluster(self, keys: Sequence[OffloadKey]) -> list[bool]:
        """A lookup on a cluster: one pipeline per node (and `lookup_batch` keys). A
        node that fails, or whose breaker is open, makes its keys misses; only when
        every node is down does the lookup raise TierUnavailable."""
        nodes, gate = self._require_nodes()
        await nodes.refresh_if_due()
        answer = [False] * len(keys)
        groups: dict[str, tuple[Node, Node, list[int]]] = {}
        for i, key in enumerate(keys):
            shard = nodes.shard(self._names.main(key))
            if shard:  # else no node serves its slot: a miss
                node = nodes.reader(shard)
                groups.setdefault(node.name, (node, shard[0], []))[2].append(i)
        orphans: dict[str, tuple[Node, list[OffloadKey]]] = {}  # per master
        answered: list[Node] = []

        async def run(node: Node, master: Node, indices: list[int]) -> None:
            chosen = [keys[i] for i in indices]
            # a replica that is down: ask the master instead
            for target in (node,) if node is master else (node, master):
                if not target.breaker.allow():
                    continue
                try:
                    async with gate:
                        found, lost = await self._exists(target.client, chosen)
                except _UNREACHABLE as exc:
                    if is_node_down(exc):
                        nodes.failed(target, exc)
                        continue
                    # MOVED, ASK: these keys miss this time, the map is refreshed
                    target.breaker.succeeded()
                    nodes.mark_stale()
                    logger.info("redis cluster lookup on %s: %s", target.name, exc)
                    return
                except anyio.get_cancelled_exc_class():
                    if answered:  # cut off by a deadline the other nodes met
                        late = f"redis cluster node {target.name} did not answer in time"
                        nodes.failed(target, late)
                    else:
                        target.breaker.abandon()
                    raise
                target.breaker.succeeded()
                answered.append(target)
                for i, whole in zip(indices, found):
                    answer[i] = whole
                if lost:
                    orphans.setdefault(master.name, (master, []))[1].extend(lost)
                return

        step = self.config.lookup_batch
        with anyio.move_on_after(self.config.job_timeout) as scope:
            async with anyio.create_task_group() as tg:
                for node, master, indices in groups.values():
                    for lo in range(0, len(indices), step):
                        tg.start_soon(run, node, master, indices[lo : lo + step])
        if await nodes.every_node_down():
            raise TierUnavailable(f"lookup failed: {nodes.down_message()}")
        if scope.cancelled_caught:
            raise TierUnavailable(
                f"lookup in the redis cluster at {self.config.safe_url} did not finish "
                f"within job_timeout={self.config.job_timeout}s"
            )
        for master, lost in orphans.values():
            if master.breaker.closed:  # else left to ttl or eviction, as when it fails
                await self._remove_orphans(master.client, gate, lost)
        return answer

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
            if self.config.cluster:
                return await self._remove_cluster(keys)
            client, gate = self._require_client()
            try:
                async with gate:
                    with anyio.fail_after(self.config.job_timeout):
                        await self._unlink(client, keys)
            except _UNREACHABLE as exc:  # includes the TimeoutError of fail_after
                raise TierUnavailable(f"remove failed: {self._unreachable(exc)}") from None

    async def _remove_cluster(self, keys: Sequence[OffloadKey]) -> None:
        """Removal on a cluster: per master; the keys of the masters that answer go,
        and TierUnavailable names the nodes whose keys may remain."""
        nodes, gate = self._require_nodes()
        groups: dict[str, tuple[Node, list[OffloadKey]]] = {}
        for key in keys:
            shard = nodes.shard(self._names.main(key))
            if shard:  # else no node serves its slot: nothing to remove
                groups.setdefault(shard[0].name, (shard[0], []))[1].append(key)
        problems: list[str] = []

        async def run(node: Node, chunk: list[OffloadKey]) -> None:
            if not node.breaker.allow():
                problems.append(node.breaker.explain())
                return
            try:
                async with gate:
                    with anyio.fail_after(self.config.job_timeout):
                        await self._unlink(node.client, chunk)
            except _UNREACHABLE as exc:  # includes the TimeoutError of fail_after
                if is_node_down(exc):
                    problems.append(nodes.failed(node, exc))
                else:
                    node.breaker.succeeded()
                    problems.append(f"redis cluster node {node.name}: {_command_error(exc)}")
                return
            except anyio.get_cancelled_exc_class():
                node.breaker.abandon()
                raise
            node.breaker.succeeded()

        async with anyio.create_task_group() as tg:
            for node, chunk in groups.values():
                tg.start_soon(run, node, chunk)
        if problems:
            raise TierUnavailable(f"remove failed: {'; '.join(problems)}")

    def describe(self) -> dict[str, Any]:
        c = self.config
        described = {
            "type": "redis",
            "url": c.safe_url,
            "cluster": c.cluster,
            "names": f"{self._names.prefix}*",
            "ttl": c.ttl,
            "max_connections": c.max_connections,
            "pipeline_size": c.pipeline_size,
            "blocks_per_pipeline": self._pipeline,
            "part_size": int(c.part_size),
            "mac": self.framer.mac,
            "open": self._client is not None or self._cluster is not None,
        }
        if c.cluster:
            # the breaker of each node of the slot map: closed, open, half_open
            described["read_from_replicas"] = c.read_from_replicas
            described["nodes"] = {} if self._cluster is None else self._cluster.states()
        return described
