"""Old import path of the cache core, kept so existing imports keep working.

The cache now lives in the `tierkv.cache` package; import `TieredCache` and its
results from `tierkv` (or `tierkv.cache`).
"""

from tierkv.cache import CacheStats, LoadResult, LookupResult, StoreResult, TieredCache

__all__ = ["CacheStats", "LoadResult", "LookupResult", "StoreResult", "TieredCache"]
