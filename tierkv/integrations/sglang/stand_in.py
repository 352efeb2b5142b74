"""A stand-in for SGLang's host KV pools, for tests and the benchmark on a CPU machine.

SGLang's own host pools (`sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost`,
`.mla.MLATokenToKVPoolHost`) can be built over a CPU device pool, but importing them
reaches SGLang's model configs and quantization layers, some of which import
torchvision at module level; the only torchvision wheel on the package index is a CUDA
build that fails to load over the CPU torch ("operator torchvision::nms does not
exist"). The tests build SGLang's own pools anyway, with those modules replaced by
inert ones (`tests/integrations/sglang/real_pools.py`), and check this class against
them region by region; this class keeps the rest of the tests and the benchmark fast
and free of that workaround.

It keeps exactly what SGLang 0.5.23's pools do with memory, written from their
arithmetic: `kv_buffer` shaped as their `init_kv_buffer` shapes it, per layout;
`get_page_buffer_meta(indices)` returning the same addresses and sizes (MHA
page_first / page_first_direct: K and V of a page across layers; layer_first: K and V
of each layer; MLA: one region per page, or one per layer for layer_first); and the
copying calls SGLang's controller makes for backends without `interface_v1` (its
`file` backend): `get_data_page`, `get_dummy_flat_data_page`,
`set_from_flat_data_page`.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

__all__ = ["HostPoolStandIn", "MambaPoolStandIn"]

LAYOUTS = ("page_first", "layer_first", "page_first_direct", "page_head", "page_first_kv_split")
"""Every `--hicache-mem-layout` of SGLang 0.5.23: page_head is MHA's, page_first_kv_split
MLA's (on NPU in SGLang: K, the latent part, and V, the rope part, in two buffers)."""


