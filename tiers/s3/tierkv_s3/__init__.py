"""tierkv-cache-s3: the `s3` tier. KV-cache blocks as objects in S3 or any S3-compatible
store, framed and checked, shared by every inference server that can reach the bucket."""

from __future__ import annotations

from tierkv_s3.config import S3TierConfig
from tierkv_s3.tier import S3Tier

__all__ = ["S3Tier", "S3TierConfig"]
