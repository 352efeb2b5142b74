"""Which Redis Cluster node serves which block, with one client pair and one breaker
per node: the `NodeMap` (and `NodeHealth`) of a cluster.

On a cluster the tier routes every command itself rather than through redis-py's
`RedisCluster`: that client sends a pipeline spanning several nodes as one unit, so one
dead master failed every lookup and every job of the tier, the live masters' keys
included. Here a request's keys are grouped by the node serving their slot (all parts
of a block share one hash tag, so one slot, so one node), and each group goes to that
node's own plain clients (`clients.py`), as a single server's do. A node that fails
costs its own group only, and its breaker (`nodes.NodeBreaker`) answers for its keys
until a probe finds it back; only when every node is down does an operation end.

The slot map comes from CLUSTER SLOTS, asked of a node whose breaker is closed: when
the tier opens; soon after a node failed or answered MOVED (slots moved); and every
second while any node is down (a replica may have taken its slots over). A
master restarted on its own address (the same node, emptied) needs no new map: its
breaker's probe finds it, and its slots are served again.

With `read_from_replicas`, reads (lookups, and loads when no `ttl` renews blocks on
read) rotate over each slot's master and replicas whose breakers are closed; every
connection sends READONLY, which replicas need and masters ignore. Used from the event
loop only.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
from redis.asyncio import Redis
from redis.client import Redis as SyncRedis
from redis.crc import key_slot
from redis.exceptions import ClusterDownError

from tierkv.tier import OffloadKey, in_thread
from tierkv_redis.failures import is_node_down, node_error
from tierkv_redis.nodes import NodeBreaker, NodeState
from tierkv_redis.routing import Node, Route, Shard, T

logger = logging.getLogger(__name__)

SLOTS = 16384

# a node that failed or answered MOVED has the map asked again this soon at the
# earliest; a storm of failures costs one CLUSTER SLOTS per this long
STALE_GAP = 0.1
# while a node is down the map is asked again this often (or every `probe_after`, if
# shorter): a replica's failover is found within about this long of Redis doing it
DOWN_REFRESH = 1.0


NodeClients = Callable[[str, int], tuple[Redis, SyncRedis]]
"""Makes the client pair of the node at (host, port); connects nothing yet."""


@dataclass(eq=False)
class ClusterNode(Node):
    """A node of the cluster, with its breaker."""

    breaker: NodeBreaker


class ClusterNodes:
    """The nodes of one cluster and the slot map; routes blocks to nodes. Its own
    `NodeHealth`: the nodes' breakers, which outlive operations."""

    def __init__(
        self,
        host: str,
        port: int,
        clients: NodeClients,
        *,
        slot_name: Callable[[OffloadKey], str],
        title: str,
        probe_after: float,
        read_from_replicas: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._seed = (host, port)
        self._clients = clients
        self._slot_name = slot_name  # the stored name whose slot a block lives in
        self.title = title
        self.probe_after = probe_after
        self.read_from_replicas = read_from_replicas
        self._clock = clock
        self._nodes: dict[str, ClusterNode] = {}  # every node ever met; kept until close
        self._owners: list[tuple[ClusterNode, ...]] = [()] * SLOTS  # master, replicas
        self._members: tuple[ClusterNode, ...] = ()  # the nodes of the current map
        self._summary: dict[str, int] = {}  # slots per master in the current map
        self._stale = False
        self._refreshed_at = -float("inf")
        self._refreshing = anyio.Lock()
        self._turn = itertools.count()

    def _node(self, host: str, port: int) -> ClusterNode:
        name = f"{host}:{port}"
        node = self._nodes.get(name)
        if node is None:
            client, sync = self._clients(host, port)
            breaker = NodeBreaker(name, self.probe_after, self._clock)
            node = ClusterNode(name, client, sync, breaker)
            self._nodes[name] = node
        return node

    # -- the slot map ---------------------------------------------------------------
    async def open(self) -> None:
        """The first map, from the node the URL names; raises what asking it raised."""
        host, port = self._seed
        seed = self._node(host, port)
        self._install(await _cluster_slots(seed), host)

    def _install(self, reply: Sequence[Any], asked_host: str) -> None:
        owners: list[tuple[ClusterNode, ...]] = [()] * SLOTS
        members: dict[str, ClusterNode] = {}
        summary: dict[str, int] = {}
        for entry in reply:
            lo, hi = int(entry[0]), int(entry[1])
            shard = []
            for member in entry[2:]:
                host = member[0].decode() if isinstance(member[0], bytes) else str(member[0])
                node = self._node(host or asked_host, int(member[1]))
                shard.append(node)
                members[node.name] = node
            if shard:
                owners[lo : hi + 1] = [tuple(shard)] * (hi + 1 - lo)
                summary[shard[0].name] = summary.get(shard[0].name, 0) + hi + 1 - lo
        self._owners = owners
        self._members = tuple(members[name] for name in sorted(members))
        self._stale = False
        self._refreshed_at = self._clock()
        if summary != self._summary:
            logger.info("redis cluster slot map (slots per master): %s", summary)
        self._summary = summary

    def where(self) -> str:
        """The masters of the current map."""
        return f"cluster nodes {', '.join(self._summary)}"

    def mark_stale(self) -> None:
        """A node failed or answered MOVED: ask for the map again soon."""
        self._stale = True

    async def refresh_if_due(self) -> None:
        """Ask a live node for the map when it may be out of date (at most every
        STALE_GAP), and every DOWN_REFRESH while any node is down; no-op otherwise."""
        if not self._stale and all(n.breaker.closed for n in self._members):
            return
        gap = STALE_GAP if self._stale else min(DOWN_REFRESH, self.probe_after)
        if self._clock() - self._refreshed_at < gap or self._refreshing.locked():
            return
        async with self._refreshing:
            self._refreshed_at = self._clock()
            for node in self._members:
                if not node.breaker.closed:
                    continue  # the probe tells whether it is back, not a refresh
                try:
                    reply = await _cluster_slots(node)
                except Exception as exc:
                    if is_node_down(exc):
                        node.breaker.failed(node_error(node.name, exc))
                    continue
                self._install(reply, node.name.rpartition(":")[0])
                return

    # -- routing --------------------------------------------------------------------
    def route(
        self, items: Iterable[T], key_of: Callable[[T], OffloadKey], *, read: bool
    ) -> list[Route[T]]:
        """`items` grouped by the master of their key's slot, or with `read` the node
        `reader` picks for each (a replica, maybe); the items whose slot no node
        serves in a route of no node."""
        routes: dict[str, tuple[Node | None, Node | None, list[T]]] = {}
        for item in items:
            shard = self.shard(self._slot_name(key_of(item)))
            if not shard:
                routes.setdefault("", (None, None, []))[2].append(item)
                continue
            node = self.reader(shard) if read else shard[0]
            routes.setdefault(node.name, (node, shard[0], []))[2].append(item)
        return list(routes.values())

    def shard(self, name: str) -> Shard:
        """The nodes serving the slot of stored name `name`, its master first; empty
        when no node serves it."""
        return self._owners[key_slot(name.encode())]

    def reader(self, shard: Shard) -> Node:
        """Which node of `shard` to read from: its master, or with `read_from_replicas`
        the next of its nodes whose breaker is closed."""
        if not self.read_from_replicas or len(shard) == 1:
            return shard[0]
        start = next(self._turn)
        for i in range(len(shard)):
            node = shard[(start + i) % len(shard)]
            if _breaker(node).closed:
                return node
        return shard[0]

    # -- node health: the breakers --------------------------------------------------
    def health(self) -> ClusterNodes:
        return self  # the breakers outlive operations

    def allow(self, node: Node) -> bool:
        return _breaker(node).allow()

    def explain(self, node: Node) -> str:
        return _breaker(node).explain()

    def succeeded(self, node: Node) -> None:
        _breaker(node).succeeded()

    def failed(self, node: Node, exc: BaseException) -> str:
        """`node` failed a request: open its breaker, ask for the map again soon;
        the reason, naming the node."""
        return self._opened(node, node_error(node.name, exc))

    def late(self, node: Node) -> None:
        """Cut off by a deadline the other nodes met: its breaker opens, so the next
        operation answers without waiting on it."""
        self._opened(node, f"redis cluster node {node.name} did not answer in time")

    def _opened(self, node: Node, reason: str) -> str:
        _breaker(node).failed(reason)
        self.mark_stale()
        return reason

    def abandon(self, node: Node) -> None:
        _breaker(node).abandon()

    def is_down(self, exc: BaseException) -> bool:
        return is_node_down(exc)

    def serving(self, node: Node) -> bool:
        return _breaker(node).closed

    def states(self) -> dict[str, NodeState]:
        """Breaker state of each node of the current map."""
        return {node.name: node.breaker.state for node in self._members}

    async def every_node_down(self) -> bool:
        """Whether no node of the map serves: every breaker is open, and the nodes
        whose probe is due do not say cluster_state:ok now either (a node cut off
        from the majority of masters answers a PING, not a command)."""
        if any(node.breaker.closed for node in self._members):
            return False

        async def probe(node: ClusterNode) -> None:
            try:
                info = await node.client.execute_command("CLUSTER INFO")  # type: ignore[no-untyped-call]
                if not _state_ok(info):
                    raise ClusterDownError("the node's cluster_state is not ok")
            except anyio.get_cancelled_exc_class():
                node.breaker.abandon()
                raise
            except Exception as exc:
                node.breaker.failed(node_error(node.name, exc))
            else:
                node.breaker.succeeded()

        async with anyio.create_task_group() as tg:
            for node in self._members:
                if node.breaker.allow():
                    tg.start_soon(probe, node)
        return not any(node.breaker.closed for node in self._members)

    def down_message(self) -> str:
        reasons = "; ".join(node.breaker.reason or node.name for node in self._members)
        return f"every node of the redis cluster is unreachable: {reasons or 'no nodes'}"

    async def close(self) -> None:
        nodes, self._nodes = list(self._nodes.values()), {}
        self._owners = [()] * SLOTS
        self._members = ()
        self._summary = {}
        for node in nodes:
            await node.client.aclose()
        await in_thread(_close_all, [node.sync for node in nodes])


def _state_ok(info: Any) -> bool:
    """Whether a CLUSTER INFO reply (parsed into a dict by redis-py, or raw) says
    cluster_state:ok."""
    if isinstance(info, dict):
        return info.get("cluster_state") in ("ok", b"ok")
    text = info.decode() if isinstance(info, bytes) else str(info)
    return "cluster_state:ok" in text


def _breaker(node: Node) -> NodeBreaker:
    assert isinstance(node, ClusterNode)  # every node of this map is one
    return node.breaker


async def _cluster_slots(node: Node) -> Any:
    return await node.client.execute_command("CLUSTER SLOTS")  # type: ignore[no-untyped-call]


def _close_all(clients: Iterable[SyncRedis]) -> None:
    for client in clients:
        client.close()
