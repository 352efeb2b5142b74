"""tierkv: keeps an LLM server's KV cache alive after it leaves the GPU.

Users import from here; plugin authors import from `tierkv.tier` (the contract),
`tierkv.framing` (the stored format) and `tierkv.testing` (the conformance suite).
"""

from __future__ import annotations

from tierkv.blocks import BlockDestination, BlockSource, HostBlocks
from tierkv.config import CacheConfig, load_config, parse_config
from tierkv.errors import (
    BlockStateError,
    ConfigError,
    CorruptBlock,
    PluginImportError,
    TierKVError,
    TierUnavailable,
    UnknownTierType,
)
from tierkv.events import OffloadingEvent
from tierkv.hits import GroupHit, combine_group_hits
from tierkv.jobs import JobMetadata, JobResult, ReqContext
from tierkv.keys import (
    HashAlgorithm,
    OffloadKey,
    get_offload_block_hash,
    get_offload_group_idx,
    hash_token_blocks,
    make_offload_key,
)
from tierkv.kv_blocks import KVCacheBlocks
from tierkv.layout import GroupSpec, KVLayout
from tierkv.memory_tier import MemoryTier, MemoryTierConfig
from tierkv.orchestrator import CacheStats, LoadResult, LookupResult, StoreResult, TieredCache
from tierkv.primary import PrepareStoreOutput, PrimaryConfig, PrimaryTier, PrimaryView
from tierkv.registry import (
    create_tier,
    get_tier_class,
    installed_tiers,
    register_tier,
    unregister_tier,
)
from tierkv.tier import SecondaryTierManager, TierConfig
from tierkv.worker import (
    TransferResult,
    TransferSpec,
    TransferSpecError,
    TransferWorker,
    required_block_bytes,
)

__version__ = "0.1.0"

__all__ = [
    "BlockDestination",
    "BlockSource",
    "CacheStats",
    "GroupHit",
    "HostBlocks",
    "KVCacheBlocks",
    "TransferResult",
    "TransferSpec",
    "TransferSpecError",
    "TransferWorker",
    "required_block_bytes",
    "LoadResult",
    "LookupResult",
    "StoreResult",
    "TieredCache",
    "combine_group_hits",
    "BlockStateError",
    "CacheConfig",
    "ConfigError",
    "CorruptBlock",
    "GroupSpec",
    "HashAlgorithm",
    "JobMetadata",
    "JobResult",
    "KVLayout",
    "MemoryTier",
    "MemoryTierConfig",
    "OffloadKey",
    "OffloadingEvent",
    "PluginImportError",
    "PrepareStoreOutput",
    "PrimaryConfig",
    "PrimaryTier",
    "PrimaryView",
    "ReqContext",
    "SecondaryTierManager",
    "TierConfig",
    "TierKVError",
    "TierUnavailable",
    "UnknownTierType",
    "__version__",
    "create_tier",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "get_tier_class",
    "hash_token_blocks",
    "installed_tiers",
    "load_config",
    "make_offload_key",
    "parse_config",
    "register_tier",
    "unregister_tier",
]
