"""Stores and loads: a job's blocks in batches, each batch sent to the node serving it.

A job's (key, slot) pairs are grouped by node (a single server: all of them), cut
into batches of one pipeline (or one command) each, and the nodes' batches
interleaved, so every node works at once. The contract's `run_job` runs them,
`max_connections` at a time, within `job_timeout`. A batch goes to its node (for a
load with `read_from_replicas`, maybe a replica, and then to the master if the replica
fails); a node that fails, or is not asked (its breaker is open), fails the batch's
keys, naming it. When every node is down (a single server that failed, a cluster
whose every breaker is open) the batch aborts the job instead: its other keys fail at
once with the same reason, so a dead Redis answers a job within about `socket_timeout`.

A worker thread the deadline left behind touches no slot once the job has returned:
the job's `SlotGuard` is closed first.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable, Iterable
from functools import partial

from tierkv.tier import (
    Batch,
    JobAborted,
    JobMetadata,
    JobResult,
    OffloadKey,
    SlotGuard,
    run_job,
)
from tierkv_redis.config import Plan
from tierkv_redis.failures import MOVED_NOTE, UNREACHABLE
from tierkv_redis.names import BlockNames
from tierkv_redis.routing import Node, NodeHealth
from tierkv_redis.session import Session
from tierkv_redis.sockets import SocketGuard

Pair = tuple[OffloadKey, int]

BatchOp = Callable[[Node, Node, Batch, SlotGuard], Awaitable[dict[OffloadKey, str]]]
"""Moves one batch: `op(target, master, batch, guard)` stores to or loads from
`target` (a load may read a replica), and deletes what failed its checks on `master`;
returns the keys that failed, with the reason."""


class NodeBatch(list[Pair]):
    """A batch of blocks of one shard, read from or written to `node` (its master, or
    a replica for a load with `read_from_replicas`); `master` deletes what a load found
    damaged. Both None: no node serves the blocks' slot."""

    __slots__ = ("master", "node")  # no dict per batch: as light for the GC as a list

    def __init__(self, node: Node | None = None, master: Node | None = None) -> None:
        super().__init__()
        self.node = node
        self.master = master


def batches_of(
    pairs: Iterable[Pair],
    names: BlockNames,
    size: int,
    node: Node | None = None,
    master: Node | None = None,
    *,
    in_turn: bool = False,
) -> list[NodeBatch]:
    """Group (key, slot) pairs into batches of `size` for `node`, one pipeline (or
    command) each. A block larger than `part_size` gets a batch of its own, so its
    full-size parts go down one connection in order and no pipeline holds several;
    where a batch's commands are sent `in_turn` (one after the other on one
    connection) it may share one. (A fitted block's small last part shares.)"""
    batches: list[NodeBatch] = []
    current = NodeBatch(node, master)
    for key, slot in pairs:
        if not in_turn and names.split(key):
            alone = NodeBatch(node, master)
            alone.append((key, slot))
            batches.append(alone)
            continue
        current.append((key, slot))
        if len(current) >= size:
            batches.append(current)
            current = NodeBatch(node, master)
    if current:
        batches.append(current)
    return batches


def _key(pair: Pair) -> OffloadKey:
    return pair[0]


def plan(
    session: Session, job: JobMetadata, how: Plan, *, from_replicas: bool
) -> tuple[list[NodeBatch], int]:
    """A job's batches, each of one node's blocks (read from a replica when
    `from_replicas`), the nodes' batches interleaved so that every node works at once,
    and how many may run at once (`how.calls` per node, at most `max_connections`).
    Blocks whose slot no node serves form batches of no node."""
    pairs = zip(job.keys, job.slots)  # not a list: 2048 tuples at once cost GC time
    per_node = []
    for node, master, routed in session.nodes.route(pairs, _key, read=from_replicas):
        size = how.blocks
        if how.in_turn:  # few, large blocks: a list costs nothing here
            routed = list(routed)
            size = how.batch_size(len(routed))
        per_node.append(batches_of(routed, session.names, size, node, master, in_turn=how.in_turn))
    at_once = min(session.config.max_connections, how.calls * max(1, len(per_node)))
    if len(per_node) == 1:
        return per_node[0], at_once
    interleaved = [b for turn in itertools.zip_longest(*per_node) for b in turn if b is not None]
    return interleaved, at_once


async def _on_node(
    session: Session, health: NodeHealth, op: BatchOp, guard: SlotGuard, batch: Batch
) -> dict[OffloadKey, str]:
    """`op` over `batch` on its node; a read from a replica that fails is read from
    the master instead (a load writes a slot only after all its reads came back: safe
    to repeat). Raises JobAborted when every node is down."""
    assert isinstance(batch, NodeBatch)  # made by plan()
    node, master = batch.node, batch.master
    if node is None or master is None:
        why = "no node of the redis cluster serves this block's slot"
        return {key: why for key, _ in batch}
    why = ""
    for target in (node,) if node is master else (node, master):
        asked = False
        try:
            async with session.gate:
                if not health.allow(target):
                    why = health.explain(target)
                    continue
                asked = True
                errors = await op(target, master, batch, guard)
        except UNREACHABLE as exc:  # this node, not the job (unless it is the last)
            why = health.failed(target, exc)
            continue
        except BaseException:
            if asked:
                health.abandon(target)
            raise
        health.succeeded(target)
        if errors and any(reason.startswith(MOVED_NOTE) for reason in errors.values()):
            session.nodes.mark_stale()
        return errors
    if await health.every_node_down():
        raise JobAborted(health.down_message())
    return {key: why for key, _ in batch}


async def run_on_nodes(
    session: Session,
    job: JobMetadata,
    op: BatchOp,
    verb: str,
    batches: list[NodeBatch],
    at_once: int,
) -> JobResult:
    """`op` over `batches` (from `plan`), `at_once` at a time, by the contract's
    `run_job`; then the job's slots closed to any thread its deadline left behind."""
    guard = SocketGuard()
    try:
        return await run_job(
            job,
            partial(_on_node, session, session.nodes.health(), op, guard),
            label=f"redis {verb}",
            concurrency=at_once,
            timeout=session.config.job_timeout,
            batches=batches,
        )
    finally:
        guard.close()  # threads left behind by the deadline touch no slot from now on
