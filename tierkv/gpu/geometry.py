r"""Where each GPU page lives in a primary slab row, and the checks that the engine's KV
caches, the slab and the cache layout agree.

**What the engine hands over.** Per group, a list of per-layer tensors whose first
dimension is the GPU block index (`kv_caches[g][l][b]` is block `b` of layer `l`).
Any dtype; each block must be contiguous (blocks themselves may be strided apart). A
"layer" is simply a tensor with the block in front: a backend that stacks K and V in
front of the block dimension (`[2, num_blocks, ...]`) passes `kv[0]` and `kv[1]` as two
layers. The *page* of a layer is the bytes of one of its blocks.

**How a group's bytes map into a slab row.** An offloaded block of group `g` is
`block_size_factor` consecutive GPU blocks (sub-blocks) of that group, all its layers,
in one primary slot (row of `block_bytes`). The row is cut into `block_size_factor`
equal *sub-block chunks* of `sub_block_stride = block_bytes // block_size_factor`
bytes; chunk `j` holds GPU sub-block `j`, its layers in order, each `page_bytes[g][l]`
bytes::

    row = | chunk 0                      | chunk 1                      | ...
          | L0 page | L1 page | ... | pad | L0 page | L1 page | ... | pad |

    offset(g, l, j) = j * sub_block_stride + sum(page_bytes[g][:l])

`block_bytes` must be `block_size_factor * max_g sum(page_bytes[g])`: the largest
group fills its chunks exactly, a smaller group (a hybrid model's other attention
kind) leaves padding at the end of each chunk. The worker never reads or writes
padding. The first `k` sub-blocks of a block are always the row's first
`k * sub_block_stride` bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence, Sized
from dataclasses import dataclass

import torch

from tierkv.contract.errors import ConfigError
from tierkv.contract.units import format_size
from tierkv.layout import KVLayout


def page_bytes_of(kv_cache: torch.Tensor) -> int:
    """Bytes of one block of a per-layer KV tensor (first dimension = block)."""
    if kv_cache.dim() == 0:
        raise ValueError("a per-layer KV tensor needs the block as its first dimension")
    return math.prod(kv_cache.shape[1:]) * kv_cache.element_size()


def required_block_bytes(
    kv_caches: Sequence[Sequence[torch.Tensor]], block_size_factor: int
) -> int:
    """The `layout.block_bytes` that fits `kv_caches`: `block_size_factor` times the
    largest group's bytes per GPU block (the sum of its layers' pages)."""
    if block_size_factor < 1:
        raise ValueError(f"block_size_factor must be >= 1, got {block_size_factor}")
    return block_size_factor * max(
        (sum(page_bytes_of(t) for t in layers) for layers in kv_caches), default=0
    )


@dataclass(frozen=True)
class Geometry:
    """The numbers every transfer is checked and planned against."""

    page_bytes: tuple[tuple[int, ...], ...]  # [group][layer]
    block_size_factor: int
    block_bytes: int
    num_gpu_blocks: tuple[int, ...]  # per group
    num_slots: int

    @property
    def sub_block_stride(self) -> int:
        return self.block_bytes // self.block_size_factor

    @property
    def num_groups(self) -> int:
        return len(self.page_bytes)

    def group_block_bytes(self, group: int) -> int:
        """Bytes of one GPU block of `group`, all layers: its share of a chunk."""
        return sum(self.page_bytes[group])

    def pages(self, gpu_ids: Sequence[Sized]) -> int:
        """(block, layer) pages of a transfer moving `gpu_ids[g]` blocks of each group:
        the copies its plan has before contiguous runs are merged."""
        return sum(len(ids) * len(self.page_bytes[g]) for g, ids in enumerate(gpu_ids))

    def layer_offsets(self, group: int) -> tuple[int, ...]:
        """Where each layer's page starts within a chunk of `group`."""
        pages = self.page_bytes[group]
        return tuple(sum(pages[:layer]) for layer in range(len(pages)))

    def byte_range(self, group: int, layer: int, sub_block: int) -> tuple[int, int]:
        """Where, within a slot's row, `layer` of sub-block `sub_block` of a `group`
        block lives: `[start, stop)` in bytes."""
        if not 0 <= sub_block < self.block_size_factor:
            raise IndexError(f"sub_block {sub_block} out of range 0..{self.block_size_factor - 1}")
        start = sub_block * self.sub_block_stride + self.layer_offsets(group)[layer]
        return start, start + self.page_bytes[group][layer]


