r"""The primary tier: a fixed slab of host memory, the only tier that talks to the GPU.

The slab is one `num_blocks x block_bytes` uint8 tensor (pinned when CUDA is present,
so GPU copies can be asynchronous). Each resident key owns one row (a *slot*) and goes
through a small life cycle:

    prepare_store -> WRITING --complete_store(ok)--> READY --(no readers)--> evictable
                        \--complete_store(fail)--> freed

A WRITING slot is neither readable nor evictable; a READY slot with readers (jobs
reading it: a load to the GPU, a cascade to a lower tier) is not evictable. Such
blocks are *pinned* in the eviction policy, which keeps them out of its victim order:
choosing victims never walks past held blocks. The number of evictable blocks is kept
as a counter, so a store that cannot fit is refused in O(len(keys)).

The cache may veto further victims (`may_evict`: dirty write-back blocks, keys of the
request being stored); `prepare_store_prefix` reserves the longest prefix of a key
list that fits, which is how a store larger than the slab streams through it.

The primary also owns its *room*: who may take how many slots. Promotions (blocks read
up from a lower tier for a load) hold at most `promotion_share` slots at once while
they are written (`prepare_promotion`); stores leave the part of that share no
promotion holds yet free or evictable (`store_room`), so neither starves the other.
A store or promotion that finds no room waits in `wait_for_room`, and is woken only
when room it can use is released (`tierkv.room`). The cache asks through this API and
never reads the block table itself.

Every change to the block table is an event (`stored`, or `removed` for victims). They
wait in the primary for `take_events`, or, once the cache has set an event sink
(`set_event_sink`), go to it the moment they happen: then no caller has to remember to
collect them, and they stay ahead of whatever a tier reports afterwards.

Not thread-safe: the orchestrator drives it from the event loop thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import anyio
import torch
from pydantic import BaseModel, ConfigDict, Field

from tierkv.contract.errors import BlockStateError, ConfigError
from tierkv.contract.events import OffloadingEvent
from tierkv.contract.keys import OffloadKey
from tierkv.contract.slab import PrimaryView
from tierkv.contract.units import Size, format_size
from tierkv.layout import KVLayout
from tierkv.pinning import HostMemory
from tierkv.policies import CanEvict, EvictionPolicy, evict_any, make_policy
from tierkv.quotas.book import QuotaBook, tenant_name
from tierkv.room import Kind, RoomWaiters

logger = logging.getLogger(__name__)

MEDIUM = "cpu"

EventSink = Callable[[OffloadingEvent], None]


class PrimaryConfig(BaseModel):
    """The `primary:` section of the YAML."""

    model_config = ConfigDict(extra="forbid")

    capacity: Size = Field(description="bytes of host memory for the slab, e.g. 8GiB")
    eviction: Literal["lru", "arc"] = "lru"
    pin_memory: Literal["auto"] | bool = Field(
        default="auto", description="pin the slab; auto pins when CUDA is available"
    )


class HostSlab(PrimaryView):
    """The core's view of the slab: the contract's `PrimaryView` plus the torch tensor
    the GPU worker and host-block copies use. Tiers only see the `PrimaryView` part."""

    def __init__(self, slab: torch.Tensor, namespace: str) -> None:
        if slab.dtype != torch.uint8 or slab.dim() != 2 or not slab.is_contiguous():
            raise ValueError("the primary slab must be a contiguous 2-D uint8 tensor")
        if slab.device.type != "cpu":
            raise ValueError(f"the primary slab must live in host memory, not {slab.device}")
        super().__init__(slab.numpy(), int(slab.shape[1]), namespace)
        self.tensor = slab


class PrepareStoreOutput(NamedTuple):
    """What `prepare_store` decided: which keys to write into which slots, and which
    resident keys it evicted to make room."""

    keys_to_store: list[OffloadKey]
    slots: list[int]
    evicted_keys: list[OffloadKey]


class Partition(NamedTuple):
    """A request's keys by where they stand in the primary, each list in key order."""

    resident: list[OffloadKey]  # ready: readable now
    in_flight: list[OffloadKey]  # being written (a store or a promotion)
    absent: list[OffloadKey]


