"""What a worker thread does for one batch of a store or a load, on one node.

A store frames each block (reading its slot while the job lives) and sends packed SETs
down one pooled connection (`wire.py`): one copy of the block, into the command. A
split block's parts are sent later parts first and the main name last, so a lookup
sees the block only once all of it is there.

A load sends GETs (GETEX with a `ttl`: a hit renews it) down one pooled connection and
reads each value's payload straight into its slot while the job lives (`gets.py`, under
the job's `SocketGuard`), then checks the frame there; a value of an unexpected length
is read into the thread's scratch buffer instead, checked there and never copied into
the slot unless it passes. As the contract allows, a failed key's slot may hold the
bytes read. A block gone (expired,
evicted), half gone, or failing its checks fails its key; what must be deleted is
handed back to the event loop, which deletes it.

Errors that say the node does not serve (connection errors, CLUSTERDOWN) raise, for
the job to fail the node; per-command errors (out of memory, MOVED) fail their key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial

from redis.client import Redis as SyncRedis

from tierkv.contract.framing import Payload, slice_payload
from tierkv.tier import (
    Batch,
    CorruptBlock,
    ForeignBlock,
    Framer,
    OffloadKey,
    PrimaryView,
    SlotGuard,
)
from tierkv_redis.failures import command_error, is_command_error
from tierkv_redis.gets import Place, Placed, Reply, pack_get, read_values
from tierkv_redis.names import BlockNames
from tierkv_redis.sockets import SocketGuard
from tierkv_redis.wire import Pieces, send_sets, send_straight, set_pieces

Loaded = tuple[dict[OffloadKey, str], list[OffloadKey], list[OffloadKey]]
"""A load's batch: (failed keys with the reason, keys whose stored values must be
deleted, keys Redis no longer has)."""


class Transfers:
    """The thread side of stores and loads for one tier: its names, framer, slots and
    `ttl`; `report_foreign` hears of blocks of another trust domain (left in place)."""

    def __init__(
        self,
        names: BlockNames,
        framer: Framer,
        primary: PrimaryView,
        ttl_ms: int | None,
        report_foreign: Callable[[Iterable[OffloadKey]], None],
        *,
        in_turn: bool = False,
    ) -> None:
        self.names = names
        self.in_turn = in_turn  # commands sent one at a time, not pipelined
        self.framer = framer
        self.primary = primary
        self.ttl_ms = ttl_ms
        self.report_foreign = report_foreign

    # -- stores ---------------------------------------------------------------------
    def store(self, sync: SyncRedis, batch: Batch, guard: SlotGuard) -> dict[OffloadKey, str]:
        """Worker thread: frame each block of `batch` (reading its slot while the job
        lives) and SET it; the keys Redis refused, with the reason. Blocks sent in
        turn go straight from their slots under the job's `SocketGuard` (`send_straight`:
        no copy of the block in this process); others are packed into one `bytes`
        per command first (one copy) and pipelined."""
        if self.in_turn and isinstance(guard, SocketGuard):
            owners = [key for key, _ in batch for _ in range(self.names.parts_of(key))]
            makers = [partial(self._pieces_of, key, slot) for key, slot in batch]
            outcomes = send_straight(sync.connection_pool, makers, guard)
            if outcomes is not None:
                return _refused(owners, outcomes)
        px = self.ttl_ms
        ended = {key: "redis store: the job ended before this block was read" for key, _ in batch}
        packed: list[bytes] = []
        owners = []  # which key each packed command belongs to
        for key, slot in batch:
            with guard.hold() as alive:
                if not alive:
                    return ended
                payload = self.primary.payload(slot)
                header = self.framer.encode_header(key, payload)
                block_commands = self.pack_block(key, header, payload, px)
                # the slot's view must not outlive the guard: the send below may
                # outlast the job (an abandoned thread) and the slab's owner
                # cannot unmap it while any view of it lives
                del payload
            packed.extend(block_commands)
            owners.extend([key] * len(block_commands))
        return _refused(owners, send_sets(sync.connection_pool, packed, in_turn=self.in_turn))

    def _pieces_of(self, key: OffloadKey, slot: int) -> list[Pieces]:
        """The SETs of the block in `slot` as pieces over its bytes (while the job
        lives: `send_straight` calls this under the job's guard, and releases the
        views after: they are this call's own, not the primary's)."""
        payload = _own_views(self.primary.payload(slot))
        header = self.framer.encode_header(key, payload)
        return self.block_pieces(key, header, payload, self.ttl_ms)

    def pack_block(
        self, key: OffloadKey, header: bytes, payload: Payload, px: int | None
    ) -> list[bytes]:
        """The packed SETs of one block (`block_pieces`), each one exact `bytes`: the
        payload is copied once, into it."""
        return [b"".join(pieces) for pieces in self.block_pieces(key, header, payload, px)]

    def block_pieces(
        self, key: OffloadKey, header: bytes, payload: Payload, px: int | None
    ) -> list[Pieces]:
        """The SETs of one block: one command, or one per part with the later parts
        first and the main name (header and first bytes) last, so a lookup sees the
        block only once all of it is there; each as pieces over `payload` (no copy)."""
        names = self.names.all(key)
        if len(names) == 1:
            return [set_pieces(names[0].encode(), header, payload, px)]
        skip = len(header)  # frame offsets -> payload offsets
        bounds = self.names.part_bounds(key)
        commands = [
            set_pieces(names[i].encode(), b"", slice_payload(payload, start - skip, end - skip), px)
            for i, (start, end) in enumerate(bounds)
            if i
        ]
        first_end = bounds[0][1]
        first = slice_payload(payload, 0, first_end - skip)
        commands.append(set_pieces(names[0].encode(), header, first, px))
        return commands

    # -- loads ----------------------------------------------------------------------
    def load(self, sync: SyncRedis, batch: Batch, guard: SlotGuard) -> Loaded:
        """Worker thread: GET each block of `batch` and check its frame. With the
        job's `SocketGuard` each value is read straight into its slot while the job
        lives and checked there; otherwise into scratch, then checked and copied."""
        px = self.ttl_ms  # GETEX renews the ttl of a block read
        names = [name for key, _ in batch for name in self.names.all(key)]
        # a block of regions is read through scratch and copied into them (one copy)
        direct = isinstance(guard, SocketGuard) and self.primary.region_count == 1
        places = self._places(batch) if direct else None
        values = read_values(
            sync.connection_pool,
            [pack_get(n.encode(), px) for n in names],
            places=places,
            guard=guard if direct and isinstance(guard, SocketGuard) else None,
            in_turn=self.in_turn,
        )
        errors: dict[OffloadKey, str] = {}
        doomed: list[OffloadKey] = []  # keys whose stored values must go
        gone: list[OffloadKey] = []  # keys Redis no longer has (expired, evicted)
        at = 0
        for key, slot in batch:
            count = self.names.parts_of(key)
            parts = values[at : at + count]
            at += count
            why = self._missing(key, parts, doomed, gone)
            if why is None:
                why = self._copy(key, slot, parts, doomed, guard)
            if why is not None:
                errors[key] = why
        return errors, doomed, gone

    def _places(self, batch: Batch) -> list[Place | None]:
        """Where each GET's value goes: the frame's header to scratch, its payload
        (or the payload's piece in this part) straight into the key's slot."""
        places: list[Place | None] = []
        block = self.primary.block
        for key, slot in batch:
            view = partial(block, slot)
            head = self.framer.header_bytes(key)
            bounds = self.names.part_bounds(key)
            if bounds[0][1] < head:  # a first part shorter than the header: scratch
                places.extend([None] * len(bounds))
                continue
            for i, (start, end) in enumerate(bounds):
                if i == 0:
                    places.append(Place(view, head, 0, end - head))
                else:
                    places.append(Place(view, 0, start - head, end - head))
        return places

    def _missing(
        self,
        key: OffloadKey,
        parts: Sequence[Reply],
        doomed: list[OffloadKey],
        gone: list[OffloadKey],
    ) -> str | None:
        """Why the values of `key` cannot be read (refused, gone, half gone), noting
        what must be deleted; None when every part is there."""
        bad = next((p for p in parts if isinstance(p, BaseException)), None)
        if bad is not None:
            if not is_command_error(bad):
                raise bad
            return command_error(bad)
        count = len(parts)
        if parts[0] is None:
            gone.append(key)
            if count > 1 and any(p is not None for p in parts):
                doomed.append(key)
            return "not in redis"
        if any(p is None for p in parts):
            missing = sum(p is None for p in parts)
            doomed.append(key)
            return f"{missing} of {count} parts missing (evicted or expired); deleted"
        return None

    def _copy(
        self,
        key: OffloadKey,
        slot: int,
        parts: Sequence[Reply],
        doomed: list[OffloadKey],
        guard: SlotGuard,
    ) -> str | None:
        """Check the frame of `key` (read into `slot`, or copy its payload there from
        scratch) while the job lives; why not, noting a corrupt block for deletion."""
        placed = [p for p in parts if isinstance(p, Placed)]
        frames = [p for p in parts if isinstance(p, bytes | memoryview)]
        with guard.hold() as alive:
            if not alive:
                return "redis load: the job ended before this block was written"
            try:
                if placed and frames:
                    raise CorruptBlock("its parts have not the lengths its frame gives")
                if placed:  # already in the slot: checked there
                    self.framer.check_frame(placed[0].head, key, self.primary.block(slot))
                elif len(frames) == 1:
                    self.framer.decode_into(key, frames[0], self.primary.payload(slot))
                else:  # straight from the parts into the slot, no joined copy
                    self.framer.decode_parts_into(key, frames, self.primary.payload(slot))
            except ForeignBlock as exc:  # another trust domain's block: left in place
                self.report_foreign([key])
                return f"not this server's block: {exc}"
            except CorruptBlock as exc:
                doomed.append(key)
                return f"corrupt block deleted: {exc}"
        return None


def _own_views(payload: Payload) -> Payload:
    """Fresh views of `payload`'s buffers, which may be released without touching
    views the primary keeps (LMCache's lent objects are such views)."""
    if isinstance(payload, tuple):
        return tuple(memoryview(region) for region in payload)
    return memoryview(payload)


def _refused(
    owners: Sequence[OffloadKey], outcomes: Sequence[BaseException | None]
) -> dict[OffloadKey, str]:
    """The keys whose SETs Redis refused, with the reason (`owners[i]` sent command
    i); an error that says the node does not serve (CLUSTERDOWN) raises."""
    refused: dict[OffloadKey, str] = {}
    for key, exc in zip(owners, outcomes):
        if exc is not None and key not in refused:
            if not is_command_error(exc):  # CLUSTERDOWN: the node, not this key
                raise exc
            refused[key] = command_error(exc)
    return refused
