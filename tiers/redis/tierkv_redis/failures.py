"""What a Redis error means for the tier, and the messages that say so.

Two questions are asked of every error a request to a node raised or returned: is the
node down (refused, reset, timed out, wrong password, CLUSTERDOWN), so that its other
keys need not be tried, or did it refuse this one command (out of memory, WRONGTYPE,
MOVED), so that only this key failed? And what does the user read: a message naming
the server (`redis at redis://...`) or the cluster node (`redis cluster node
host:port`), never a password.
"""

from __future__ import annotations

from redis.exceptions import (
    AskError,
    AuthenticationError,
    ClusterDownError,
    OutOfMemoryError,
    RedisError,
    ResponseError,
)

UNREACHABLE = (RedisError, OSError, TimeoutError)
"""The errors a request to a node may raise: the node failed, or refused the command."""

MOVED_NOTE = "redis cluster slot moved"
"""Starts the reason of a key that met MOVED or ASK: the slot map is out of date."""


def is_command_error(exc: BaseException) -> bool:
    """A per-command error (OOM, WRONGTYPE, MOVED, ...): the server is up, this key
    failed. CLUSTERDOWN is not: the node refuses every key, as if it were down."""
    return isinstance(exc, ResponseError) and not isinstance(exc, ClusterDownError)


def is_node_down(exc: BaseException) -> bool:
    """The node does not serve (refused, reset, timed out, wrong password, CLUSTERDOWN)
    rather than refusing one command."""
    return not is_command_error(exc)


def command_error(exc: BaseException) -> str:
    """The reason of a key whose command the server refused."""
    if isinstance(exc, OutOfMemoryError):
        return f"redis is out of memory (maxmemory reached, nothing evictable): {exc}"
    if isinstance(exc, AskError):  # MOVED or ASK: the tier's slot map is out of date
        return f"{MOVED_NOTE}: slot {exc.slot_id} is served by {exc.host}:{exc.port} now"
    return f"redis refused the command: {type(exc).__name__}: {exc}"


def server_error(url: str, exc: BaseException) -> str:
    """Why a single server (at `url`, password hidden) failed a request."""
    if isinstance(exc, AuthenticationError):
        return f"redis at {url} refused the credentials: {exc}"
    return f"redis at {url} unreachable: {type(exc).__name__}: {exc}"


def node_error(node: str, exc: BaseException) -> str:
    """Why the cluster node `node` (host:port) failed a request."""
    if isinstance(exc, AuthenticationError):
        return f"redis cluster node {node} refused the credentials: {exc}"
    if isinstance(exc, ClusterDownError):
        return f"redis cluster node {node} says the cluster is down (CLUSTERDOWN): {exc}"
    return f"redis cluster node {node} unreachable: {type(exc).__name__}: {exc}"


def open_error(url: str, cluster: bool, exc: BaseException, required: bool = True) -> str:
    """Why `open()` failed, with what to check (for an optional tier, that the cache
    serves without it meanwhile, not a setting it already has)."""
    if isinstance(exc, AuthenticationError):
        return (
            f"redis at {url} refused the credentials ({exc}); "
            "check the password in the tier's `url` or `password`"
        )
    if cluster and isinstance(exc, ResponseError):  # to CLUSTER SLOTS
        return (
            f"redis at {url} is not a Redis Cluster node ({exc}); "
            "set `cluster: false` for a single server"
        )
    check = (
        f"redis at {url} is unreachable: {type(exc).__name__}: {exc}; check that "
        "redis-server runs there and that the tier's `url` (host, port, rediss:// for "
        "TLS) is right"
    )
    if not required:
        return f"{check} (the tier is optional: the cache serves without it until it answers)"
    return f"{check}, or set `required: false` to serve without it until it answers"
