"""What tierkv reads from an SGLang host pool (its page geometry), the bytes of its
buffers as tierkv's primary, and the keys of its pages.

A page's region `j` (as `host_pool.get_page_buffer_meta` lists them) is the tierkv
block `make_offload_key(H(rank suffix, page hash), j)`: SGLang's page hash (which
carries its own seed and the request's `cache_salt`), the suffix SGLang's file
backend gives this rank's pages, and the region's index; the namespace is mixed in by
every tier from the view (`regions.RegionPool` builds the views). A page stored whole,
as one block of all its regions (`regions.RegionPool` with `whole_pages`), is the
block `make_offload_key(H(...), WHOLE_PAGE)`: a group no region has, so a page stored
whole and one stored region by region never answer for each other.

H is a BLAKE2b digest sized so that a frame's header is a multiple of 64 bytes
(`key_bytes`, `framing.aligned_key_bytes`): SGLang's host pools are 64-byte aligned
torch tensors, and a payload at a file offset 1-63 bytes short of its slot (the
20-byte keys of before made 54-byte headers) is copied several times slower by the
kernel, or read through a scratch buffer and copied twice.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from tierkv.contract.framing import aligned_key_bytes
from tierkv.contract.keys import OffloadKey, make_offload_key
from tierkv.integrations.sglang.settings import PoolGeometry

_DOMAIN = b"tierkv/sglang-page/v1\0"
WHOLE_PAGE = 0xFFFF_FFFF
"""The group index of a page stored as one block of all its regions."""
_GROUP_BYTES = len(make_offload_key(b"\0", 0)) - 1
MIN_KEY_BYTES = 16 + _GROUP_BYTES
"""A 128-bit digest and the group: the shortest page key (`key_bytes` pads it)."""


def key_bytes(signed_tiers: int, tiers: int) -> int:
    """The length of this adapter's keys for a chain of `tiers` tiers, `signed_tiers`
    of which sign their frames (`mac_key_env`): the frame header is a multiple of 64
    bytes for the unsigned frames, or for the signed ones where most tiers sign (a
    signature adds 40 bytes, so one length cannot align both)."""
    return aligned_key_bytes(MIN_KEY_BYTES, mac=2 * signed_tiers > tiers)


def host_bytes(buffer: Any) -> memoryview:
    """A writable memoryview of a CPU tensor's bytes, without a copy."""
    if getattr(buffer, "device", None) is not None and buffer.device.type != "cpu":
        raise ValueError(f"the host pool's buffer is on {buffer.device}, not in host memory")
    if not buffer.is_contiguous():
        raise ValueError("the host pool's buffer is not contiguous")
    flat = buffer.detach().reshape(-1)
    import torch  # the engine has it; the settings and check do not need it

    return memoryview(flat.view(torch.uint8).numpy())


def read_geometry(
    pool: Any,
    *,
    model: str,
    tp_rank: int,
    tp_size: int,
    pp_rank: int = 0,
    pp_size: int = 1,
    is_mla: bool,
) -> PoolGeometry:
    """`pool`'s page geometry, read from its first page (regions of several sizes, as
    a split MLA pool's K and V, are listed in `region_bytes`)."""
    import torch  # the engine has it; the settings and the check do not need it

    page_size = int(pool.page_size)
    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(page_size, dtype=torch.int64))
    if not ptrs:
        raise ValueError(
            f"tierkv cannot serve SGLang host pool {type(pool).__name__} "
            f"(layout {pool.layout}): it names no region of a page"
        )
    uneven = len(set(sizes)) > 1
    return PoolGeometry(
        model=model,
        dtype=str(getattr(pool, "dtype", "?")).replace("torch.", ""),
        layout=str(pool.layout),
        page_size=page_size,
        part_bytes=int(sizes[0]),
        parts_per_page=len(ptrs),
        is_mla=is_mla,
        tp_size=tp_size,
        pp_size=pp_size,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        region_bytes=tuple(int(size) for size in sizes) if uneven else (),
    )


def _prefix(suffix: str) -> bytes:
    """What every page hash of this rank is hashed after: the domain and the suffix."""
    tail = suffix.encode()
    return _DOMAIN + len(tail).to_bytes(4, "little") + tail


def page_keys(
    page_hashes: Sequence[str],
    suffix: str,
    parts: int,
    *,
    whole: bool = False,
    length: int = MIN_KEY_BYTES,
) -> list[list[OffloadKey]]:
    """Per page, the keys (`length` bytes each: `key_bytes`) of its `parts` regions, or
    with `whole` its one key (see the module docstring)."""
    if not MIN_KEY_BYTES <= length <= 64 + _GROUP_BYTES:
        raise ValueError(f"page keys are {MIN_KEY_BYTES}-{64 + _GROUP_BYTES} bytes, not {length}")
    if whole:
        return [[key] for key in whole_page_keys(page_hashes, suffix, length)]
    size, prefix = length - _GROUP_BYTES, _prefix(suffix)
    groups = [make_offload_key(b"\0", j)[1:] for j in range(parts)]  # each key's tail
    blake2b = hashlib.blake2b
    keys = []
    for page_hash in page_hashes:
        digest = blake2b(prefix + str(page_hash).encode(), digest_size=size).digest()
        keys.append([digest + group for group in groups])
    return keys


def whole_page_keys(
    page_hashes: Sequence[str], suffix: str, length: int = MIN_KEY_BYTES
) -> list[OffloadKey]:
    """The one key of each page stored whole (`page_keys` with `whole`, flat)."""
    prefix, size = _prefix(suffix), length - _GROUP_BYTES
    group = make_offload_key(b"\0", WHOLE_PAGE)[1:]
    blake2b = hashlib.blake2b
    return [
        blake2b(prefix + str(h).encode(), digest_size=size).digest() + group for h in page_hashes
    ]
