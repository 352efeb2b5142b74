"""`TierkvL2Adapter`: a tierkv tier chain as an L2 adapter of LMCache's server mode.

LMCache 0.5.6 builds it through its plugin loader
(`lmcache.v1.distributed.l2_adapters.plugin_l2_adapter`) from
`{"type": "plugin", "module_path": "tierkv.integrations.lmcache", "class_name":
"TierkvL2Adapter", "adapter_params": {...}}` as `cls(adapter_params,
l1_memory_desc=...)`. LMCache's L1 (host memory) is the primary: each task's memory
objects are lent to the tiers as slots (`objects.LentSlots`) and read or written in
place; the tiers run on the process's one event-loop thread through the shared
guarded-tier driver (`SyncChain`: breaker, in-flight budget, answer checks,
deadline, reopen), one chain per object size (`chains.SizeChains`), whose instances
of a bounded tier share that tier's one `capacity` (`budget.SharedBudget`).

The calls come from LMCache's two controller threads (store, prefetch) and return at
once: each submit starts the work on the loop and answers with a task id; the
result is put in a table and its event fd signalled when the work ends
(`tasks.Completions`), never later than the chain's deadline plus a margin. Nothing
raises into LMCache's threads: a tier that fails, is slow or down makes a failed
bit (lookup, load) or a failed store; a submit that cannot start reports its task
failed at once. A lookup locks what it finds by claiming it in the tier that will
serve it (`locks.LockBook`, `tierkv.driver.claims`): that tier does not evict it
until LMCache unlocks it or the tier's `claim_lease` runs out.

The optional calls: `delete` removes keys from every tier; `list_l2_keys` pages
through the keys some tier holds, from the adapter's own record of them
(`record.KeyRecord`: tierkv's keys are hashed, a tier cannot give LMCache's keys
back), which also keeps LMCache's byte accounting; `get_usage` reports those bytes
against what the chains hold when full (`SizeChains.capacity_bytes`: the largest
tier's shared capacity, counted once whatever the sizes), so LMCache's L2 eviction
controller gets a usage fraction where every tier bounds itself.

Each `ObjectKey` carries its request's `cache_salt`: a task's keys are split by it, and
each part runs for its tenant (`ReqContext.tenant`: `salt-` and a digest of the salt,
never the salt; no salt is the default tenant).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import KeyEntry, KeyListPage
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import AdapterUsage, L2AdapterInterface
from lmcache.v1.platform import create_event_notifier

from tierkv.contract.keys import OffloadKey
from tierkv.contract.tenants import salt_tenant
from tierkv.driver.guarded import GuardedTier
from tierkv.driver.miss_log import MissLog
from tierkv.integrations.lmcache.chains import SizeChain, SizeChains, sizes_on_disk
from tierkv.integrations.lmcache.keys import offload_key
from tierkv.integrations.lmcache.locks import LockBook
from tierkv.integrations.lmcache.objects import object_bytes
from tierkv.integrations.lmcache.record import KeyRecord
from tierkv.integrations.lmcache.settings import AdapterSettings, resolve
from tierkv.integrations.lmcache.tasks import Completions, Parts, TaskIds

__all__ = ["TierkvL2Adapter"]

logger = logging.getLogger(__name__)

SALT_NAMES = 4096
"""Cache salts whose tenant names are kept (computed again past that)."""

PAGE_LIMIT = 10_000
"""The most keys one `list_l2_keys` page returns (a larger `page_size` gets this many
and a cursor): a page is built under the record's lock, which stores wait for."""


