"""SGLang's host pool as tierkv's primary: its pages, cut into the regions SGLang's
zero-copy interface names, become slots of a `PrimaryView` over the pool's own buffer.

`host_pool.get_page_buffer_meta(indices)` gives, for each page of a call, the address
and size of each of its regions: two per page for an MHA pool laid out page_first (the
page's K and its V across all layers), 2 x layers for layer_first (K and V of each
layer), one for an MLA pool. Every region of a pool has one size, and lies on a
multiple of it inside the pool's buffer (SGLang allocates host pages whole), so the
buffer is a slab of region-sized slots: a region's slot is its offset divided by its
size. A tier reads and writes those bytes in place; nothing is copied.

A page's region `j` is the tierkv block `make_offload_key(H(rank suffix, page hash), j)`:
SGLang's page hash (which carries its own seed and the request's `cache_salt`), the
suffix SGLang's file backend gives this rank's pages, and the region's index; the
namespace is mixed in by every tier from the view.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from typing import Any

from tierkv.contract.keys import OffloadKey, make_offload_key
from tierkv.contract.slab import PrimaryView
from tierkv.integrations.sglang.settings import PoolGeometry

logger = logging.getLogger(__name__)

_DOMAIN = b"tierkv/sglang-page/v1\0"


def pool_buffer(pool: Any) -> Any:
    """The one torch tensor holding every region of `pool` (MHA and MLA pools:
    `kv_buffer`; a K-only pool: `k_buffer`)."""
    for name in ("kv_buffer", "k_buffer"):
        buffer = getattr(pool, name, None)
        if buffer is not None and hasattr(buffer, "data_ptr"):
            return buffer
    raise ValueError(
        f"tierkv cannot serve SGLang host pool {type(pool).__name__}: it has no kv_buffer "
        "(tierkv serves pools whose pages lie in one host buffer: MHA and MLA)"
    )


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
    """`pool`'s page geometry, read from its first page; ValueError when its regions
    do not all have one size."""
    import torch  # the engine has it; the settings and the check do not need it

    page_size = int(pool.page_size)
    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(page_size, dtype=torch.int64))
    if not ptrs or len(set(sizes)) != 1:
        raise ValueError(
            f"tierkv cannot serve SGLang host pool {type(pool).__name__} "
            f"(layout {pool.layout}): its page regions have sizes {sorted(set(sizes))}; "
            "tierkv serves pools whose regions all have one size"
        )
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
    )


class PoolPages:
    """One host pool's buffer as tierkv's primary, and its pages' slots."""

    def __init__(self, pool: Any, geometry: PoolGeometry, namespace: str) -> None:
        buffer = pool_buffer(pool)
        data = host_bytes(buffer)
        part = geometry.part_bytes
        self.geometry = geometry
        self.page_size = geometry.page_size
        self.base = int(buffer.data_ptr())
        self.view = PrimaryView(data[: data.nbytes - data.nbytes % part], part, namespace)
        import torch

        # the first page's regions must be slots of the view: else refuse now
        self.slots(pool, torch.arange(self.page_size, dtype=torch.int64))

    def slots(self, pool: Any, host_indices: Any) -> list[int]:
        """The slots of every region of the pages at `host_indices` (token indices,
        `page_size` per page), page by page, region by region; ValueError for a region
        that is not a slot of the view."""
        ptrs, sizes = pool.get_page_buffer_meta(host_indices)
        part = self.geometry.part_bytes
        pages = len(host_indices) // self.page_size
        if len(ptrs) != pages * self.geometry.parts_per_page:
            raise ValueError(
                f"the host pool gave {len(ptrs)} regions for {pages} pages; "
                f"expected {self.geometry.parts_per_page} per page"
            )
        slots: list[int] = []
        limit = self.view.num_blocks
        for ptr, size in zip(ptrs, sizes):
            offset = int(ptr) - self.base
            slot, rest = divmod(offset, part)
            if size != part or rest or not 0 <= slot < limit:
                raise ValueError(
                    f"a page region at offset {offset} ({size} bytes) is not a "
                    f"{part}-byte slot of the host pool's buffer"
                )
            slots.append(slot)
        return slots


def page_keys(page_hashes: Sequence[str], suffix: str, parts: int) -> list[list[OffloadKey]]:
    """Per page, the keys of its `parts` regions (see the module docstring)."""
    tail = suffix.encode()
    keys = []
    for page_hash in page_hashes:
        digest = hashlib.blake2b(
            _DOMAIN + len(tail).to_bytes(4, "little") + tail + str(page_hash).encode(),
            digest_size=16,
        ).digest()
        keys.append([make_offload_key(digest, j) for j in range(parts)])
    return keys
