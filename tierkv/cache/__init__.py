"""The cache core: `TieredCache` and its parts.

- `results`: what lookup, store, load and stats return
- `index`: the one authoritative per-key state
- `guard`: guarded tier calls (deadline, circuit breaker, statistics)
- `core`: shared state, event log, background task group
- `lookup`, `cascade` (store and write-through), `promotion` (load), `writeback`
- `cache`: the `TieredCache` facade
"""

from tierkv.cache.cache import TieredCache
from tierkv.cache.results import CacheStats, LoadResult, LookupResult, StoreResult

__all__ = ["CacheStats", "LoadResult", "LookupResult", "StoreResult", "TieredCache"]
