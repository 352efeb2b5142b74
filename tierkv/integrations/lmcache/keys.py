"""LMCache's `ObjectKey` as a tierkv `OffloadKey`.

An `ObjectKey(chunk_hash, model_name, kv_rank, object_group_id, cache_salt)` names one
object of LMCache's L1. tierkv keys have a fixed shape (a block hash, then the group
index as 4 bytes), so every field but the group is hashed into a 16-byte block hash,
each field length-prefixed (no two keys can run together into one): two keys that
differ in any field, the cache salt included, name different blocks, and two salts
never share one. The object group is the key's group index. blake2b, not Python's
`hash()`: the same key maps to the same block in every process and on every machine.
Imports nothing of LMCache (keys are read by attribute).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from tierkv.contract.keys import OffloadKey, make_offload_key

__all__ = ["offload_key", "offload_keys"]

_DOMAIN = b"tierkv/lmcache-object/v1"


def _field(data: bytes) -> bytes:
    return len(data).to_bytes(4, "little") + data


def offload_key(key: Any) -> OffloadKey:
    """The tierkv key of one LMCache `ObjectKey` (see the module docstring)."""
    chunk = bytes(key.chunk_hash)
    digest = hashlib.blake2b(
        _DOMAIN
        + _field(str(key.model_name).encode())
        + _field(str(int(key.kv_rank)).encode())
        + _field(str(getattr(key, "cache_salt", "") or "").encode())
        + _field(chunk),
        digest_size=16,
    ).digest()
    return make_offload_key(digest, int(getattr(key, "object_group_id", 0)))


def offload_keys(keys: Sequence[Any]) -> list[OffloadKey]:
    return [offload_key(k) for k in keys]
