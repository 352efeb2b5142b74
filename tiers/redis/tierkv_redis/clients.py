"""The two redis-py clients the tier keeps per node (a single server is one node).

- `redis.asyncio.Redis`, on the event loop: lookups, deletions, CLUSTER SLOTS, probes.
  They are small, and the asyncio client keeps them off the worker threads.
- `redis.Redis` over a `BlockingConnectionPool`, in worker threads: stores and loads,
  whose framing, checksums and copies would stall the event loop (`wire.py` and
  `gets.py` send and read on its pooled connections).

Both take the tier's URL (credentials, TLS options, db), `max_connections` and
`socket_timeout`; a cluster node's URL is the tier's with the node's address. Neither
connects before its first command.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit, urlunsplit

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.client import Redis as SyncRedis
from redis.connection import BlockingConnectionPool
from redis.exceptions import ConnectionError
from redis.retry import Retry as SyncRetry

from tierkv_redis.config import RedisTierConfig

# Bytes read from the socket per parser feed: redis-py's 64 KiB default costs about a
# third more CPU per MiB-sized GET than 256 KiB (measured, hiredis parser).
SOCKET_READ_SIZE = 256 * 1024


def with_address(url: str, host: str, port: int) -> str:
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


def make_client(config: RedisTierConfig, url: str) -> Redis:
    """The asyncio client of lookups and removals for the node at `url`."""
    # one immediate retry on a fresh connection absorbs a pooled connection that a
    # Redis restart closed; timeouts are not retried (they would double the time a
    # dead server takes to fail a job)
    retry = Retry(NoBackoff(), 1, supported_errors=(ConnectionError,))
    kwargs = _client_kwargs(config, config.socket_timeout, retry, _readonly_async)
    return Redis.from_url(url, socket_read_size=SOCKET_READ_SIZE, **kwargs)


LEFT_BEHIND_MARGIN = 0.5
"""Seconds a worker thread's socket may wait past `job_timeout`. Not zero: with a
socket timeout equal to the job's deadline the two raced, and a loaded machine let the
socket win, so a frozen server's keys failed as "unreachable: Timeout reading from
socket" instead of naming `job_timeout` (and opened the node's breaker)."""


def make_sync_client(config: RedisTierConfig, url: str) -> SyncRedis:
    """The synchronous client of stores and loads for the node at `url`. Its socket
    timeout is `socket_timeout`, but at most `job_timeout` plus `LEFT_BEHIND_MARGIN`:
    the job's own deadline ends a job on a frozen server first, and a thread the job
    left behind there is freed soon after."""
    timeout = min(config.socket_timeout, config.job_timeout + LEFT_BEHIND_MARGIN)
    # as the asyncio client: one immediate retry of a connection a restart closed,
    # none of a timeout
    retry = SyncRetry(NoBackoff(), 1, supported_errors=(ConnectionError,))
    kwargs = _client_kwargs(config, timeout, retry, _readonly)
    pool = BlockingConnectionPool.from_url(
        url,
        # a thread waits this long for a connection that threads a job left
        # behind on a frozen server still hold
        timeout=timeout,
        socket_read_size=SOCKET_READ_SIZE,
        **kwargs,
    )
    return SyncRedis(connection_pool=pool)


def _client_kwargs(
    config: RedisTierConfig, timeout: float, retry: Any, on_connect: Any
) -> dict[str, Any]:
    """What both clients of a node are built with: pool size, timeouts, the retry,
    the password, and `on_connect` (READONLY) when reading from replicas."""
    kwargs: dict[str, Any] = {
        "max_connections": config.max_connections,
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": retry,
    }
    if config.password is not None:
        kwargs["password"] = config.password.get_secret_value()
    if config.read_from_replicas:
        kwargs["redis_connect_func"] = on_connect
    return kwargs
