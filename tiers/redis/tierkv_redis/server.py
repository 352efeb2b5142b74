"""A single Redis server as a map of one node, which serves every block.

Its health has no memory beyond one operation: the first connection-level failure
(refused, reset, timed out, auth, and any error a lookup or removal meets) ends the
operation that met it with the server named (`redis at redis://... unreachable: ...`),
since no other node could serve its keys, and the next operation asks the server
again (the client reconnects by itself once Redis is back). Whether to stop asking a
failing server for a while is the cache's breaker's call, not the tier's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from redis.asyncio import Redis
from redis.client import Redis as SyncRedis

from tierkv.tier import OffloadKey, in_thread
from tierkv_redis.failures import server_error
from tierkv_redis.nodes import NodeState
from tierkv_redis.routing import Node, Route, Shard, T


class ServerHealth:
    """One operation's view of a single server: once it failed, this operation asks it
    no more, and every node (the one) is down."""

    def __init__(self, url: str) -> None:
        self._url = url  # password hidden
        self._reason: str | None = None  # the latest failure of this operation

    def allow(self, node: Node) -> bool:
        return self._reason is None

    def explain(self, node: Node) -> str:
        return self._reason or ""

    def succeeded(self, node: Node) -> None:
        pass  # an earlier failure of this operation still ends it

    def failed(self, node: Node, exc: BaseException) -> str:
        self._reason = server_error(self._url, exc)
        return self._reason

    def late(self, node: Node) -> None:
        pass  # the next operation asks it again anyway

    def abandon(self, node: Node) -> None:
        pass

    def is_down(self, exc: BaseException) -> bool:
        return True  # no other node could answer for its keys

    def serving(self, node: Node) -> bool:
        return self._reason is None

    async def every_node_down(self) -> bool:
        return self._reason is not None

    def down_message(self) -> str:
        return self._reason or f"redis at {self._url} unreachable"


class OneServer:
    """The node map of a single server: one node, every block's."""

    def __init__(
        self,
        url: str,
        safe_url: str,
        make_client: Callable[[str], Redis],
        make_sync_client: Callable[[str], SyncRedis],
    ) -> None:
        self._url = url
        self._safe_url = safe_url
        self._make_client = make_client
        self._make_sync_client = make_sync_client
        self.title = f"redis at {safe_url}"
        self._client: Redis | None = None
        self._sync: SyncRedis | None = None
        self._shard: tuple[Node, ...] = ()

    async def open(self) -> None:
        """PING the server, then make the blocking client of stores and loads. What
        a failed open made, `close()` closes (outside the caller's timeout)."""
        self._client = self._make_client(self._url)
        await self._client.ping()
        self._sync = await in_thread(self._make_sync_client, self._url)
        self._shard = (Node(self._safe_url, self._client, self._sync),)

    async def close(self) -> None:
        client, self._client = self._client, None
        sync, self._sync = self._sync, None
        self._shard = ()
        if client is not None:
            await client.aclose()
        if sync is not None:
            await in_thread(sync.close)

    def where(self) -> str:
        return self._safe_url

    def route(
        self, items: Iterable[T], key_of: Callable[[T], OffloadKey], *, read: bool
    ) -> list[Route[T]]:
        """Every item to the server, as given: no key needs looking at."""
        node = self._shard[0]
        return [(node, node, items)]

    def shard(self, name: str) -> Shard:
        return self._shard

    def reader(self, shard: Shard) -> Node:
        return shard[0]

    async def refresh_if_due(self) -> None:
        pass  # one node, always the same

    def mark_stale(self) -> None:
        pass

    def health(self) -> ServerHealth:
        return ServerHealth(self._safe_url)

    def states(self) -> dict[str, NodeState]:
        return {}
