"""One `store` call, as a state object: the algorithm of `Cascader.store` step by step.

A store places its new blocks in key order, window by window, into the room the
primary gives stores (see `tierkv.cache.cascade` for the whole story): each window is
copied from the source, made ready, and sent on to the tiers at once. Keys another
store or a promotion is writing are settled at the end (present once that write
succeeded, written by this store if it failed); keys someone else stored meanwhile are
skipped; when nothing in flight can make room, the rest is rejected with the reason.

`StoreRun` holds what the loop steers by (the keys still to place and how far it got,
what is pending, already present, stored and rejected, the deadline, whether the
store streams) and has one method per step, so `run` reads as the algorithm.
`StoreWatch` follows what the store's cascades did, so a later window of a streaming
store evicts only blocks a tier has taken.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import anyio

from tierkv.blocks import BlockSource
from tierkv.cache.core import CacheCore
from tierkv.cache.index import KeyIndex
from tierkv.cache.results import StoreResult
from tierkv.cache.writeback import WriteBack
from tierkv.contract.jobs import ReqContext
from tierkv.contract.keys import OffloadKey
from tierkv.contract.units import format_size
from tierkv.quotas.book import tenant_name
from tierkv.room import Kind

_NO_CTX = ReqContext()


class StoreWatch:
    """What one store's cascades did: keys of the request that no tier accepted (and
    that no cascade still carries) are `unsafe` to evict while the store runs."""

    def __init__(self, index: KeyIndex) -> None:
        self.index = index
        self.outstanding: dict[OffloadKey, int] = {}
        self.accepted: set[OffloadKey] = set()
        self.unsafe: set[OffloadKey] = set()

    def sent(self, keys: Sequence[OffloadKey]) -> None:
        for key in keys:
            self.outstanding[key] = self.outstanding.get(key, 0) + 1

    def settled(self, keys: Sequence[OffloadKey], ok_keys: Sequence[OffloadKey]) -> None:
        self.accepted.update(ok_keys)
        for key in keys:
            left = self.outstanding.get(key, 1) - 1
            if left > 0:
                self.outstanding[key] = left
                continue
            self.outstanding.pop(key, None)
            if key not in self.accepted:
                self.unsafe.add(key)

    def placed(self, keys: Sequence[OffloadKey]) -> None:
        """`keys` are in the primary and every cascade for them has been started."""
        for key in keys:
            # (dirty blocks are never evicted anyway)
            if (
                key not in self.outstanding
                and key not in self.accepted
                and self.index.is_clean(key)
            ):
                self.unsafe.add(key)

    def declined(self, keys: Iterable[OffloadKey]) -> None:
        """Admission kept `keys` out of a tier on purpose: evictable like accepted ones."""
        self.accepted.update(keys)

    def may_evict(self, key: OffloadKey) -> bool:
        return key not in self.unsafe and self.index.is_clean(key)


class Cascades(Protocol):
    """Where a store sends the blocks it placed (`Cascader.after_store`)."""

    def after_store(
        self,
        keys: Sequence[OffloadKey],
        watch: StoreWatch | None = None,
        ctx: ReqContext | None = None,
    ) -> None: ...


def store_window(num_blocks: int) -> int:
    """Blocks a streaming store places per window: a quarter of the primary, so
    copying a window overlaps the cascade of the one before."""
    return max(1, num_blocks // 4)


class StoreRun:
    """The state of one store; `run` places its new keys and returns the result."""

    def __init__(
        self,
        core: CacheCore,
        writeback: WriteBack,
        cascades: Cascades,
        position: dict[OffloadKey, int],
        skipped: list[OffloadKey],
        ctx: ReqContext | None = None,
    ) -> None:
        self.core = core
        self.ctx = ctx or _NO_CTX  # whose store: its tenant owns what it places
        self.primary = core.primary
        self.writeback = writeback
        self.cascades = cascades
        self.window = store_window(core.primary.num_blocks)
        self.position = position  # key -> its index in the source
        self.skipped = skipped  # left out on purpose (tierkv.retention)
        resident, in_flight, new = core.primary.partition(position)
        self.new = new  # keys to place, in key order; `new[:pos]` are dealt with
        self.pos = 0
        # keys another store or a promotion is writing right now: `already_present`
        # only once that write succeeded; if it fails, this store writes them
        self.pending: list[OffloadKey] = list(in_flight)
        self.already = resident
        self._resident = len(resident)  # `already[:_resident]` are in key order
        self.stored: list[OffloadKey] = []
        self.rejected: list[OffloadKey] = []
        self.error: str | None = None
        self.late_error: str | None = None  # why `settle_pending` rejected keys
        self.watch = StoreWatch(core.index)
        self.placed: list[OffloadKey] = []  # stored, not yet told to the watch (needed lazily)
        self.deadline = float("inf")  # set when the run starts
        self.streaming = False  # a window had to be smaller than the rest
        self.quota_declined = False  # the rest was declined for the tenant's quota

    async def run(self, src: BlockSource) -> StoreResult:
        """Place every new key, settle what others were writing; on no room, reject
        the rest."""
        self.deadline = anyio.current_time() + self.core.config.store_timeout
        while self.pos < len(self.new) or self.pending:
            if self.pos >= len(self.new):
                await self.settle_pending()
            elif self.new[self.pos] in self.primary:
                self.skip_stored_meanwhile()
            elif not await self.place_window(src):
                break
        if self.error is None:  # a later wait for room may have cleared it
            self.error = self.late_error
        if self.error is not None:
            self.reject_rest()
        self.core.counters.store_skipped += len(self.skipped)  # counted once the store ran
        self.core.tenants.stored(self.ctx.tenant, len(self.stored), len(self.rejected))
        if self.quota_declined and self.rejected:
            self.core.quota_declined(self.ctx.tenant, len(self.rejected))
        if len(self.already) != self._resident:  # some were settled later: key order
            self.already.sort(key=self.position.__getitem__)
        return StoreResult(
            stored=tuple(self.stored),
            already_present=tuple(self.already),
            rejected=tuple(self.rejected),
            error=self.error,
            skipped=tuple(self.skipped),
        )

    # -- the steps ---------------------------------------------------------------------
    async def settle_pending(self) -> None:
        """Every new key is placed: wait for the writes others were making of the
        pending keys. Those that succeeded are present; those whose write failed are
        this store's to place now; those still written at the deadline are rejected."""
        ready, lost, late = await self._settle(self.pending)
        self.already.extend(ready)
        self.new, self.pos, self.pending = lost, 0, []
        if late:
            self.late_error = self.error = (
                "another store or promotion of these blocks was still writing "
                f"them at store_timeout ({self.core.config.store_timeout:g}s)"
            )
            self.rejected.extend(late)

    def skip_stored_meanwhile(self) -> None:
        """The next key was stored by someone else meanwhile: present, or pending."""
        key = self.new[self.pos]
        (self.already if self.primary.is_ready(key) else self.pending).append(key)
        self.pos += 1

    async def place_window(self, src: BlockSource) -> bool:
        """Copy the next window into the primary and send it on; with no room, make
        room or wait for it. False when the rest is to be rejected (`error` says why)."""
        rest = len(self.new) - self.pos
        size = self._window(rest)
        got: list[OffloadKey] = []
        slots: list[int] = []
        if size:
            self.streaming = self.streaming or size < rest
            # a streaming store waits for a write-through tier that is behind rather
            # than have the window's cascade dropped: its blocks must leave the
            # primary to make room for the next windows (a store that fits never
            # waits here; its cascade is dropped and counted instead)
            behind = self.streaming and self._behind(size * self.core.block_bytes)
            if behind and await self._wait():
                return True
            want = self.new[self.pos : self.pos + size]  # the primary skips keys stored meanwhile
            got, slots = self._reserve(want)
        else:
            want = self.new[self.pos : self.pos + min(self.window, rest)]
        if not got:
            if self.primary.at_quota(self.ctx.tenant):
                # its own blocks in flight (this store's cascades, its loads) may
                # become evictable: wait for a release, as a streaming store waits
                if self._may_free_room() and await self._wait_release():
                    return True
                self.error = self._quota_full()
                return False
            self.error = await self._await_room(want)
            return self.error is None
        await self._copy(src, got, slots)
        self.cascades.after_store(got, self.watch, self.ctx)
        self.placed.extend(got)
        self._advance(want, got)
        return True

    def reject_rest(self) -> None:
        """The store stops: keys not placed are present if ready (a write in flight
        is not), else rejected and counted. No key rejected: no error either."""
        for key in [*self.new[self.pos :], *self.pending]:
            (self.already if self.primary.is_ready(key) else self.rejected).append(key)
        self.core.primary_stats.drops += len(self.rejected)
        self.core.counters.store_rejected += len(self.rejected)
        if not self.rejected:
            self.error = None

    # -- placing a window --------------------------------------------------------------
    def _reserve(self, want: list[OffloadKey]) -> tuple[list[OffloadKey], list[int]]:
        """Slots for the longest prefix of `want` that fits, evicting only what this
        store may evict: not its own blocks no tier has taken, nor dirty ones."""
        watch = self.watch
        if self.placed:  # a later window may evict: this request's earlier blocks must be safe
            watch.placed(self.placed)
            self.placed.clear()
        veto = watch.may_evict if watch.unsafe or self.core.index.dirty_count else None
        prepared = self.primary.prepare_store_prefix(want, may_evict=veto, tenant=self.ctx.tenant)
        return prepared.keys_to_store, prepared.slots

    async def _copy(self, src: BlockSource, got: list[OffloadKey], slots: list[int]) -> None:
        """Copy the window from the source into its slots and make the blocks ready
        (freed again if the copy fails)."""
        primary = self.primary
        success = False
        try:
            await src.copy_to_slots(primary.view, [self.position[k] for k in got], slots)
            success = True
        finally:
            primary.complete_store(got, success=success)
        core = self.core
        core.tenants.placed(self.ctx.tenant, got)
        stats = core.primary_stats
        stats.store_jobs += 1
        stats.blocks_stored += len(got)
        stats.bytes_in += len(got) * core.block_bytes
        self.stored.extend(got)

    def _advance(self, want: list[OffloadKey], got: list[OffloadKey]) -> None:
        """Move past the placed window; keys it skipped were stored meanwhile."""
        if got == want[: len(got)]:  # nothing was skipped: a prefix of `new[pos:]`
            self.pos += len(got)
            return
        got_set, last = set(got), got[-1]
        while True:
            key = self.new[self.pos]
            self.pos += 1
            if key not in got_set:
                (self.already if self.primary.is_ready(key) else self.pending).append(key)
            if key == last:
                break

    # -- room --------------------------------------------------------------------------
    def _streams(self) -> bool:
        """Whether a block that leaves the primary can land somewhere below."""
        return any(
            h.opened and h.policy in ("write_through", "write_back") for h in self.core.tiers
        )

    def _behind(self, nbytes: int) -> bool:
        """Whether a write-through tier would drop a cascade of `nbytes` now (it already
        has `max_inflight_bytes` in flight)."""
        for h in self.core.tiers:
            stats = h.stats
            if (
                h.policy == "write_through"
                and stats.inflight_bytes
                and stats.inflight_bytes + nbytes > h.config.max_inflight_bytes
                and h.usable("store")
            ):
                return True
        return False

    def _may_free_room(self) -> bool:
        """Whether something in flight will release primary slots."""
        primary = self.primary
        # slots held for an abandoned tier job come back when it ends: maybe never
        held = primary.num_held - primary.num_quarantined
        return self.core.background > 0 or primary.num_staged > 0 or held > 0

    def _window(self, rest: int) -> int:
        """How many of the `rest` blocks the next window places: all when they fit the
        store's room, else a quarter of the primary (so copying a window overlaps the
        cascade of the one before), less when the room is smaller; 0 for no room now.
        The promotions' unheld share is taken only when nothing in flight can release
        room, or the deadline passed: a store always progresses."""
        room = self._room()
        return rest if rest <= room else min(self.window, room)

    def _room(self) -> int:
        """The store's room now (see `_window`)."""
        primary = self.primary
        room = primary.store_room()
        if not room and (not self._may_free_room() or anyio.current_time() >= self.deadline):
            room = primary.store_room(take_aside=True)
        return room

    async def _wait(self) -> bool:
        """Wait, up to the deadline, until room a store can use is released. False
        when the deadline has passed."""
        left = self.deadline - anyio.current_time()
        if left <= 0:
            return False
        self.core.counters.store_waits += 1
        await self.primary.wait_for_room(Kind.STORE, 1, left)
        return True

    async def _await_room(self, want: Sequence[OffloadKey]) -> str | None:
        """No block of `want` could be placed: write dirty victims back, or wait for
        room. None to try again, or why the rest of the store is rejected."""
        if self.writeback.enabled:  # dirty victims: write them back, within the deadline
            made = False
            with anyio.move_on_after(max(0.0, self.deadline - anyio.current_time())):
                made = await self.writeback.make_room(len(want))
            if made or self._room_now(want):  # loads may have let go meanwhile
                return None
        if not self._streams() or not self._may_free_room():
            return (
                "the primary tier has no room: its blocks are held by reads, writes "
                "or cascades, or no lower tier accepted the blocks that would make room"
            )
        if not await self._wait():
            timeout = self.core.config.store_timeout
            return f"no room in the primary tier within store_timeout ({timeout:g}s)"
        return None

    async def _wait_release(self) -> bool:
        """Wait, up to the deadline, for the primary to release room of any kind (a
        store at its quota can use only its own blocks'). False past the deadline."""
        left = self.deadline - anyio.current_time()
        if left <= 0:
            return False
        self.core.counters.store_waits += 1
        await self.primary.wait_for_release(left)
        return True

    def _quota_full(self) -> str:
        """The store's tenant holds its primary quota and none of its own blocks may
        be evicted now: the rest is declined (never another tenant's block taken)."""
        self.quota_declined = True
        book = self.primary.quotas
        assert book is not None
        name = tenant_name(self.ctx.tenant)
        cap = book.cap(name) or 0
        return (
            f"tenant {name!r} holds its quota of the primary tier "
            f"({format_size(cap * self.core.block_bytes)}) and none of its own blocks can "
            "be evicted now (being read, written, or not yet taken by a lower tier)"
        )

    def _room_now(self, want: Sequence[OffloadKey]) -> bool:
        """Whether a slot for the next key is there now (free, or a victim this store
        may evict): the next window then places at least one block."""
        primary = self.primary
        if not self._room():
            return False
        if primary.num_free:
            return True
        wanted = set(want)
        watch = self.watch
        return bool(primary.candidates(1, lambda k: k not in wanted and watch.may_evict(k)))

    async def _settle(
        self, keys: list[OffloadKey]
    ) -> tuple[list[OffloadKey], list[OffloadKey], list[OffloadKey]]:
        """Wait (up to the deadline) for the writes others are making of `keys` to
        end. Returns (ready now, lost: the write failed and the slot is gone, still
        being written at the deadline)."""
        primary, index = self.primary, self.core.index
        while True:
            writing = [k for k in keys if k in primary and not primary.is_ready(k)]
            left = self.deadline - anyio.current_time()
            if not writing or left <= 0:
                break
            flight = next((f for k in writing if (f := index.flight(k)) is not None), None)
            with anyio.move_on_after(left):
                if flight is not None:  # a promotion: its end is an event
                    await flight.wait()
                else:  # another store's copy into its slots: short
                    await anyio.sleep(0.001)
        ready = [k for k in keys if primary.is_ready(k)]
        lost = [k for k in keys if k not in primary]
        late = [k for k in keys if k in primary and not primary.is_ready(k)]
        return ready, lost, late
