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

One path per operation, for a single server and a Redis Cluster alike: a single
server is a cluster of one node (`routing.py`). Every operation groups its keys by the
node serving them (`server.OneServer`: the one server; `cluster.ClusterNodes`: each
slot's master, or a replica) and works per node, over that node's own clients
(`clients.py`): stores and loads in `jobs.py` and `transfers.py`, lookups in
`lookups.py`, removals in `removal.py`. What a node's failure means is the map's
health: a single server that fails (refused, reset, timed out, auth) ends the job or
lookup that met it, every key not yet done failing with a message naming the server,
so a dead Redis answers a job within about `socket_timeout`, and the next operation
asks it again (the client reconnects by itself once Redis is back). A cluster node
that fails opens its breaker (`nodes.py`): its keys are misses and failed keys, naming
it, until a probe finds it back, while the other nodes' keys are served; only when
every node is down does a lookup raise `TierUnavailable` and a job abort, so the
cache's own breaker still sees a dead Redis.

A job's blocks are sent in pipelines of `pipeline_size` commands, at most
`max_connections` at a time, by the contract's `run_job` (`config.transfer_plan`;
`auto`: blocks under 1 MiB in pipelines of about 2 MiB; MiB-sized blocks up to 16 MiB
to a call, each command sent once the last one's reply is read, at most 4 calls at once
per node: fewer thread hops for the event loop, and fewer large replies buffered in the
server at once). Stores and loads run whole in worker threads, one hop per batch:
framing, checksums, MACs, and the network I/O itself over connections of redis-py's
blocking pool of `max_connections` (stores send packed SETs, or MiB-sized blocks
straight from their slots, `wire.py`; loads read the values off the socket into their
slots, `gets.py`). On the event loop they cost ~0.4 ms to frame and ~0.3 ms to check a
2 MiB block, plus the asyncio client's own sends and reply parsing: 13-27 ms of stall
per 64-block job, during which no other request of the server progresses. Lookups run
their EXISTS in a worker thread too (`lookups.py`); removals are small and stay on the
asyncio client.

A thread waiting on a frozen Redis cannot be interrupted, so a job at its deadline
leaves it behind (`IOThreads`): its socket timeout, at most `job_timeout` plus half a
second (`clients.LEFT_BEHIND_MARGIN`), frees it soon after, and it touches the job's
slots only under the job's `SocketGuard` (`sockets.py`), which the job closes before it
returns: a read straight into a slot is cut there (its socket shut down). A late store
may still land in Redis (as with any client whose command was sent); a late load never
writes a slot.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import anyio
from redis.asyncio import Redis
from redis.client import Redis as SyncRedis

from tierkv.tier import (
    Batch,
    InFlightJobs,
    IOThreads,
    JobMetadata,
    JobResult,
    OffloadKey,
    PrimaryView,
    ReqContext,
    SecondaryTierManager,
    SlotGuard,
    TierConfig,
    TierUnavailable,
)
from tierkv_redis import jobs, lookups, removal
from tierkv_redis.clients import make_client, make_sync_client, with_address
from tierkv_redis.cluster import ClusterNodes
from tierkv_redis.config import RedisTierConfig, transfer_plan
from tierkv_redis.failures import UNREACHABLE, open_error
from tierkv_redis.names import BlockNames
from tierkv_redis.routing import Node, NodeMap
from tierkv_redis.server import OneServer
from tierkv_redis.session import Session
from tierkv_redis.transfers import Transfers

logger = logging.getLogger(__name__)


