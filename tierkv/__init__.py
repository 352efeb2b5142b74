"""tierkv: keeps an LLM server's KV cache alive after it leaves the GPU.

The names below are the whole public API: what an inference server embeds and what a
tier plugin author implements. Plugin authors import from `tierkv.tier` (the plugin
contract's names, torch-free), the contract's own modules in `tierkv.contract` for
more (`tierkv.contract.framing`: the stored format) and `tierkv.testing` (the
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
    "OffloadingEvent": "tierkv.contract.events",
    # keys
    "OffloadKey": "tierkv.contract.keys",
    "make_offload_key": "tierkv.contract.keys",
    "hash_token_blocks": "tierkv.contract.keys",
    # writing a tier
    "SecondaryTierManager": "tierkv.contract.tier",
    "TierConfig": "tierkv.contract.tier",
    "PrimaryView": "tierkv.contract.slab",
    "JobMetadata": "tierkv.contract.jobs",
    "JobResult": "tierkv.contract.jobs",
    "ReqContext": "tierkv.contract.jobs",
    "register_tier": "tierkv.registry",
    # errors
    "TierKVError": "tierkv.contract.errors",
    "ConfigError": "tierkv.contract.errors",
    "TierUnavailable": "tierkv.contract.errors",
    "CorruptBlock": "tierkv.contract.errors",
    "ForeignBlock": "tierkv.contract.errors",
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
    from tierkv.contract.errors import (
        ConfigError as ConfigError,
    )
    from tierkv.contract.errors import (
        CorruptBlock as CorruptBlock,
    )
    from tierkv.contract.errors import (
        ForeignBlock as ForeignBlock,
    )
    from tierkv.contract.errors import (
        TierKVError as TierKVError,
    )
    from tierkv.contract.errors import (
        TierUnavailable as TierUnavailable,
    )
    from tierkv.contract.events import (
        OffloadingEvent as OffloadingEvent,
    )
    from tierkv.contract.jobs import (
        JobMetadata as JobMetadata,
    )
    from tierkv.contract.jobs import (
        JobResult as JobResult,
    )
    from tierkv.contract.jobs import (
        ReqContext as ReqContext,
    )
    from tierkv.contract.keys import (
        OffloadKey as OffloadKey,
    )
    from tierkv.contract.keys import (
        hash_token_blocks as hash_token_blocks,
    )
    from tierkv.contract.keys import (
        make_offload_key as make_offload_key,
    )
    from tierkv.contract.slab import (
        PrimaryView as PrimaryView,
    )
    from tierkv.contract.tier import (
        SecondaryTierManager as SecondaryTierManager,
    )
    from tierkv.contract.tier import (
        TierConfig as TierConfig,
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
    from tierkv.layout import (
        GroupSpec as GroupSpec,
    )
    from tierkv.layout import (
        KVLayout as KVLayout,
    )
    from tierkv.registry import (
        register_tier as register_tier,
    )