@dataclass(slots=True)
class _Block:
    slot: int
    ready: bool = False
    readers: int = 0
    staged: bool = False  # written by a promotion: counts against its share


def resolve_pin_memory(setting: Literal["auto"] | bool) -> bool:
    """Whether to pin the slab for `pin_memory: auto|true|false`."""
    if setting == "auto":
        return torch.cuda.is_available()
    if setting and not torch.cuda.is_available():
        raise ConfigError(
            "primary.pin_memory: true needs CUDA, and no CUDA device is available; "
            "use 'auto' (pins only when CUDA is present) or false"
        )
    return bool(setting)


class PrimaryTier:
    """The CPU slab plus its block table and eviction policy."""

    medium = MEDIUM

    def __init__(
        self,
        num_blocks: int,
        block_bytes: int,
        *,
        eviction: str = "lru",
        pin_memory: Literal["auto"] | bool = "auto",
        namespace: str = "default",
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the primary needs at least one block, got num_blocks={num_blocks}")
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        pinned = resolve_pin_memory(pin_memory)
        # exact-size pinning (tierkv.pinning): torch's pinned allocator would round
        # the slab up to a power of two
        self.memory = HostMemory(num_blocks, block_bytes, pin=pinned)
        self.view = HostSlab(self.memory.tensor, namespace)
        self.pinned = pinned
        self.policy: EvictionPolicy = make_policy(eviction, num_blocks)
        self._blocks: dict[OffloadKey, _Block] = {}
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives slot 0 first
        self._evictable = 0
        self._events: list[OffloadingEvent] = []  # kept for take_events (no sink)
        self._sink: EventSink | None = None
        self.promotion_share = 0  # slots promotions may hold at once (`set_promotion_share`)
        self._staged = 0  # slots promotions hold now
        self._waiters = RoomWaiters()
        self.quotas: QuotaBook | None = None  # per-tenant quotas (`set_quotas`)
        self._released: anyio.Event | None = None  # set at the next release of room
        self._quarantined = 0  # slots held for abandoned tier jobs (`quarantine`)

    @classmethod
    def from_config(cls, config: PrimaryConfig, layout: KVLayout, namespace: str) -> PrimaryTier:
        num_blocks = int(config.capacity) // int(layout.block_bytes)
        if num_blocks < 1:
            raise ConfigError(
                f"primary.capacity: {format_size(int(config.capacity))} holds no block of "
                f"{format_size(int(layout.block_bytes))}; raise it to at least one block"
            )
        return cls(
            num_blocks,
            int(layout.block_bytes),
            eviction=config.eviction,
            pin_memory=config.pin_memory,
            namespace=namespace,
        )

    # -- introspection ------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.view.num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        """Ready blocks with no readers: what a store may evict. O(1)."""
        return self._evictable

    @property
    def num_staged(self) -> int:
        """Slots promotions hold now (being written from a lower tier)."""
        return self._staged

    @property
    def num_held(self) -> int:
        """Slots neither free nor evictable: being written or read."""
        return self.num_blocks - len(self._free) - self._evictable

    @property
    def wakeups(self) -> int:
        """Waiters woken for room so far (each only for room it could use)."""
        return self._waiters.wakeups

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def keys_in_slots(self) -> list[OffloadKey]:
        """Every key with a slot (ready or being written). O(n): for introspection."""
        return list(self._blocks)

    def slot_of(self, key: OffloadKey) -> int | None:
        block = self._blocks.get(key)
        return None if block is None else block.slot

    def is_ready(self, key: OffloadKey) -> bool:
        block = self._blocks.get(key)
        return block is not None and block.ready

    def readers(self, key: OffloadKey) -> int:
        block = self._blocks.get(key)
        return 0 if block is None else block.readers

    def _is_evictable(self, block: _Block) -> bool:
        return block.ready and block.readers == 0

    def partition(self, keys: Iterable[OffloadKey]) -> Partition:
        """Split `keys` into resident (ready), in flight (being written) and absent."""
        resident: list[OffloadKey] = []
        in_flight: list[OffloadKey] = []
        absent: list[OffloadKey] = []
        get = self._blocks.get
        for key in keys:
            block = get(key)
            if block is None:
                absent.append(key)
            elif block.ready:
                resident.append(key)
            else:
                in_flight.append(key)
        return Partition(resident, in_flight, absent)

    def ready_keys(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """The keys of `keys` that are ready here, in order (a lookup's first pass)."""
        get = self._blocks.get
        return [k for k in keys if (b := get(k)) is not None and b.ready]

    # -- quotas: how much each tenant may hold ---------------------------------------
    def set_quotas(self, book: QuotaBook | None) -> None:
        """Hold each tenant to its quota (`tierkv.quotas.book`): from now on a store or
        promotion takes room by the book's rule and the book counts who holds what.
        Set before the first block is placed (blocks placed before belong to no one,
        which the book counts as the default tenant's)."""
        self.quotas = book

    def at_quota(self, tenant: str | None) -> bool:
        """Whether a store of `tenant` can only evict its own blocks now: it holds its
        cap or more, and may take no free slot. False without quotas."""
        book = self.quotas
        if book is None:
            return False
        name = tenant_name(tenant)
        return book.over(name) and not book.usable_free(name, len(self._free))

    # -- room: who may take how many slots --------------------------------------------
    def set_promotion_share(self, slots: int) -> None:
        """Let promotions hold up to `slots` slots at once (0: no promotions, stores
        set nothing aside). At most every slot."""
        self.promotion_share = max(0, min(int(slots), self.num_blocks))
        self._wake()

    def _aside(self) -> int:
        """Room stores leave alone for promotions: the share no promotion holds yet,
        never so much that a store lacks a quarter of the primary."""
        cap = self.num_blocks - max(1, self.num_blocks // 4)
        return max(0, min(self.promotion_share - self._staged, cap))

    def store_room(self, *, take_aside: bool = False) -> int:
        """Slots a store may take now (free or evictable), less the promotions' part
        unless `take_aside` (nothing in flight can release room: a store always
        progresses)."""
        room = len(self._free) + self._evictable
        return room if take_aside else max(0, room - self._aside())

    def promotion_room(self) -> int:
        """Slots a promotion may take now: free or evictable, within the share."""
        return max(0, min(self.promotion_share - self._staged, len(self._free) + self._evictable))

    async def wait_for_room(
        self, kind: Kind, need: int, timeout: float, *, again: bool = False
    ) -> bool:
        """Wait (up to `timeout` s) until room of `kind` covering `need` slots is
        released. True when woken (check again: a veto may still refuse it); `again`
        after such a refusal keeps the caller's turn."""
        return await self._waiters.wait(kind, need, timeout, again=again)

    def waiting(self, kind: Kind) -> int:
        """Tasks waiting for room of `kind` now."""
        return self._waiters.waiting(kind)

    async def wait_for_release(self, timeout: float) -> bool:
        """Wait (up to `timeout` s) for the next release of room of any kind: a block
        written, read or freed. For a store held to its tenant's quota, which can use
        only its own blocks' release and so must not take a place in the room queues
        (it would be woken for room others could use). True when something was
        released."""
        if timeout <= 0:
            return False
        if self._released is None:
            self._released = anyio.Event()
        released = self._released
        with anyio.move_on_after(timeout):
            await released.wait()
            return True
        return False

    def _wake(self) -> None:
        released, self._released = self._released, None
        if released is not None:
            released.set()
        if self._waiters:
            self._waiters.wake(
                {Kind.PROMOTION: self.promotion_room(), Kind.STORE: self.store_room()}
            )

    # -- operations ---------------------------------------------------------------
    def lookup(self, keys: Sequence[OffloadKey]) -> int:
        """How many leading `keys` are ready here. Changes nothing (see `touch`)."""
        hits = 0
        get = self._blocks.get
        for key in keys:
            block = get(key)
            if block is None or not block.ready:
                break
            hits += 1
        return hits

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Mark `keys` used; the first key ends the most recent."""
        self.policy.touch(keys)

    def _victim_filter(
        self,
        keys: Sequence[OffloadKey],
        may_evict: CanEvict | None,
        protected: set[OffloadKey] | None = None,
    ) -> CanEvict:
        """What may be evicted for a store of `keys`: none of `keys` (`protected`, the
        ones resident, when the caller knows them) and nothing `may_evict` refuses.
        Keys in the policy's victim order are ready and unread (the rest is pinned)."""
        if protected is None:
            protected = {k for k in keys if k in self._blocks}
        if not protected:
            return evict_any if may_evict is None else may_evict
        if may_evict is None:
            return lambda key: key not in protected
        return lambda key: key not in protected and may_evict(key)

    def candidates(self, limit: int, may_evict: CanEvict | None = None) -> list[OffloadKey]:
        """The next `limit` (at most) victims in policy order. Changes nothing."""
        return self.policy.candidates(limit, self._victim_filter((), may_evict))

    def prepare_store(
        self, keys: Sequence[OffloadKey], *, may_evict: CanEvict | None = None
    ) -> PrepareStoreOutput | None:
        """Reserve slots for the `keys` not yet resident, evicting if needed.

        Returns None, changing nothing, when not enough slots can be freed. Keys in
        `keys` are never evicted by this call, nor keys `may_evict` refuses. The
        reserved slots are WRITING until `complete_store`.
        """
        new_keys = list(dict.fromkeys(k for k in keys if k not in self._blocks))
        book = self.quotas
        if book is not None:  # the default tenant's store, by the quotas' rule
            admitted, victims = self._quota_room(
                new_keys, tenant_name(None), self._victim_filter(keys, may_evict)
            )
            if len(admitted) < len(new_keys):
                return None
            return self._reserve(new_keys, len(victims), set(victims).__contains__)
        shortfall = len(new_keys) - len(self._free)
        if shortfall > 0 and may_evict is None:
            protected_evictable = sum(
                1 for k in set(keys) if k in self._blocks and self._is_evictable(self._blocks[k])
            )
            if self._evictable - protected_evictable < shortfall:
                return None
        return self._reserve(new_keys, max(shortfall, 0), self._victim_filter(keys, may_evict))

    def prepare_store_prefix(
        self,
        keys: Sequence[OffloadKey],
        *,
        may_evict: CanEvict | None = None,
        tenant: str | None = None,
    ) -> PrepareStoreOutput:
        """Like `prepare_store`, but reserve the longest prefix of the new keys that
        fits (possibly none) instead of all or nothing. With quotas (`set_quotas`),
        the room is `tenant`'s by the book's rule and the new blocks are its."""
        blocks = self._blocks
        new_keys = [k for k in keys if k not in blocks]
        # all new (the common case): none of `keys` is resident, none to protect
        protected: set[OffloadKey] | None = None if len(new_keys) < len(keys) else set()
        new_keys = list(dict.fromkeys(new_keys))
        can_evict = self._victim_filter(keys, may_evict, protected)
        free = len(self._free)
        book = self.quotas
        if book is None:
            admitted, victims = self.policy.admit_prefix(new_keys, free, can_evict, pinned=True)
            return self._place(admitted, victims)
        name = tenant_name(tenant)
        admitted, victims = self._quota_room(new_keys, name, can_evict)
        committed = self.policy.admit(
            admitted, len(victims), set(victims).__contains__, pinned=True
        )
        assert committed is not None  # chosen from the victim order just now
        return self._place(admitted, victims, name)

    def _quota_room(
        self, new_keys: list[OffloadKey], name: str, can_evict: CanEvict
    ) -> tuple[list[OffloadKey], list[OffloadKey]]:
        """The longest prefix of `new_keys` tenant `name` has room for by its quota
        (free slots it may take, then the victims the quota rule allows), and those
        victims. Changes nothing."""
        book = self.quotas
        assert book is not None
        took = min(book.usable_free(name, len(self._free)), len(new_keys))
        victims = book.choose_victims(
            name, took, len(new_keys) - took, self.policy.candidates, can_evict
        )
        return new_keys[: took + len(victims)], victims

    def prepare_promotion(
        self,
        keys: Sequence[OffloadKey],
        *,
        may_evict: CanEvict | None = None,
        tenant: str | None = None,
    ) -> PrepareStoreOutput:
        """Reserve slots for the longest prefix of `keys` (none resident) that fits the
        promotions' share and the room, evicting only what `may_evict` allows (and,
        with quotas, what `tenant` may take). The slots are WRITING and count against
        the share until `complete_store`."""
        room = self.promotion_share - self._staged
        if room <= 0:
            return PrepareStoreOutput([], [], [])
        prepared = self.prepare_store_prefix(keys[:room], may_evict=may_evict, tenant=tenant)
        blocks = self._blocks
        for key in prepared.keys_to_store:
            blocks[key].staged = True
        self._staged += len(prepared.keys_to_store)
        return prepared

    def _reserve(
        self, new_keys: list[OffloadKey], shortfall: int, can_evict: CanEvict
    ) -> PrepareStoreOutput | None:
        victims = self.policy.admit(new_keys, shortfall, can_evict, pinned=True)
        if victims is None:
            return None
        return self._place(new_keys, victims)

    def _place(
        self, new_keys: list[OffloadKey], victims: list[OffloadKey], tenant: str | None = None
    ) -> PrepareStoreOutput:
        """Free the victims' slots and give them to `new_keys` (WRITING, pinned), which
        `tenant` owns when there are quotas."""
        blocks, free = self._blocks, self._free
        book = self.quotas
        if book is not None:
            book.remove(victims)
            book.add(tenant_name(tenant), new_keys)
        if victims:
            pop = blocks.pop
            free.extend([pop(key).slot for key in victims])
            self._evictable -= len(victims)
            self._emit(OffloadingEvent(tuple(victims), MEDIUM, removed=True))
        slots = free[len(free) - len(new_keys) :][::-1] if new_keys else []
        del free[len(free) - len(new_keys) :]
        blocks.update(zip(new_keys, map(_Block, slots)))  # WRITING: admitted pinned
        return PrepareStoreOutput(new_keys, slots, victims)

    def complete_store(
        self,
        keys: Iterable[OffloadKey],
        success: bool = True,
        *,
        readers: Mapping[OffloadKey, int] | None = None,
    ) -> None:
        """Finish a store or promotion: WRITING keys become READY, or on failure are
        freed; a promotion's slots go back to its share either way. `readers` hands
        new blocks straight to their readers (the loads waiting on a promotion), as
        `prepare_load` would, without their slots counting as room in between.

        Keys that are not being written (already ready, unknown) are left alone, so
        the whole key list of a `prepare_store` call may be passed back."""
        done: list[OffloadKey] = []
        blocks = self._blocks
        staged = 0
        if success:
            get = blocks.get
            for key in keys:
                block = get(key)
                if block is None or block.ready:
                    continue
                block.ready = True
                if block.staged:
                    block.staged = False
                    staged += 1
                done.append(key)
            unread = done  # a block being written has no readers (`prepare_load`)
            if readers:
                for key in done:
                    blocks[key].readers += readers.get(key, 0)
                unread = [k for k in done if blocks[k].readers == 0]
            if unread:
                self._evictable += len(unread)
                self.policy.unpin_many(unread)
        else:
            slots, staged = self._forget_writing(keys)
            self._free.extend(slots)
        self._staged -= staged
        if done:
            self._emit(OffloadingEvent(tuple(done), MEDIUM, removed=False))
        self._wake()

    def _forget_writing(self, keys: Iterable[OffloadKey]) -> tuple[list[int], int]:
        """Take the WRITING keys of `keys` out of the block table, the policy and the
        quota book (ready and unknown keys are left alone). Returns their slots, not
        yet freed, and how many of them a promotion's share counted."""
        blocks, slots, staged, gone = self._blocks, [], 0, []
        for key in keys:
            block = blocks.get(key)
            if block is None or block.ready:
                continue
            staged += block.staged
            del blocks[key]
            self.policy.discard(key)
            slots.append(block.slot)
            gone.append(key)
        if self.quotas is not None and gone:
            self.quotas.remove(gone)
        return slots, staged

    def quarantine(self, keys: Iterable[OffloadKey]) -> list[int]:
        """Forget WRITING `keys` (a promotion whose tier job was abandoned while it may
        still write their slots) but keep their slots from any use until `release`:
        not free, not readable, not in the block table; a promotion's share is given
        back. Returns the slots. Keys not being written are left alone."""
        slots, staged = self._forget_writing(keys)
        self._staged -= staged
        self._quarantined += len(slots)
        if staged:
            self._wake()
        return slots

    def release(self, slots: Sequence[int]) -> None:
        """Slots `quarantine` held are free again (the job that could write them ended)."""
        self._free.extend(slots)
        self._quarantined -= len(slots)
        self._wake()

    @property
    def num_quarantined(self) -> int:
        """Slots held for tier jobs abandoned while they could still write them."""
        return self._quarantined

    def prepare_load(self, keys: Sequence[OffloadKey]) -> list[int]:
        """Add a reader to each key and return their slots in key order.

        Every key must be READY; otherwise BlockStateError and nothing changes."""
        for key in keys:
            block = self._blocks.get(key)
            if block is None:
                raise BlockStateError(f"cannot load {key.hex()}: not in the primary tier")
            if not block.ready:
                raise BlockStateError(f"cannot load {key.hex()}: still being written")
        slots = []
        for key in keys:
            block = self._blocks[key]
            if block.readers == 0:
                self._evictable -= 1
                self.policy.pin(key)
            block.readers += 1
            slots.append(block.slot)
        return slots

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        """Drop the reader each key got from `prepare_load`.

        A key with no reader left to drop raises BlockStateError, changing nothing."""
        pending: dict[OffloadKey, int] = {}
        for key in keys:
            pending[key] = pending.get(key, 0) + 1
        for key, count in pending.items():
            block = self._blocks.get(key)
            if block is None or block.readers < count:
                raise BlockStateError(f"complete_load({key.hex()}) without a matching prepare_load")
        released = False
        for key, count in pending.items():
            block = self._blocks[key]
            block.readers -= count
            if block.readers == 0:
                self._evictable += 1
                self.policy.unpin(key)
                released = True
        if released:
            self._wake()

    # -- events -------------------------------------------------------------------
    def set_event_sink(self, sink: EventSink | None) -> None:
        """Send every event to `sink` as it happens (None: keep them for `take_events`
        again). Events still kept go to the new sink first, so none is lost or
        reordered."""
        self._sink = sink
        if sink is not None and self._events:
            for event in self.take_events():
                sink(event)

    def _emit(self, event: OffloadingEvent) -> None:
        if self._sink is not None:
            self._sink(event)
        else:
            self._events.append(event)

    def take_events(self) -> list[OffloadingEvent]:
        """Events since the last call, oldest first (none while a sink takes them)."""
        events, self._events = self._events, []
        return events