class RedisTier(SecondaryTierManager):
    """Blocks in Redis: one framed value per block, shared across processes and machines."""

    Config = RedisTierConfig
    config: RedisTierConfig
    shared_storage = True
    accepts_regions = True  # stores copy a block into its command; regions are joined there

    def __init__(self, config: TierConfig, primary: PrimaryView) -> None:
        super().__init__(config, primary)
        self._names = BlockNames(
            self.config.key_prefix,
            primary.namespace,
            primary.block_bytes,
            int(self.config.part_size),
            mac=self.framer.mac,
            fit=self.config.fit_values,
        )
        ttl = self.config.ttl
        self._ttl_ms: int | None = None if ttl is None else max(1, round(ttl * 1000))
        c = self.config
        self._plan = transfer_plan(c.pipeline_size, primary.block_bytes, c.max_connections)
        self._transfers = Transfers(
            self._names,
            self.framer,
            primary,
            self._ttl_ms,
            self.report_foreign,
            in_turn=self._plan.in_turn,
        )
        self._session: Session | None = None  # made by open(), let go by close()
        self._inflight = InFlightJobs(self.name)

    @staticmethod
    def get_tier_type() -> str:
        return "redis"

    def __repr__(self) -> str:
        return f"RedisTier({self.config.safe_url!r}, prefix={self._names.prefix!r})"

    # -- life cycle -----------------------------------------------------------------
    def _node_map(self) -> NodeMap:
        """The server the URL names as a map of one node, or (`cluster`) the cluster
        whose slot map the node the URL names gives."""
        c = self.config
        if not c.cluster:
            return OneServer(
                c.url, c.safe_url, partial(make_client, c), partial(make_sync_client, c)
            )
        parts = urlsplit(c.url)
        return ClusterNodes(
            parts.hostname or "127.0.0.1",
            parts.port or 6379,
            self._node_clients,
            slot_name=self._names.main,
            title=f"the redis cluster at {c.safe_url}",
            probe_after=c.recovery_after,
            read_from_replicas=c.read_from_replicas,
        )

    def _node_clients(self, host: str, port: int) -> tuple[Redis, SyncRedis]:
        """Both clients of one cluster node: the tier's URL (credentials, TLS options)
        with the node's address."""
        url = with_address(self.config.url, host, port)
        return make_client(self.config, url), make_sync_client(self.config, url)

    async def open(self) -> None:
        """Connect and PING; on a cluster, read the slot map from the node the URL
        names. Raises TierUnavailable when Redis is unreachable, refuses the
        credentials, or is no cluster node while `cluster` says it is; the tier may be
        opened again later."""
        if self._session is not None:
            return
        self._inflight.closing = False
        c = self.config
        nodes = self._node_map()
        try:
            with anyio.fail_after(c.socket_timeout * 2):
                await nodes.open()
        except Exception as exc:
            await nodes.close()
            raise TierUnavailable(
                open_error(c.safe_url, c.cluster, exc, required=self.config.required)
            ) from None
        self._session = Session(
            nodes,
            anyio.Semaphore(c.max_connections),
            IOThreads(c.max_connections, f"tierkv-{self.name}"),
            self._names,
            c,
        )
        logger.info("redis tier open: %s, names %s*", nodes.where(), self._names.prefix)

    async def close(self) -> None:
        await self._inflight.drain()
        session, self._session = self._session, None
        if session is not None:
            session.threads.close()
            await session.nodes.close()

    def _require_session(self) -> Session:
        if self._inflight.closing:
            raise TierUnavailable(f"tier {self.name!r} is closed")
        if self._session is None:
            raise TierUnavailable(f"tier {self.name!r} is not open; call open() first")
        return self._session

    def _client_for(self, name: str) -> Redis:
        """The asyncio client of the server, or cluster master, that holds the stored
        name `name` (for tests and tools)."""
        shard = self._require_session().nodes.shard(name)
        if not shard:
            raise TierUnavailable(f"no node of the redis cluster serves {name!r}")
        return shard[0].client

    # -- stores and loads: one worker-thread hop per batch, I/O included ------------
    def _batches(self, pairs: Iterable[jobs.Pair]) -> list[jobs.NodeBatch]:
        """`pairs` in batches of one pipeline (or command) each (`pipeline_size`)."""
        return jobs.batches_of(pairs, self._names, self._plan.blocks, in_turn=self._plan.in_turn)

    async def store(self, job: JobMetadata) -> JobResult:
        return await self._run_job(job, "store", self._store_batch, from_replicas=False)

    async def _run_job(
        self, job: JobMetadata, verb: str, batch_op: Any, *, from_replicas: bool
    ) -> JobResult:
        """Plan `job` into per-node batches and run `batch_op` on each (`jobs`)."""
        async with self._inflight.job():
            session = self._require_session()
            await session.nodes.refresh_if_due()
            batches, at_once = jobs.plan(session, job, self._plan, from_replicas=from_replicas)
            op = partial(batch_op, session)
            return await jobs.run_on_nodes(session, job, op, verb, batches, at_once)

    async def _store_batch(
        self, session: Session, target: Node, master: Node, batch: Batch, guard: SlotGuard
    ) -> dict[OffloadKey, str]:
        return await session.threads.run(self._transfers.store, target.sync, batch, guard)

    async def load(self, job: JobMetadata) -> JobResult:
        # a load that renews the ttl (GETEX) writes: the master only
        from_replicas = self._ttl_ms is None
        return await self._run_job(job, "load", self._load_batch, from_replicas=from_replicas)

    async def _load_batch(
        self, session: Session, target: Node, master: Node, batch: Batch, guard: SlotGuard
    ) -> dict[OffloadKey, str]:
        """Read from `target` (a replica with `read_from_replicas`); delete what failed
        its checks on `master`."""
        loaded = await session.threads.run(self._transfers.load, target.sync, batch, guard)
        errors, doomed, gone = loaded
        if doomed:
            try:
                await removal.unlink(master.client, self._names, doomed)
            except UNREACHABLE as exc:  # the loads themselves are done; just say so
                logger.warning("redis: could not delete %d bad blocks: %s", len(doomed), exc)
        # gone, or deleted here: either way this tier no longer holds them
        self.report_removed([*gone, *(k for k in doomed if k not in gone)])
        return errors

    # -- lookup and remove ----------------------------------------------------------
    async def lookup(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[bool]:
        """Pipelined EXISTS over every part of each block; raises TierUnavailable
        when Redis (on a cluster: every node) does not answer."""
        if not keys:
            return []
        async with self._inflight.job():
            return await lookups.lookup(self._require_session(), keys, self.report_removed)

    async def remove(self, keys: Sequence[OffloadKey]) -> None:
        if not keys:
            return
        async with self._inflight.job():
            await removal.remove(self._require_session(), keys)

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
            "blocks_per_pipeline": self._plan.blocks,
            "commands_in_turn": self._plan.in_turn,
            "part_size": int(c.part_size),
            "fit_values": c.fit_values,
            "mac": self.framer.mac,
            "open": self._session is not None,
        }
        if c.cluster:
            # the breaker of each node of the slot map: closed, open, half_open
            described["read_from_replicas"] = c.read_from_replicas
            described["nodes"] = {} if self._session is None else self._session.nodes.states()
        return described
