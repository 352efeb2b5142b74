"""tierkv: keeps an LLM server's KV cache alive after it leaves the GPU.

The names below are the whole public API: what an inference server embeds and what a
tier plugin author implements. Plugin authors import from `tierkv.tier` (the contract,
torch-free), `tierkv.framing` (the stored format) and `tierkv.testing` (the
conformance suite). Everything else is importable from its own module and may move.

Names are imported on first use, so `import tierkv.tier` (a plugin) does not pull in
torch or the cache.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    # embedding the cache
    "TieredCache": "tierkv.cache",
    "CacheStats": "tierkv.cache",
    "LoadResult": "tierkv.cache",
    "LookupResult": "tierkv.cache",
    "StoreResult": "tierkv.cache",
    "CacheConfig": "tierkv.config",
    "load_config": "tierkv.config",
    "parse_config": "tierkv.config",
    "KVLayout": "tierkv.layout",
    "GroupSpec": "tierkv.layout",
    "HostBlocks": "tierkv.blocks",
    "KVCacheBlocks": "tierkv.gpu.kv_blocks",
    "TransferWorker": "tierkv.gpu.worker",
    "required_block_bytes": "tierkv.gpu.geometry",
    "OffloadingEvent": "tierkv.events",
    # keys
    "OffloadKey": "tierkv.keys",
    "make_offload_key": "tierkv.keys",
    "hash_token_blocks": "tierkv.keys",
    # writing a tier
    "SecondaryTierManager": "tierkv.tier",
    "TierConfig": "tierkv.tier",
    "PrimaryView": "tierkv.slab",
    "JobMetadata": "tierkv.jobs",
    "JobResult": "tierkv.jobs",
    "ReqContext": "tierkv.jobs",
    "register_tier": "tierkv.registry",
    # errors
    "TierKVError": "tierkv.errors",
    "ConfigError": "tierkv.errors",
    "TierUnavailable": "tierkv.errors",
    "CorruptBlock": "tierkv.errors",
    "ForeignBlock": "tierkv.errors",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tierkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # the same names, eagerly, for type checkers
    from tierkv.blocks import (
        HostBlocks as HostBlocks,
    )
    from tierkv.cache import (
        CacheStats as CacheStats,
    )
    from tierkv.cache import (
        LoadResult as LoadResult,
    )
    from tierkv.cache import (
        LookupResult as LookupResult,
    )
    from tierkv.cache import (
        StoreResult as StoreResult,
    )
    from tierkv.cache import (
        TieredCache as TieredCache,
    )
    from tierkv.config import (
        CacheConfig as CacheConfig,
    )
    from tierkv.config import (
        load_config as load_config,
    )
    from tierkv.config import (
        parse_config as parse_config,
    )
    from tierkv.errors import (
        ConfigError as ConfigError,
    )
    from tierkv.errors import (
        CorruptBlock as CorruptBlock,
    )
    from tierkv.errors import (
        ForeignBlock as ForeignBlock,
    )
    from tierkv.errors import (
        TierKVError as TierKVError,
    )
    from tierkv.errors import (
        TierUnavailable as TierUnavailable,
    )
    from tierkv.events import (
        OffloadingEvent as OffloadingEvent,
    )
    from tierkv.gpu.geometry import (
        required_block_bytes as required_block_bytes,
    )
    from tierkv.gpu.kv_blocks import (
        KVCacheBlocks as KVCacheBlocks,
    )
    from tierkv.gpu.worker import (
        TransferWorker as TransferWorker,
    )
    from tierkv.jobs import (
        JobMetadata as JobMetadata,
    )
    from tierkv.jobs import (
        JobResult as JobResult,
    )
    from tierkv.jobs import (
        ReqContext as ReqContext,
    )
    from tierkv.keys import (
        OffloadKey as OffloadKey,
    )
    from tierkv.keys import (
        hash_token_blocks as hash_token_blocks,
    )
    from tierkv.keys import (
        make_offload_key as make_offload_key,
    )
    from tierkv.layout import (
        GroupSpec as GroupSpec,
    )
    from tierkv.layout import (
        KVLayout as KVLayout,
    )
    from tierkv.registry import (
        register_tier as register_tier,
    )
    from tierkv.slab import (
        PrimaryView as PrimaryView,
    )
    from tierkv.tier import (
        SecondaryTierManager as SecondaryTierManager,
    )
    from tierkv.tier import (
        TierConfig as TierConfig,
    )
