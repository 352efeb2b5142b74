"""Deleting blocks: `remove()`, and what loads and lookups found damaged or half gone.

A block is deleted with one UNLINK of all its names (all in one slot: one node), the
blocks of one node in one pipeline, the nodes in parallel. A removal is answered by
every node it concerns: the keys of the nodes that answer go, and `TierUnavailable`
names the nodes whose keys may remain.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import anyio
from redis.asyncio import Redis

from tierkv.tier import OffloadKey, TierUnavailable
from tierkv_redis.failures import UNREACHABLE, command_error
from tierkv_redis.names import BlockNames
from tierkv_redis.routing import Node
from tierkv_redis.session import Session

logger = logging.getLogger(__name__)


async def unlink(client: Redis, names: BlockNames, keys: Sequence[OffloadKey]) -> None:
    """UNLINK every name of each block of `keys`, in one pipeline to one node."""
    pipe = client.pipeline(transaction=False)
    for key in keys:
        # execute_command, not pipe.unlink: one command per block, all its names
        pipe.execute_command("UNLINK", *names.all(key))
    await pipe.execute(raise_on_error=True)


def _same(key: OffloadKey) -> OffloadKey:
    return key


async def remove(session: Session, keys: Sequence[OffloadKey]) -> None:
    """Delete the blocks of `keys` from the masters that hold them; raises
    TierUnavailable naming each node that did not answer (or refused)."""
    nodes, gate, timeout = session.nodes, session.gate, session.config.job_timeout
    health = nodes.health()
    groups = [
        (master, list(chunk))
        for _node, master, chunk in nodes.route(keys, _same, read=False)
        if master is not None  # else no node serves their slot: nothing to remove
    ]
    problems: list[str] = []

    async def run(node: Node, chunk: Sequence[OffloadKey]) -> None:
        if not health.allow(node):
            problems.append(health.explain(node))
            return
        try:
            async with gate:
                with anyio.fail_after(timeout):
                    await unlink(node.client, session.names, chunk)
        except UNREACHABLE as exc:  # includes the TimeoutError of fail_after
            if health.is_down(exc):
                problems.append(health.failed(node, exc))
            else:
                health.succeeded(node)
                problems.append(f"redis cluster node {node.name}: {command_error(exc)}")
            return
        except anyio.get_cancelled_exc_class():
            health.abandon(node)
            raise
        health.succeeded(node)

    if len(groups) == 1:  # one node (always, on a single server): no task group
        [(node, chunk)] = groups
        await run(node, chunk)
    else:
        async with anyio.create_task_group() as tg:
            for node, chunk in groups:
                tg.start_soon(run, node, chunk)
    if problems:
        raise TierUnavailable(f"remove failed: {'; '.join(problems)}")


async def remove_orphans(session: Session, node: Node, keys: Sequence[OffloadKey]) -> None:
    """Delete what is left of split blocks that lost a part (best effort, within
    `socket_timeout`), so their other parts do not hold memory until TTL or eviction."""
    with anyio.move_on_after(session.config.socket_timeout):
        try:
            async with session.gate:
                await unlink(node.client, session.names, keys)
        except UNREACHABLE as exc:
            logger.warning("redis: could not delete %d partial blocks: %s", len(keys), exc)
