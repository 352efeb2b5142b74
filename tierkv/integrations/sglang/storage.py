"""`TierkvHiCacheStorage`: a tierkv tier chain as SGLang HiCache's L3 storage backend.

SGLang 0.5.23 builds it through `StorageBackendFactory` from the `dynamic` backend
config (`--hicache-storage-backend dynamic` and the extra config `settings.py` reads),
then hands it the host pool (`register_mem_pool_host`). The host pool is tierkv's
primary (`regions.RegionPool`: each page region a slot, read and written in place); the
tiers run on the process's one event-loop thread through the shared guarded-tier
driver (`tierkv.driver.SyncChain` over `GuardedTier`: breaker, in-flight budget,
answer checks, deadline backstop, reopen). This class only translates SGLang's calls:
page hashes to keys, host indices to slots, key sets to per-page answers, a call's
`extra_info` to its tenant (`tenants.py`: stock SGLang passes none).

SGLang calls it synchronously from its own threads (a prefetch thread asks
`batch_exists`, an I/O thread `batch_get_v1` in slices of 128 pages, a backup thread
`batch_set_v1`), and never interrupts a call that blocks. So no method raises and none
waits past its deadline: a tier error, a timeout, a tier that is down is a miss
(`0`, `False`), logged and counted by the driver.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from tierkv.contract.slab import PrimaryView
from tierkv.driver.miss_log import MissLog
from tierkv.driver.sync_chain import SyncChain
from tierkv.integrations.sglang.metrics import CallMetrics
from tierkv.integrations.sglang.pages import key_bytes, read_geometry
from tierkv.integrations.sglang.regions import ChainFactory, RegionPool, restorable_ends
from tierkv.integrations.sglang.settings import ChainSettings, check_keys, rank_suffix, resolve
from tierkv.integrations.sglang.tenants import tenant_of
from tierkv.registry import get_tier_class

__all__ = ["TierkvHiCacheStorage"]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])
REMEMBERED_PAGES = 1 << 16
"""Pages `clear` can remove: those this process wrote last (the tiers' own eviction
ages out the rest; tierkv tiers have no "remove everything" call)."""


def _never_raises(default: Callable[[Any], Any]) -> Callable[[F], F]:
    """SGLang counts a call that raises as a miss but logs a traceback per call: answer
    `default(first argument)` instead (the keys or transfers asked about), logged once
    per kind of failure."""

    def wrap(method: F) -> F:
        @functools.wraps(method)
        def guarded(self: TierkvHiCacheStorage, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except Exception as exc:
                self._failed(method.__name__, exc)
                first = args[0] if args else next(iter(kwargs.values()), None)
                return default(first)

        return guarded  # type: ignore[return-value]

    return wrap


def _all_false(keys: Any) -> list[bool]:
    try:
        return [False] * len(keys)
    except TypeError:
        return []


def _v2_misses(transfers: Any) -> dict[str, list[bool]]:
    try:
        return {str(t.name): [False] * len(t.keys or []) for t in transfers or []}
    except Exception:  # not transfers at all
        return {}


def _suffixes(config: HiCacheStorageConfig) -> tuple[str, str]:
    """The rank suffix of this rank's KV pages (shared by every TP rank for MLA, as
    SGLang's file backend has it) and of its extra pools' pages (Mamba state is
    TP-sharded even where the KV is replicated)."""
    where: dict[str, Any] = {
        "model": config.model_name,
        "tp_rank": config.tp_rank,
        "tp_size": config.tp_size,
        "pp_rank": config.pp_rank,
        "pp_size": config.pp_size,
        "cp_rank": config.attn_cp_rank,
        "cp_size": config.attn_cp_size,
    }
    kv = rank_suffix(**where, is_mla=config.is_mla_model)
    if config.dcp_size > 1:
        kv += f"_tp{config.tp_size}_dcp{config.dcp_rank}_{config.dcp_size}"
    return kv, rank_suffix(**where)


class TierkvHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """tierkv's tiers below SGLang's host pool (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        self.extra = dict(storage_config.extra_config or {})
        check_keys(self.extra)  # no pool yet: the rest is checked when it comes
        config = storage_config
        self.is_writer = bool(config.is_storage_writer)
        self.suffix, self.rank_suffix = _suffixes(config)
        self._settings: ChainSettings | None = None
        self.sidecars: dict[str, RegionPool] = {}
        self.kv: RegionPool | None = None
        self.page_bytes = 0
        self._lock = threading.Lock()
        self._metrics = CallMetrics()
        self._written: OrderedDict[str, None] = OrderedDict()
        self._misses = MissLog(logger)
        self._exists_calls = itertools.count(1)

    # -- set-up ----------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """The host pool: read its geometry, validate the chain against it, open the
        tiers. Raises (SGLang then refuses to attach the backend) on a bad config or
        a required tier that does not open."""
        super().register_mem_pool_host(mem_pool_host)
        config = self.storage_config
        geometry = read_geometry(
            mem_pool_host,
            model=config.model_name or "",
            tp_rank=config.tp_rank,
            tp_size=config.tp_size,
            pp_rank=config.pp_rank,
            pp_size=config.pp_size,
            is_mla=config.is_mla_model,
        )
        settings = resolve(self.extra, geometry)
        self._settings = settings
        if self.kv is not None:
            self.kv.close()
        self.kv = RegionPool(
            mem_pool_host,
            self.suffix,
            settings.namespace,
            self._chain_maker("kv"),
            whole_pages=self._whole_pages(),
            key_bytes=self._key_bytes(),
        )
        self.page_bytes = sum(self.kv.region_bytes)
        for name, pool in getattr(self, "registered_pools", {}).items():
            if str(name) != str(PoolName.KV):
                self._add_sidecar(pool, str(name))
        logger.info(
            "tierkv below SGLang's host pool: tiers %s, %d regions of %d bytes per page, "
            "namespace %r, rank suffix %r",
            ", ".join(settings.names),
            geometry.parts_per_page,
            geometry.part_bytes,
            settings.namespace,
            self.suffix,
        )

    def _failed(self, what: str, exc: BaseException) -> None:
        self._misses.failed(what, exc)

    # -- the zero-copy interface --------------------------------------------------------
    @_never_raises(lambda keys: 0)
    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many leading pages some tier holds whole (every region)."""
        kv = self._ready()
        if kv is None or not keys:
            return 0
        owner = self._exists_owner()
        present = kv.present(keys, owner=owner, tenant=tenant_of(extra_info))
        hit = present.index(False) if False in present else len(keys)
        kv.unclaim(owner, keys[hit:])  # SGLang fetches the leading pages only
        return hit

    @_never_raises(_all_false)
    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: Any,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Read each page's regions into the host pool in place; True per page read
        whole."""
        return self._transfer("load", keys, host_indices, tenant_of(extra_info))

    @_never_raises(_all_false)
    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: Any,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Write each page's regions from the host pool to every tier; True per page
        some tier holds whole. MLA pages are the same on every TP rank: one rank
        (SGLang's `is_storage_writer`) writes them, the others answer True."""
        if not self.is_writer:
            return [True] * len(keys)
        return self._transfer("store", keys, host_indices, tenant_of(extra_info))

    def _transfer(
        self, kind: str, keys: Sequence[str], host_indices: Any, tenant: str | None = None
    ) -> list[bool]:
        kv = self._ready()
        if kv is None or not keys:
            return [False] * len(keys)
        started = time.perf_counter()
        answers = kv.move(kind, keys, host_indices, tenant)
        self._count(kind, keys, answers, time.perf_counter() - started)
        return answers

    def _count(self, kind: str, keys: Sequence[str], answers: list[bool], elapsed: float) -> None:
        moved = sum(answers)
        self._metrics.record(kind, moved, moved * self.page_bytes, elapsed)
        if kind == "store":
            with self._lock:
                for key, ok in zip(keys, answers):
                    if ok:
                        self._written[key] = None
                        self._written.move_to_end(key)
                while len(self._written) > REMEMBERED_PAGES:
                    self._written.popitem(last=False)

    def _exists_owner(self) -> str:
        """The owner of one exists call's claims (`claims.ExistsClaims`)."""
        return f"sglang-exists-{next(self._exists_calls)}"

    def _ready(self) -> RegionPool | None:
        kv = self.kv
        return None if kv is None or kv.closed else kv

    def _whole_pages(self) -> bool:
        """Whether a page may be one block of its regions: every tier accepts regions
        (`regions.RegionPool` still checks the pool lays them out evenly)."""
        settings = self._settings
        assert settings is not None
        return all(get_tier_class(t.type).accepts_regions for t in settings.tiers)

    def _key_bytes(self) -> int:
        """The length of the pages' keys: frame headers a multiple of 64 bytes
        (`pages.key_bytes`)."""
        settings = self._settings
        assert settings is not None
        signed = sum(1 for t in settings.tiers if t.mac_key_env is not None)
        return key_bytes(signed, len(settings.tiers))

    def _chain_maker(self, pool: str) -> ChainFactory:
        """Builds the tier chain of one component of a pool (`regions.RegionPool`)."""
        settings = self._settings
        assert settings is not None

        def make(view: PrimaryView) -> SyncChain:
            return SyncChain(
                settings.tiers,
                settings.names,
                view,
                lookup_timeout=settings.lookup_timeout,
                tags={"engine": "sglang", "pool": pool},
                quotas=settings.quotas,
            )

        return make

    # -- hybrid models (v2): the extra pools ------------------------------------------
    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """An extra pool of a hybrid model (Mamba state, sliding-window KV): its
        regions get tiers of their own (`regions.RegionPool`). The KV pool itself is
        served by the v1 calls."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if name == str(PoolName.KV) or self._settings is None:
            return  # before the anchor pool: built in register_mem_pool_host
        self._add_sidecar(host_pool, name)

    def _add_sidecar(self, host_pool: Any, name: str) -> None:
        settings = self._settings
        assert settings is not None
        old = self.sidecars.pop(name, None)
        if old is not None:
            old.close()
        config = self.storage_config
        # an extra pool's pages are each rank's own, MLA or not
        self.sidecars[name] = RegionPool(
            host_pool,
            f"{self.rank_suffix}|{name}",
            f"{settings.namespace}|tp{config.tp_rank}of{config.tp_size}|{name}",
            self._chain_maker(name),
            name=name,
            whole_pages=self._whole_pages(),
            key_bytes=self._key_bytes(),
        )

    @_never_raises(lambda keys: PoolTransferResult(0, {}, []))
    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The KV pages present from the start, narrowed by each extra pool's rule;
        `restorable_prefix_pages` lists every end all pools can serve."""
        kv_pages = self.batch_exists(keys, extra_info)
        tenant = tenant_of(extra_info)
        hits: dict[str, int] = {str(PoolName.KV): kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            sidecar = self.sidecars.get(str(transfer.name))
            if sidecar is None:
                return PoolTransferResult(0, hits, [])  # a pool tierkv does not hold
            present = sidecar.present(keys[:kv_pages], owner=self._exists_owner(), tenant=tenant)
            policy = getattr(transfer.hit_policy, "value", str(transfer.hit_policy))
            verdict = restorable_ends(kv_pages, present, policy, len(transfer.keys or []))
            if verdict is None:
                continue
            ends, boundary = verdict
            if boundary:
                hits[str(transfer.name)] = boundary
            allowed = set(ends)
            restorable = [p for p in restorable if p in allowed]
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    @_never_raises(_v2_misses)
    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._transfer_v2("load", transfers, tenant_of(extra_info))

    @_never_raises(_v2_misses)
    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._transfer_v2("store", transfers, tenant_of(extra_info))

    def _transfer_v2(
        self, kind: str, transfers: list[PoolTransfer], tenant: str | None = None
    ) -> dict[str, list[bool]]:
        """Each transfer's pages to or from its pool; a pool tierkv does not hold (or a
        transfer that fails) answers misses for its pages alone."""
        results: dict[str, list[bool]] = {}
        for transfer in transfers:
            keys = list(transfer.keys or [])
            sidecar = self.sidecars.get(str(transfer.name))
            if sidecar is None or self._ready() is None or transfer.host_indices is None:
                results[str(transfer.name)] = [False] * len(keys)
                continue
            try:
                results[str(transfer.name)] = sidecar.move(
                    kind, keys, transfer.host_indices, tenant
                )
            except Exception as exc:
                self._failed(f"batch_{'get' if kind == 'load' else 'set'}_v2", exc)
                results[str(transfer.name)] = [False] * len(keys)
        return results

    # -- the legacy (copying) interface --------------------------------------------------
    def exists(self, key: str) -> bool:
        return bool(self.batch_exists([key]))

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        self._legacy("get")
        return None

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[Any]:
        self._legacy("batch_get")
        return [None] * len(keys)

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        self._legacy("set")
        return False

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        self._legacy("batch_set")
        return False

    def _legacy(self, what: str) -> None:
        """SGLang's copying calls: only used without `interface_v1`, which the config
        check refuses; answered as misses."""
        self._failed(what, NotImplementedError('tierkv serves SGLang with "interface_v1": 1'))

    # -- the rest -----------------------------------------------------------------------
    @_never_raises(lambda keys: None)
    def clear(self) -> None:
        """Remove the pages this process wrote (the last `REMEMBERED_PAGES`)."""
        kv = self._ready()
        if kv is None:
            return
        with self._lock:
            written, self._written = list(self._written), OrderedDict()
        kv.remove(written)

    def get_stats(self) -> Any:
        """SGLang's `StorageMetrics` since the last call (pages and GB/s per call)."""
        return self._metrics.take()

    def close(self) -> None:
        """Close the tiers (bounded), let go of the pools' buffers and, with the last
        backend of the process, of the loop thread."""
        pools = [*self.sidecars.values(), *([self.kv] if self.kv is not None else [])]
        self.sidecars, self.kv = {}, None
        for pool in pools:
            pool.close()
