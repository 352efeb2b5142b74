"""Offload keys and the prefix-chained block hashes they are made of.

An `OffloadKey` is `block_hash + group_idx.to_bytes(4, "big")`: equal keys mean the
same token prefix, in the same KV-cache group, in the same namespace. Hashes are
cryptographic (sha256) or 128-bit (xxh3_128), never Python's `hash()`, so they are
stable across processes and machines and a shared tier can trust a name it did not
write.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Literal, TypeAlias

import xxhash

OffloadKey: TypeAlias = bytes
"""Block hash followed by the 4-byte big-endian KV-cache group index."""

HashAlgorithm: TypeAlias = Literal["sha256", "xxh3_128"]

_GROUP_BYTES = 4
_MAX_GROUP = 2**32 - 1
_DOMAIN = b"tierkv/block-hash/v1"


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """Return the key of the block `block_hash` in KV-cache group `group_idx`."""
    if not isinstance(block_hash, bytes):
        raise ValueError(f"block_hash must be bytes, got {type(block_hash).__name__}")
    if not block_hash:
        raise ValueError("block_hash must not be empty")
    if isinstance(group_idx, bool) or not isinstance(group_idx, int):
        raise ValueError(f"group_idx must be an int, got {type(group_idx).__name__}")
    if not 0 <= group_idx <= _MAX_GROUP:
        raise ValueError(f"group_idx must be in 0..{_MAX_GROUP}, got {group_idx}")
    return block_hash + group_idx.to_bytes(_GROUP_BYTES, "big")


def _check_key(key: OffloadKey) -> None:
    if not isinstance(key, bytes):
        raise ValueError(f"an offload key must be bytes, got {type(key).__name__}")
    if len(key) <= _GROUP_BYTES:
        raise ValueError(
            f"an offload key is a block hash plus {_GROUP_BYTES} group bytes; got {len(key)} bytes"
        )


def get_offload_block_hash(key: OffloadKey) -> bytes:
    """The block-hash part of `key`."""
    _check_key(key)
    return key[:-_GROUP_BYTES]


def get_offload_group_idx(key: OffloadKey) -> int:
    """The KV-cache group index encoded at the end of `key`."""
    _check_key(key)
    return int.from_bytes(key[-_GROUP_BYTES:], "big")


def _digest(algorithm: HashAlgorithm, data: bytes) -> bytes:
    if algorithm == "sha256":
        return hashlib.sha256(data).digest()
    return bytes(xxhash.xxh3_128_digest(data))


def _field(data: bytes) -> bytes:
    """Length-prefix a field so that no two field sequences encode alike."""
    return len(data).to_bytes(8, "little") + data


def hash_token_blocks(
    token_ids: Sequence[int],
    block_size: int,
    *,
    namespace: str,
    parent: bytes | None = None,
    extra: bytes | Sequence[bytes | None] | None = None,
    algorithm: HashAlgorithm = "sha256",
) -> list[bytes]:
    """Prefix-chained hashes of the full blocks of `token_ids`.

    `h_i = H(namespace, h_{i-1}, tokens_i, extra_i)`, with `h_{-1} = parent` (the
    last hash of an earlier call, to continue a chain) or empty. A trailing partial
    block gets no hash. `extra` mixes in whatever else decides the KV values besides
    the tokens (a LoRA id, a cache salt, multimodal input hashes): one `bytes` for
    every block, or a sequence with one entry (or None) per full block.

    The namespace salts every block, so two namespaces never share a hash even when
    a caller passes a parent from the other one.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if not isinstance(namespace, str) or not namespace:
        raise ValueError("namespace must be a non-empty string")
    if algorithm not in ("sha256", "xxh3_128"):
        raise ValueError(f"algorithm must be 'sha256' or 'xxh3_128', got {algorithm!r}")
    if parent is not None and not isinstance(parent, bytes):
        raise ValueError(f"parent must be bytes or None, got {type(parent).__name__}")

    num_blocks = len(token_ids) // block_size
    per_block: Sequence[bytes | None]
    if extra is None or isinstance(extra, bytes):
        per_block = [extra] * num_blocks
    else:
        if len(extra) < num_blocks:
            raise ValueError(
                f"extra has {len(extra)} entries but there are {num_blocks} full blocks"
            )
        per_block = extra

    ns_field = _field(_DOMAIN + b"\0" + algorithm.encode() + b"\0" + namespace.encode())
    previous = parent if parent is not None else b""
    hashes: list[bytes] = []
    for i in range(num_blocks):
        chunk = token_ids[i * block_size : (i + 1) * block_size]
        try:
            token_bytes = struct.pack(f"<{block_size}q", *chunk)
        except struct.error as exc:
            raise ValueError(f"token ids must be 64-bit ints: {exc}") from None
        extra_i = per_block[i]
        extra_field = b"\0" if extra_i is None else b"\1" + _field(bytes(extra_i))
        previous = _digest(
            algorithm, ns_field + _field(previous) + _field(token_bytes) + extra_field
        )
        hashes.append(previous)
    return hashes