def check_layout(
    kv_caches: Sequence[Sequence[torch.Tensor]],
    slab: object,
    layout: KVLayout,
    gpu_block_size: int | Sequence[int],
) -> tuple[list[list[torch.Tensor]], Geometry]:
    """Check that the KV caches, the slab and the layout fit together; all problems
    are raised at once as one `ConfigError`."""
    problems: list[str] = []
    groups = _check_kv_caches(kv_caches, layout, problems)
    factor = _check_factor(layout, gpu_block_size, problems)
    _check_slab(slab, layout, problems)
    if problems:
        raise ConfigError(problems, source="TransferWorker")
    assert factor is not None and isinstance(slab, torch.Tensor)
    page_bytes = tuple(tuple(page_bytes_of(t) for t in layers) for layers in groups)
    need = [factor * sum(pages) for pages in page_bytes]
    if max(need) != int(layout.block_bytes):
        worst = need.index(max(need))
        raise ConfigError(
            f"layout.block_bytes: {format_size(int(layout.block_bytes))} does not add "
            f"up: an offloaded block of group {worst} is block_size_factor {factor} x "
            f"{sum(page_bytes[worst])} bytes per GPU block "
            f"(pages {list(page_bytes[worst])}) = {format_size(max(need))}, and the "
            f"largest group must fill a row exactly; set layout.block_bytes to "
            f"{format_size(max(need))}",
            source="TransferWorker",
        )
    geometry = Geometry(
        page_bytes=page_bytes,
        block_size_factor=factor,
        block_bytes=int(layout.block_bytes),
        num_gpu_blocks=tuple(int(layers[0].shape[0]) for layers in groups),
        num_slots=int(slab.shape[0]),
    )
    return groups, geometry


def _check_kv_caches(
    kv_caches: Sequence[Sequence[torch.Tensor]], layout: KVLayout, problems: list[str]
) -> list[list[torch.Tensor]]:
    if isinstance(kv_caches, torch.Tensor) or not isinstance(kv_caches, Sequence):
        problems.append(
            "kv_caches: expected one list of per-layer tensors per group, "
            f"got {type(kv_caches).__name__}"
        )
        return []
    groups: list[list[torch.Tensor]] = []
    if len(kv_caches) != layout.num_groups:
        problems.append(
            f"kv_caches: {len(kv_caches)} groups, but the layout has "
            f"{layout.num_groups}; pass one list of per-layer tensors per layout group"
        )
    devices: set[torch.device] = set()
    for g, layers in enumerate(kv_caches):
        if isinstance(layers, torch.Tensor) or not isinstance(layers, Sequence):
            problems.append(
                f"kv_caches[{g}]: expected a list of per-layer tensors, got {type(layers).__name__}"
            )
            continue
        if not layers:
            problems.append(f"kv_caches[{g}]: a group needs at least one layer")
            continue
        ok = [t for i, t in enumerate(layers) if _check_layer(t, f"kv_caches[{g}][{i}]", problems)]
        devices.update(t.device for t in ok)
        if len(ok) == len(layers):
            blocks = {int(t.shape[0]) for t in ok}
            if len(blocks) > 1:
                problems.append(
                    f"kv_caches[{g}]: layers have different numbers of GPU blocks "
                    f"{[int(t.shape[0]) for t in ok]}; a group shares one block table"
                )
            groups.append(ok)
    if len(devices) > 1:
        problems.append(
            f"kv_caches: tensors on several devices {sorted(map(str, devices))}; "
            "one worker serves one device"
        )
    return groups


