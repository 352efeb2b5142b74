"""tierkv-cache-redis: the `redis` tier. KV-cache blocks in Redis or Redis Cluster, framed
and checked, shared by every inference server that points at the same server and
namespace."""

from __future__ import annotations

from tierkv.tier import redact_url
from tierkv_redis.config import RedisTierConfig
from tierkv_redis.tier import RedisTier

__all__ = ["RedisTier", "RedisTierConfig", "redact_url"]
