"""How every operation of the tier sees Redis: nodes, each serving some blocks.

A single server is a map of one node that serves every block (`server.OneServer`); a
Redis Cluster is a map of its masters and replicas by hash slot
(`cluster.ClusterNodes`). Every operation (store, load, lookup, remove) groups its
keys by the node that serves them, sends each group to its node's own clients, and
asks the map's `NodeHealth` before and after each request. Where the two kinds of map
differ is only here, behind these two protocols:

- routing: which node serves a block (a server: itself; a cluster: the owner of the
  block's slot), which node a read goes to (with `read_from_replicas`, a replica),
  and whether the map must be asked again (a cluster after MOVED or a failure);
- health: what a node's failure means. A single server has no breaker of its own (the
  cache's breaker guards it): a failure ends the operation that met it, with the
  server named, and the next operation asks the server again. A cluster node has a
  breaker (`nodes.NodeBreaker`): a failure costs that node's keys until a probe finds
  it back, and only every node down ends an operation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias, TypeVar

from redis.asyncio import Redis
from redis.client import Redis as SyncRedis

from tierkv.tier import OffloadKey
from tierkv_redis.nodes import NodeState


@dataclass(eq=False)
class Node:
    """One Redis server, as the tier talks to it."""

    name: str  # host:port
    client: Redis  # asyncio: lookups, deletions, CLUSTER SLOTS, probes
    sync: SyncRedis  # blocking: the stores and loads of worker threads


Shard = Sequence[Node]
"""The nodes serving one block: its master first, then any replicas; empty when no
node serves it."""

T = TypeVar("T")

Route: TypeAlias = tuple[Node | None, Node | None, Iterable[T]]
"""(the node asked, its master, the items whose keys it serves); both None for the
items whose slot no node serves."""


class NodeHealth(Protocol):
    """One operation's view of whether to ask a node and what a failure means. Used
    from the event loop only; `failed` followed by `every_node_down` gives no other
    task a turn in between."""

    def allow(self, node: Node) -> bool:
        """Whether to send a request to `node` now."""

    def explain(self, node: Node) -> str:
        """Why `node` is not asked, for its keys' reason."""

    def succeeded(self, node: Node) -> None:
        """`node` answered (its keys may still have failed, one by one)."""

    def failed(self, node: Node, exc: BaseException) -> str:
        """`node` failed a request with `exc` (any error, after `is_down` for lookups
        and removals); the reason, naming it."""

    def late(self, node: Node) -> None:
        """`node` was asked and had not answered when the operation's deadline cut it
        off while the other nodes had answered."""

    def abandon(self, node: Node) -> None:
        """A request `allow`ed ended without a verdict (cancelled)."""

    def is_down(self, exc: BaseException) -> bool:
        """Whether an error a lookup or removal met says the node is down, rather than
        that it refused these commands (then its keys miss, nothing more)."""

    def serving(self, node: Node) -> bool:
        """Whether `node` may be asked to delete what a lookup found damaged."""

    async def every_node_down(self) -> bool:
        """Whether no node serves now: the operation ends, as for a dead Redis."""

    def down_message(self) -> str:
        """Why, when every node is down."""


class NodeMap(Protocol):
    """Where blocks are served and how to ask: one server, or a cluster's slot map."""

    title: str
    """Names the Redis in messages, password hidden ("redis at redis://...")."""

    async def open(self) -> None:
        """Connect and learn the nodes; raises what asking the first node raised."""

    async def close(self) -> None:
        """Close every client; the map is empty afterwards."""

    def where(self) -> str:
        """The nodes, for the log line of an open tier."""

    def route(
        self, items: Iterable[T], key_of: Callable[[T], OffloadKey], *, read: bool
    ) -> list[Route[T]]:
        """`items` grouped by the node serving the block of each item's key, in order
        of first appearance; with `read`, the node asked may be a replica. Each group
        is to be iterated once (a single server's is `items` itself, unconsumed)."""

    def shard(self, name: str) -> Shard:
        """The nodes serving the stored name `name`."""

    def reader(self, shard: Shard) -> Node:
        """Which node of `shard` a read goes to."""

    async def refresh_if_due(self) -> None:
        """Learn the nodes again if they may have changed."""

    def mark_stale(self) -> None:
        """A node answered MOVED or ASK: its slots may have moved."""

    def health(self) -> NodeHealth:
        """The health view for one operation."""

    def states(self) -> dict[str, NodeState]:
        """The breaker of each node, for `describe()` (empty for a single server)."""