def _check_layer(t: object, where: str, problems: list[str]) -> bool:
    if not isinstance(t, torch.Tensor):
        problems.append(f"{where}: expected a torch.Tensor, got {type(t).__name__}")
        return False
    if t.layout != torch.strided or t.is_quantized or t.dtype == torch.bool:
        problems.append(
            f"{where}: dtype {t.dtype} ({t.layout}) is not plain strided data; "
            "pass the KV cache tensor itself or a view of it as bytes"
        )
        return False
    if t.device.type not in ("cpu", "cuda"):
        problems.append(f"{where}: device {t.device} is neither cpu nor cuda")
        return False
    if t.dim() == 0 or t.shape[0] == 0:
        problems.append(f"{where}: shape {tuple(t.shape)} has no block dimension in front")
        return False
    if page_bytes_of(t) == 0:
        problems.append(f"{where}: shape {tuple(t.shape)} holds 0 bytes per block")
        return False
    inner = torch.empty(t.shape[1:], device="meta").stride()
    if any(
        size > 1 and stride != want
        for size, stride, want in zip(t.shape[1:], t.stride()[1:], inner)
    ) or (t.shape[0] > 1 and t.stride(0) * t.element_size() < page_bytes_of(t)):
        problems.append(
            f"{where}: each block must be contiguous and blocks must not overlap "
            f"(shape {tuple(t.shape)}, strides {t.stride()}); pass a tensor "
            "whose first dimension is the block and whose block is one run "
            "of bytes, e.g. the cache itself rather than a transposed view"
        )
        return False
    return True


def _check_factor(
    layout: KVLayout, gpu_block_size: int | Sequence[int], problems: list[str]
) -> int | None:
    sizes = (
        [gpu_block_size] * layout.num_groups
        if isinstance(gpu_block_size, int)
        else list(gpu_block_size)
    )
    if len(sizes) != layout.num_groups or any(
        isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in sizes
    ):
        problems.append(
            f"gpu_block_size: expected a positive int or one per group "
            f"({layout.num_groups}), got {gpu_block_size!r}"
        )
        return None
    factors = []
    for g, (group, size) in enumerate(zip(layout.groups, sizes)):
        if group.block_size % size:
            problems.append(
                f"layout.groups[{g}].block_size: {group.block_size} tokens is not a "
                f"multiple of the GPU block size {size}"
            )
        factors.append(group.block_size // size)
    if len(set(factors)) > 1:
        problems.append(
            f"block_size_factor (offloaded / GPU block size) differs between groups: "
            f"{factors}; it must be the same for every group"
        )
    return factors[0] if not problems else None


def _check_slab(slab: object, layout: KVLayout, problems: list[str]) -> None:
    if not isinstance(slab, torch.Tensor):
        problems.append(
            "primary: expected the primary's view (PrimaryTier.view) or a uint8 tensor, "
            f"got {type(slab).__name__}"
        )
        return
    if slab.dtype != torch.uint8:
        problems.append(f"primary: the slab must be uint8, got dtype {slab.dtype}")
    if slab.dim() != 2 or not slab.is_contiguous():
        problems.append(
            f"primary: the slab must be a contiguous [num_slots, block_bytes] tensor, "
            f"got shape {tuple(slab.shape)} with strides {slab.stride()}"
        )
    elif slab.shape[1] * slab.element_size() != int(layout.block_bytes):
        problems.append(
            f"primary: slab rows are {slab.shape[1] * slab.element_size()} bytes but "
            f"layout.block_bytes is {int(layout.block_bytes)}"
        )
    if slab.device.type != "cpu":
        problems.append(f"primary: the slab must live in host memory, not {slab.device}")
