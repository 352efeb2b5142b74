"""Lookups: pipelined EXISTS over every part of each block, per node.

The EXISTS are packed here and sent from a worker thread over the node's blocking
pool, their integer replies read by redis-py's parser there: through the asyncio
client each command cost the event loop about 14 us (its pipeline packs each command
and reads each reply under its own timeout), so a lookup of 320 keys stalled every
other request of the server for 4.5 ms (measured, 2-core VM).

A lookup's keys are grouped by the node that reads them (a single server: all of them;
a cluster: each slot's master, or a replica with `read_from_replicas`) and sent in
pipelines of `lookup_batch` blocks, in parallel, within `job_timeout`. A node that
fails makes its keys misses; a replica that fails is replaced by its master. When
every node is down (a single server that failed, a cluster whose every breaker is
open) the lookup raises `TierUnavailable` instead, so the cache's breaker sees a dead
Redis. A split block whose main value is there with a part gone is a miss, and the
rest of it is deleted (the main value is written last: parts without it may be a store
in progress, and are left).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence

import anyio
from redis.connection import ConnectionPool
from redis.exceptions import InvalidResponse

from tierkv.tier import OffloadKey, TierUnavailable
from tierkv_redis.failures import UNREACHABLE
from tierkv_redis.gets import read_values
from tierkv_redis.names import BlockNames
from tierkv_redis.removal import remove_orphans
from tierkv_redis.routing import Node
from tierkv_redis.session import Session

logger = logging.getLogger(__name__)

Found = tuple[list[bool], list[OffloadKey]]
"""Whether each block asked is whole, and the split blocks found half gone."""


def pack_exists(names: Sequence[str]) -> bytes:
    """The RESP bytes of `EXISTS name...`."""
    parts = [b"*%d\r\n$6\r\nEXISTS\r\n" % (len(names) + 1)]
    for name in names:
        raw = name.encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(raw), raw))
    return b"".join(parts)


def exists(pool: ConnectionPool, names: BlockNames, keys: Sequence[OffloadKey]) -> Found:
    """Worker thread: one pipeline of EXISTS, packed here and sent down one pooled
    connection of `pool`: whether each block of `keys` is whole on its node, and the
    split blocks whose main value is there with a part gone. The first error a
    command met raises (MOVED: the slot map is stale)."""
    commands: list[bytes] = []
    counts: list[int] = []
    for key in keys:
        all_names = names.all(key)
        commands.append(pack_exists(all_names))
        counts.append(len(all_names))
        if len(all_names) > 1:  # and the main value on its own
            commands.append(pack_exists(all_names[:1]))
    found = [_count(reply) for reply in read_values(pool, commands, direct=False)]
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


def _count(reply: object) -> int:
    """The integer an EXISTS answered; its error raises."""
    if isinstance(reply, BaseException):
        raise reply
    if not isinstance(reply, int):
        raise InvalidResponse(f"EXISTS answered {reply!r:.60}, not an integer")
    return reply


class _Lookup:
    """One lookup: its answer so far, the nodes that answered, and the split blocks
    found half gone, per master (which deletes them)."""

    def __init__(self, session: Session, keys: Sequence[OffloadKey]) -> None:
        self.session = session
        self.nodes = session.nodes
        self.health = session.nodes.health()
        self.keys = keys
        self.answer = [False] * len(keys)
        self.answered: list[Node] = []
        self.orphans: dict[str, tuple[Node, list[OffloadKey]]] = {}

    async def run(self, node: Node, master: Node, indices: Sequence[int]) -> None:
        """Ask `node` about the blocks at `indices`; a replica that is down: the
        master instead."""
        chosen = [self.keys[i] for i in indices]
        for target in (node,) if node is master else (node, master):
            found = await self._ask(target, chosen)
            if found is None:
                continue
            whole, lost = found
            for i, present in zip(indices, whole):
                self.answer[i] = present
            if lost:
                self.orphans.setdefault(master.name, (master, []))[1].extend(lost)
            return

    async def _ask(self, target: Node, chosen: list[OffloadKey]) -> Found | None:
        """What `target` says; None when it is down (or not asked: its breaker is
        open, or this lookup saw the server fail). A node that refuses the commands
        (MOVED, ASK) makes them misses this time, and has the map asked again."""
        health, asked = self.health, False
        try:
            async with self.session.gate:
                if not health.allow(target):
                    return None
                asked = True
                pool = target.sync.connection_pool
                found = await self.session.threads.run(exists, pool, self.session.names, chosen)
        except UNREACHABLE as exc:
            if health.is_down(exc):
                health.failed(target, exc)
                return None
            health.succeeded(target)
            self.nodes.mark_stale()
            logger.info("redis cluster lookup on %s: %s", target.name, exc)
            return [False] * len(chosen), []
        except anyio.get_cancelled_exc_class():
            if asked and self.answered:  # cut off by a deadline the other nodes met
                health.late(target)
            elif asked:
                health.abandon(target)
            raise
        health.succeeded(target)
        self.answered.append(target)
        return found


def _chunks(items: Iterable[int], size: int) -> Iterator[list[int]]:
    """`items` in lists of `size`, the last maybe shorter."""
    it = iter(items)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


async def lookup(
    session: Session,
    keys: Sequence[OffloadKey],
    on_removed: Callable[[Sequence[OffloadKey]], None],
) -> list[bool]:
    """Whether each block of `keys` is whole in Redis; raises TierUnavailable when
    every node is down or `job_timeout` passed. `on_removed` hears of the split
    blocks that lost a part, whose rest this lookup deleted."""
    nodes, config = session.nodes, session.config
    await nodes.refresh_if_due()
    state = _Lookup(session, keys)
    step = config.lookup_batch
    with anyio.move_on_after(config.job_timeout) as scope:
        async with anyio.create_task_group() as tg:
            for node, master, at in nodes.route(range(len(keys)), keys.__getitem__, read=True):
                if node is None or master is None:
                    continue  # no node serves their slot: misses
                for chunk in _chunks(at, step):
                    tg.start_soon(state.run, node, master, chunk)
    if await state.health.every_node_down():
        raise TierUnavailable(f"lookup failed: {state.health.down_message()}")
    if scope.cancelled_caught:
        raise TierUnavailable(
            f"lookup in {nodes.title} did not finish within job_timeout={config.job_timeout}s"
        )
    for master, lost in state.orphans.values():
        if state.health.serving(master):  # else left to ttl or eviction
            await remove_orphans(session, master, lost)
            on_removed(lost)
    return state.answer
