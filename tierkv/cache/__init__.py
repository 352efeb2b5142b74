"""The cache core: `TieredCache` and its parts.

- `results`: what lookup, store, load and stats return
- `index`: the one authoritative per-key state (and promotion `Flight`s)
- `core`: shared state, event log, background task group; `counters`: cache-wide counters;
  `tenants`: per-tenant counts and who owns the primary's blocks
- `lookup`; `store_run` (one store streaming through the primary); `cascade`
  (write-through and selective cascades, admission); `promotion` (load) and `flights`
  (stage-1 reads shared with prefetch); `prefetch`; `writeback`; `validate`
- `cache`: the `TieredCache` facade

Every call to a tier goes through its `tierkv.driver.GuardedTier` (breaker, in-flight
budget, answer checks, deadline backstop), the driver the engine adapters use too.
"""

from tierkv.cache.cache import TieredCache
from tierkv.cache.results import CacheStats, LoadResult, LookupResult, StoreResult

__all__ = ["CacheStats", "LoadResult", "LookupResult", "StoreResult", "TieredCache"]