class TierkvL2Adapter(L2AdapterInterface):  # type: ignore[misc]
    """tierkv's tiers below LMCache's L1 (see the module docstring)."""

    def __init__(self, params: Any = None, l1_memory_desc: Any = None) -> None:
        super().__init__()  # capacity set below, once the tiers are known
        self.settings: AdapterSettings = resolve(params)
        self.l1_memory_desc = l1_memory_desc
        self._ids = TaskIds()
        self._stores: Completions[L2StoreResult] = Completions(create_event_notifier())
        self._lookups: Completions[Any] = Completions(create_event_notifier())
        self._loads: Completions[Any] = Completions(create_event_notifier())
        lease = max((float(t.claim_lease) for t in self.settings.tiers), default=0.0)
        self._locks = LockBook(lease)
        self._chains = SizeChains(self.settings, self._removed, {"engine": "lmcache"})
        self._record = KeyRecord(self.settings.record_keys)
        self._record_full_said = False
        self._state = threading.Condition()
        self._running = 0
        self._closed = False
        self._misses = MissLog(logger)
        self._salt_names: dict[str, str | None] = {}
        try:
            # sizes an nvme tier holds from an earlier process open too: the shared
            # capacity counts their blocks from the start
            for size in dict.fromkeys([*self.settings.object_bytes, *sizes_on_disk(self.settings)]):
                self._chains.get(size)
            # read once by LMCache's storage manager (`supports_global_eviction`),
            # right after it builds the adapter; `get_usage` keeps it current
            self._max_capacity_bytes = self._chains.capacity_bytes()
        except BaseException:
            self._chains.close()
            raise

    # -- event fds ----------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return self._stores.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookups.fileno()

    def get_load_event_fd(self) -> int:
        return self._loads.fileno()

    # -- store --------------------------------------------------------------------------
    def submit_store_task(self, keys: list[Any], objects: list[Any]) -> int:
        """Write each object to every tier; the task succeeds when some tier took every
        key, and counts the bytes of the keys taken."""
        return self._submit("store", self._store, keys, objects)

    def _store(self, task_id: int, keys: list[Any], objects: list[Any]) -> None:
        work = self._by_size(keys, [offload_key(k) for k in keys], objects)
        stored: dict[OffloadKey, tuple[Any, int]] = {}
        asked = sum(len(items) for items in work.values())
        self._begin()

        def finish() -> None:
            moved = sum(size for _, size in stored.values())
            self._end()
            self._stores.put(task_id, L2StoreResult(len(stored) == asked, moved))

        parts = Parts(len(work), finish)
        for (size, tenant), items in work.items():
            self._start(size, items, "store", stored, parts, tenant)

    def pop_completed_store_tasks(self) -> dict[int, Any]:
        return self._stores.take_all()

    # -- lookup and lock ------------------------------------------------------------------
    def submit_lookup_and_lock_task(self, keys: list[Any], group_layout_descs: Any) -> int:
        """Ask every chain; lock (claim) each key found in the tier that holds it."""
        return self._submit("lookup", self._lookup, keys, group_layout_descs)

    def _lookup(self, task_id: int, keys: list[Any], group_layout_descs: Any) -> None:
        for size in _layout_sizes(group_layout_descs):
            self._open_quietly(size)
        okeys = [offload_key(k) for k in keys]
        chains = self._chains.all()
        found = [False] * len(keys)
        owner = f"lmcache-lookup-{task_id}"
        lock = threading.Lock()
        self._begin()

        def finish() -> None:
            bitmap = Bitmap(len(keys))
            for i, hit in enumerate(found):
                if hit:
                    bitmap.set(i)
            self._locks.add(owner, [k for k, hit in zip(okeys, found) if hit])
            self._end()
            self._lookups.put(task_id, bitmap)

        by_tenant = self._by_tenant(keys)
        parts = Parts(len(chains) * len(by_tenant) if keys else 0, finish)

        def answerer(at: Sequence[int]) -> Callable[[list[bool]], None]:
            def answered(flags: list[bool]) -> None:
                with lock:
                    for i, flag in zip(at, flags):
                        found[i] = found[i] or flag
                parts.done()

            return answered

        for tenant, at in by_tenant.items():
            asked = okeys if len(at) == len(okeys) else [okeys[i] for i in at]
            answered = answerer(at)
            for one in chains:
                one.chain.start_lookup(asked, owner, answered, tenant)

    def query_lookup_and_lock_result(self, task_id: int) -> Any:
        return self._lookups.take(task_id)

    def submit_unlock(self, keys: list[Any]) -> None:
        """End one lock on each key (its claim in the tier); never raises (a claim not
        let go ends with its lease)."""
        try:
            ending = self._locks.take(offload_key(k) for k in keys)
            for owner, okeys in ending.items():
                for one in self._chains.all():
                    one.chain.let_go(owner, okeys)
        except Exception as exc:
            self._warn("unlock", exc)

    # -- load ---------------------------------------------------------------------------
    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> int:
        """Read each key into its object in place, from the first tier holding it."""
        return self._submit("load", self._load, keys, objects)

    def _load(self, task_id: int, keys: list[Any], objects: list[Any]) -> None:
        okeys = [offload_key(k) for k in keys]
        work = self._by_size(keys, okeys, objects)
        loaded: dict[OffloadKey, tuple[Any, int]] = {}
        self._begin()

        def finish() -> None:
            bitmap = Bitmap(len(keys))
            first: dict[OffloadKey, int] = {}
            for i, okey in enumerate(okeys):
                if okey not in loaded:
                    continue
                if okey in first:  # asked twice in one task: read once, copied here
                    object_bytes(objects[i])[:] = object_bytes(objects[first[okey]])
                else:
                    first[okey] = i
                bitmap.set(i)
            if first:  # before the result: LMCache's LRU knows of the access first
                try:
                    self._notify_keys_accessed([keys[i] for i in first.values()])
                except Exception as exc:
                    self._warn("usage", exc)
            self._end()
            self._loads.put(task_id, bitmap)

        parts = Parts(len(work), finish)
        for (size, tenant), items in work.items():
            self._start(size, items, "load", loaded, parts, tenant)

    def query_load_result(self, task_id: int) -> Any:
        return self._loads.take(task_id)

    # -- the work ---------------------------------------------------------------------
    def _submit(self, kind: str, start: Callable[..., None], keys: Any, *args: Any) -> int:
        """A task id for `start(task_id, keys, *args)`; a start that raises (a bad
        argument, a chain that would not open, the adapter closed) reports the task
        failed through its event fd at once: LMCache's threads never see it."""
        task_id = self._ids()
        try:
            if self._closed:
                raise RuntimeError("the tierkv L2 adapter is closed")
            start(task_id, keys, *args)
        except Exception as exc:
            self._warn(kind, exc)
            self._fail(kind, task_id, keys)
        return task_id

    def _by_size(
        self, keys: Sequence[Any], okeys: Sequence[OffloadKey], objects: Sequence[Any]
    ) -> dict[tuple[int, str | None], list[tuple[Any, OffloadKey, memoryview]]]:
        """The task's keys (`okeys`: theirs in tierkv) by object size and tenant, each
        key once (the first of its objects)."""
        if len(keys) != len(objects):
            raise ValueError(f"{len(keys)} keys for {len(objects)} objects")
        work: dict[tuple[int, str | None], list[tuple[Any, OffloadKey, memoryview]]] = {}
        seen: set[OffloadKey] = set()
        for key, okey, obj in zip(keys, okeys, objects):
            if okey in seen:
                continue
            seen.add(okey)
            view = object_bytes(obj)
            work.setdefault((view.nbytes, self._tenant(key)), []).append((key, okey, view))
        for size, _ in work:
            self._chains.get(size)  # opened here, before any part starts
        return work

    def _tenant(self, key: Any) -> str | None:
        """The tenant of an `ObjectKey`: its `cache_salt` by digest; None (the
        default) for no salt."""
        salt = getattr(key, "cache_salt", None)
        if not salt:
            return None
        names = self._salt_names
        name = names.get(salt)
        if name is None:
            if len(names) >= SALT_NAMES:
                names.clear()
            name = names[salt] = salt_tenant(str(salt))
        return name

    def _by_tenant(self, keys: Sequence[Any]) -> dict[str | None, Sequence[int]]:
        """The positions of the task's keys, by tenant (one tenant: all of them)."""
        tenants = [self._tenant(k) for k in keys]
        if len(set(tenants)) <= 1:
            return {tenants[0] if tenants else None: range(len(keys))}
        at: dict[str | None, list[int]] = {}
        for i, tenant in enumerate(tenants):
            at.setdefault(tenant, []).append(i)
        return dict(at)

    def _start(
        self,
        size: int,
        items: list[tuple[Any, OffloadKey, memoryview]],
        kind: str,
        done: dict[OffloadKey, tuple[Any, int]],
        parts: Parts,
        tenant: str | None = None,
    ) -> None:
        """One size's (and tenant's) part of a task on its chain; `done` gets the keys
        it moved."""
        one: SizeChain = self._chains.get(size)
        try:
            slots = one.slots.lend([view for _, _, view in items])
        except Exception:
            parts.done()
            raise
        okeys = [okey for _, okey, _ in items]
        by_okey = {okey: key for key, okey, _ in items}

        def moved(keys: set[OffloadKey]) -> None:
            one.slots.take_back(slots)
            for okey in keys:
                done[okey] = (by_okey[okey], size)
            parts.done()

        def held(tier: GuardedTier, keys: tuple[OffloadKey, ...]) -> None:
            self._held(tier, [(k, by_okey[k], size) for k in keys if k in by_okey])

        start = one.chain.start_store if kind == "store" else one.chain.start_load
        start(okeys, slots, moved, held, tenant)

    def _fail(self, kind: str, task_id: int, keys: Any) -> None:
        """A task that could not start: failed as a whole, through its event fd."""
        try:
            count = len(keys)
        except TypeError:
            count = 0
        if kind == "store":
            self._stores.put(task_id, L2StoreResult(False, 0))
        elif kind == "lookup":
            self._lookups.put(task_id, Bitmap(count))
        else:
            self._loads.put(task_id, Bitmap(count))

    def _open_quietly(self, size: int) -> None:
        try:
            self._chains.get(size)
        except Exception as exc:
            self._warn("open", exc)

    def _begin(self) -> None:
        with self._state:
            self._running += 1

    def _end(self) -> None:
        with self._state:
            self._running -= 1
            self._state.notify_all()

    def _warn(self, what: str, exc: BaseException) -> None:
        self._misses.failed(what, exc)

    # -- the key record and byte accounting ----------------------------------------------
    def _held(self, tier: GuardedTier, items: list[tuple[OffloadKey, Any, int]]) -> None:
        """A tier's store or load job moved these keys: the tier holds them. Keys new
        to the record count their bytes (LMCache's usage) and are listed; a load
        records a key an earlier process stored. On the loop thread."""
        added, forgotten = self._record.held(tier.bit, items)
        if self._record.dropped and not self._record_full_said:
            self._record_full_said = True
            logger.warning(
                "tierkv below LMCache's L1: the key record is full (%d keys, "
                "adapter_params.record_keys): the oldest keys are no longer listed or "
                "counted (they stay in the tiers); raise record_keys",
                self._record.limit,
            )
        self._account(forgotten, stored=False)
        self._account(added, stored=True)

    def _removed(self, tier: GuardedTier, okeys: tuple[OffloadKey, ...]) -> None:
        """A tier removed keys (its own eviction, a failed check): keys no other tier
        of the chain holds leave the record and stop counting."""
        self._account(self._record.let_go(tier.bit, okeys), stored=False)

    def _account(self, keys: list[tuple[Any, int]], *, stored: bool) -> None:
        if not keys:
            return
        try:
            notify = self._notify_keys_stored if stored else self._notify_keys_deleted
            notify([k for k, _ in keys], [s for _, s in keys])
        except Exception as exc:
            self._warn("usage", exc)

    # -- the optional calls -------------------------------------------------------------
    def delete(self, keys: list[Any]) -> None:
        """Remove `keys` from every tier (LMCache's L2 eviction); bounded by the chain's
        deadline, never raises."""
        try:
            okeys = [offload_key(k) for k in keys]
            for one in self._chains.all():
                one.chain.remove_all(okeys)
            self._chains.forget(okeys)
            self._account(self._record.forget(okeys), stored=False)
        except Exception as exc:
            self._warn("delete", exc)

    def list_l2_keys(
        self, model_name: str | None = None, page_size: int = 500, cursor: str | None = None
    ) -> Any:
        """One page of the keys some tier of the adapter holds (of `model_name`'s
        only, when given), oldest first, at most `PAGE_LIMIT`; `next_page_token` is
        None on the last page. The keys are those this process stored or loaded
        that no tier has reported removed since (`record.KeyRecord`): keys an
        earlier process left in an nvme tier are listed once this one loads them;
        keys a redis or s3 server dropped on its own stay listed until deleted.
        A cursor works only with the adapter that made it. `ValueError` for a
        `page_size` below 1 or a malformed or foreign cursor."""
        if isinstance(page_size, int) and not isinstance(page_size, bool) and page_size > 0:
            page_size = min(page_size, PAGE_LIMIT)
        page = self._record.page(model_name, page_size, cursor)
        entries = tuple(
            KeyEntry(key=key.to_encoded_object_key(), size_bytes=size) for key, size in page.entries
        )
        return KeyListPage(entries=entries, next_page_token=page.cursor)

    def get_usage(self) -> AdapterUsage:
        """Bytes of the recorded keys (per cache salt too) and what the chains hold
        when full: the largest tier's capacity, which every object size shares (so
        counted once), in object bytes; or 0 (no usage fraction, no global eviction)
        where a tier names no bound (redis, s3)."""
        capacity = self._chains.capacity_bytes()
        with self._usage_lock:
            self._max_capacity_bytes = capacity
        return super().get_usage()

    def report_status(self) -> dict[str, Any]:
        """Healthy when every tier of every chain serves; per tier its state and
        counters."""
        tiers: dict[str, Any] = {}
        healthy = True
        for one in self._chains.all():
            for tier in one.chain.tiers:
                ok = tier.serving == "read_write"
                healthy = healthy and ok
                stats = tier.refresh_stats()
                tiers[f"{tier.name}@{one.size}"] = {
                    "usable": ok,
                    "serving": stats.serving,
                    "breaker": stats.breaker,
                    "blocks_stored": stats.blocks_stored,
                    "blocks_loaded": stats.blocks_loaded,
                    "failed_keys": stats.failed_keys,
                    "errors": stats.errors,
                    "lease_expired": stats.lease_expired,
                }
        return {
            "is_healthy": healthy and not self._closed,
            "tiers": tiers,
            "recorded_keys": len(self._record),
            "record_dropped": self._record.dropped,
        }

    # -- life ----------------------------------------------------------------------------
    def close(self) -> None:
        """Wait (bounded by the chains' deadlines) for running tasks, close the tiers
        and the event fds."""
        if self._closed:
            return
        self._closed = True
        chains = self._chains.all()
        wait = max((c.chain.job_deadline + c.chain.margin for c in chains), default=0.0)
        ends = time.monotonic() + wait
        with self._state:
            while self._running and time.monotonic() < ends:
                self._state.wait(ends - time.monotonic())
        self._chains.close()
        for table in (self._stores, self._lookups, self._loads):
            table.close()


def _layout_sizes(descs: Any) -> list[int]:
    """Object sizes a lookup's layout hint (object group -> `MemoryLayoutDesc`)
    names; none when it names none or cannot be read."""
    sizes = []
    try:
        for desc in (descs or {}).values():
            total = 0
            for shape, dtype in zip(desc.shapes, desc.dtypes):
                count = 1
                for dim in shape:
                    count *= int(dim)
                total += count * int(dtype.itemsize)
            if total > 0:
                sizes.append(total)
    except Exception:
        return []
    return sizes
