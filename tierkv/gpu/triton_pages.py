"""The bounded page-copy kernel (Triton): moves (GPU block, layer) pages between the
KV caches and the slab's device alias with a fixed, small number of thread blocks.

Why bounded: gather/scatter through `index_select`/`index_copy_` launches as many
thread blocks as the copy has elements and so spreads over every SM, slowing the
model's kernels beside it by half (H200: matmuls 46-55 % slower during stores). A
PCIe link is saturated by a handful of SMs, so this kernel takes a grid of `programs`
thread blocks and loops: program `p` copies pages `p, p + programs, ...`, each page in
chunks of `CHUNK` words. The model keeps the other SMs.

Addresses are computed in the kernel from per-layer tables that live on the device
(uploaded once per worker) and the transfer's block ids and slab rows, which the host
writes into a small pinned buffer the kernel reads over the bus: no copy is enqueued
before the kernel, so a one-block transfer is one launch.

    gpu address  = gpu_base[l] + gpu_id * gpu_stride[l]
    slab address = slab_layer[l] + row * sub_block_stride      (slab_layer: alias base
                                                                 + layer offset)

All addresses are in bytes; `WORD` is the element the kernel moves (8, 4, 2 or 1
bytes: the widest that every address and page size is a multiple of) and `words[l]` a
page's length in those elements.

Importing this module imports Triton; `tierkv.gpu.bounded` imports it only when the
bounded backend is asked for. On the CPU device the same kernel runs under Triton's
interpreter (slow; it exists so that CPU tests prove the addressing).
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

CHUNK = 1024
"""Words per step of one program: 8 KiB with 8-byte words, 4 warps of 32 threads each
moving 64 bytes."""

NUM_WARPS = 8


def _copy_pages(
    ids_addr,  # int64 address of [2 * n_blocks] int64: GPU block ids, then slab rows
    n_blocks,
    gpu_base,  # [layers] int64 byte addresses of block 0 of each layer
    gpu_stride,  # [layers] int64 bytes between blocks
    slab_layer,  # [layers] int64 byte address of the layer's page in sub-row 0
    words,  # [layers] int64 page length in WORD elements
    num_layers,
    sub_block_stride,
    programs,  # the grid's size
    STORE: tl.constexpr,
    WORD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # an address that fits 32 bits (0: no blocks) arrives as i32; pointers need i64
    ids = ids_addr.to(tl.int64).to(tl.pointer_type(tl.int64))
    tasks = n_blocks * num_layers
    task = tl.program_id(0)
    # while loops, not range(): their bounds are runtime values, which Triton's CPU
    # interpreter (what the CPU tests run) cannot take as range() arguments
    while task < tasks:
        block = task // num_layers
        layer = task - block * num_layers
        gpu_id = tl.load(ids + block)
        row = tl.load(ids + n_blocks + block)
        gpu = (tl.load(gpu_base + layer) + gpu_id * tl.load(gpu_stride + layer)).to(
            tl.pointer_type(WORD)
        )
        slab = (tl.load(slab_layer + layer) + row * sub_block_stride).to(tl.pointer_type(WORD))
        length = tl.load(words + layer)
        start = 0
        while start < length:
            offsets = start + tl.arange(0, CHUNK)
            inside = offsets < length
            if STORE:
                tl.store(slab + offsets, tl.load(gpu + offsets, mask=inside), mask=inside)
            else:
                tl.store(gpu + offsets, tl.load(slab + offsets, mask=inside), mask=inside)
            start += CHUNK
        task += programs


_RUNTIME_INTS = ["ids_addr", "n_blocks", "num_layers", "sub_block_stride", "programs"]
copy_pages = triton.jit(do_not_specialize=_RUNTIME_INTS)(_copy_pages)
"""Compiled once per direction and word size: Triton would otherwise compile a variant
for each runtime int that happens to be 1 or a multiple of 16, on the serving path."""

_interpreted: Any = None


def interpreted_copy_pages() -> Any:
    """The same kernel run by Triton's CPU interpreter: what the bounded backend uses on
    the CPU device (tests), so the address arithmetic the GPU runs is proven on CPU."""
    global _interpreted
    if _interpreted is None:
        from triton.runtime.interpreter import InterpretedFunction

        _interpreted = InterpretedFunction(_copy_pages, do_not_specialize=_RUNTIME_INTS)
    return _interpreted


WORD_TYPES: dict[int, Any] = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.uint8}


def launch(
    programs: int,
    ids_addr: int,
    n_blocks: int,
    tables: tuple[Any, Any, Any, Any],
    num_layers: int,
    sub_block_stride: int,
    *,
    store: bool,
    word: int,
    interpret: bool = False,
) -> None:
    """Enqueue one copy of `n_blocks` blocks (all their layers) on the current stream
    (`interpret`: run it now, on the CPU, through Triton's interpreter)."""
    gpu_base, gpu_stride, slab_layer, words = tables
    kernel = interpreted_copy_pages() if interpret else copy_pages
    kernel[(programs,)](
        ids_addr,
        n_blocks,
        gpu_base,
        gpu_stride,
        slab_layer,
        words,
        num_layers,
        sub_block_stride,
        programs,
        STORE=store,
        WORD=WORD_TYPES[word],
        CHUNK=CHUNK,
        num_warps=NUM_WARPS,
    )