class HostPoolStandIn:
    """`pages` host pages of `page_size` tokens of an MHA (or MLA) model."""

    def __init__(
        self,
        *,
        pages: int,
        page_size: int = 16,
        layer_num: int = 2,
        head_num: int = 2,
        head_dim: int = 64,
        dtype: torch.dtype = torch.bfloat16,
        layout: str = "page_first",
        mla: bool = False,
        rope_dim: int = 32,
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if layout == "page_first_kv_split" and not mla:
            raise ValueError("layout page_first_kv_split is SGLang's for MLA only")
        if layout == "page_head" and mla:
            raise ValueError("layout page_head is SGLang's for MHA only")
        self.page_size = page_size
        self.page_num = pages
        self.size = pages * page_size
        self.layer_num = layer_num
        self.head_num = 1 if mla else head_num
        self.head_dim = head_dim  # MLA: kv_cache_dim (kv_lora_rank + rope dim)
        self.dtype = dtype
        self.layout = layout
        self.mla = mla
        self.device = "cpu"
        self.rope_dim = rope_dim  # page_first_kv_split: V's width (qk_rope_head_dim)
        if layout == "page_first_kv_split":
            split = (pages, layer_num, page_size, 1)
            self.k_buffer = torch.zeros((*split, head_dim - rope_dim), dtype=dtype)
            self.v_buffer = torch.zeros((*split, rope_dim), dtype=dtype)
            self.kv_buffer = self.k_buffer  # as SGLang's pool names it
        else:
            self.kv_buffer = torch.zeros(self._dims(), dtype=dtype)

    def _dims(self) -> tuple[int, ...]:
        L, S, H, D, P = self.layer_num, self.size, self.head_num, self.head_dim, self.page_size
        if self.layout == "layer_first":
            dims: tuple[int, ...] = (L, S, H, D)
        elif self.layout == "page_first":
            dims = (S, L, H, D)
        elif self.layout == "page_head":
            dims = (self.page_num, H, P, L, D)
        else:
            dims = (self.page_num, L, P, H, D)
        return dims if self.mla else (2, *dims)

    # -- what the zero-copy interface reads -----------------------------------------
    def get_page_buffer_meta(self, indices: Any) -> tuple[list[int], list[int]]:
        assert len(indices) % self.page_size == 0
        item = self.dtype.itemsize
        token = self.head_num * self.head_dim * item  # bytes of one token in one layer
        base = self.kv_buffer.data_ptr()
        v_offset = 0 if self.mla else self.layer_num * self.size * token
        starts = indices.tolist()[:: self.page_size]
        ptrs: list[int] = []
        if self.layout == "page_first_kv_split":
            k_width, v_width = self.head_dim - self.rope_dim, self.rope_dim
            sizes: list[int] = []
            for index in starts:
                ptrs.append(self.k_buffer.data_ptr() + index * self.layer_num * k_width * item)
                ptrs.append(self.v_buffer.data_ptr() + index * self.layer_num * v_width * item)
                sizes.extend(self.layer_num * item * self.page_size * w for w in (k_width, v_width))
            return ptrs, sizes
        if self.layout == "layer_first":
            for index in starts:
                for layer in range(self.layer_num):
                    k = base + index * token + layer * self.size * token
                    ptrs.extend([k] if self.mla else [k, k + v_offset])
            size = item * self.page_size * self.head_num * self.head_dim
        else:
            for index in starts:
                k = base + index * self.layer_num * token
                ptrs.extend([k] if self.mla else [k, k + v_offset])
            size = self.layer_num * item * self.page_size * self.head_num * self.head_dim
        return ptrs, [size] * len(ptrs)

    # -- what SGLang's controller uses for copying backends (its `file` backend) -----
    def _page(self, index: int) -> torch.Tensor:
        """A view of host page `index` (a token index), as SGLang's pools slice it."""
        p = self.page_size
        lead: tuple[slice, ...] = () if self.mla else (slice(None),)  # MHA: K and V
        if self.layout in ("page_first_direct", "page_head"):
            key = (*lead, slice(index // p, index // p + 1))
        elif self.layout == "layer_first":
            key = (*lead, slice(None), slice(index, index + p))
        else:
            key = (*lead, slice(index, index + p))
        return self.kv_buffer[key]

    def _split_page(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """page_first_kv_split: views of a page's K and its V (two buffers)."""
        page = index // self.page_size
        return self.k_buffer[page], self.v_buffer[page]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        if self.layout == "page_first_kv_split":  # SGLang has no copying calls here:
            k, v = self._split_page(int(index))  # the tests' page is K then V (a copy)
            return torch.cat([k.flatten(), v.flatten()])
        page = self._page(int(index))
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.get_data_page(0).shape, dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        if self.layout == "page_first_kv_split":
            k, v = self._split_page(int(index))
            k.copy_(data_page[: k.numel()].reshape(k.shape))
            v.copy_(data_page[k.numel() :].reshape(v.shape))
            return
        page = self._page(int(index))
        page.copy_(data_page.reshape(page.shape))

    # -- for tests -------------------------------------------------------------------
    def page_bytes(self, page: int) -> bytes:
        """Every byte of host page `page` (in `get_data_page`'s order)."""
        data = self.get_data_page(page * self.page_size).contiguous()
        return bytes(data.view(torch.uint8).numpy())

    def indices(self, pages: list[int]) -> torch.Tensor:
        """The token indices SGLang passes for these host pages."""
        return torch.cat(
            [torch.arange(p * self.page_size, (p + 1) * self.page_size) for p in pages]
        ).to(torch.int64)


class MambaPoolStandIn:
    """A stand-in for SGLang's `MambaPoolHost` (page_first): one slot per page
    (`page_size` 1), a temporal (SSM) state and conv states per Mamba layer, in separate
    buffers of different dtypes; `get_page_buffer_meta` as SGLang's: per page the
    temporal region, then one region per conv buffer."""

    def __init__(
        self,
        *,
        slots: int,
        layers: int = 2,
        temporal_shape: tuple[int, ...] = (4, 16),
        conv_shapes: tuple[tuple[int, ...], ...] = ((3, 32), (3, 8)),
    ) -> None:
        self.page_size = 1
        self.size = slots
        self.layout = "page_first"
        self.num_mamba_layers = layers
        self.temporal_dtype = torch.float32
        self.conv_dtype = torch.bfloat16
        self.temporal_buffer = torch.zeros((slots, layers, 1, *temporal_shape))
        self.conv_buffer = [
            torch.zeros((slots, layers, 1, *shape), dtype=torch.bfloat16) for shape in conv_shapes
        ]

    def _buffers(self) -> list[torch.Tensor]:
        return [self.temporal_buffer, *self.conv_buffer]

    def get_page_buffer_meta(self, indices: Any) -> tuple[list[int], list[int]]:
        ptrs: list[int] = []
        sizes: list[int] = []
        for index in indices.tolist():
            for buffer in self._buffers():
                row = buffer[0].numel() * buffer.element_size()  # one slot, every layer
                ptrs.append(buffer.data_ptr() + index * row)
                sizes.append(row)
        return ptrs, sizes

    def fill(self, slots: list[int], seed: str) -> None:
        """Distinct bytes in `slots` (random bits: compare bytes, not values)."""
        generator = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
        for buffer in self._buffers():
            raw = buffer.view(torch.uint8).view(buffer.shape[0], -1)
            for slot in slots:
                raw[slot] = torch.randint(
                    0, 256, raw[slot].shape, dtype=torch.uint8, generator=generator
                )

    def slot_bytes(self, slot: int) -> bytes:
        rows = [b.view(torch.uint8).view(b.shape[0], -1)[slot] for b in self._buffers()]
        return b"".join(bytes(row.numpy()) for row in rows)

    def indices(self, slots: list[int]) -> torch.Tensor:
        return torch.tensor(slots, dtype=torch.int64)
