r"""The transfer worker: copies KV blocks between the engine's GPU KV caches and the
primary slab, in both directions, for every KV-cache group of a request in one job.

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

**A transfer** (`TransferSpec`) names per group the GPU block ids in token order, the
primary slots of the offloaded blocks they fall in, and `block_indices[g]`: the
position of the first GPU block, of which only `% block_size_factor` matters. GPU block
`k` of group `g` goes to (or comes from) sub-block `(head + k) % factor` of slot
`slots[g][(head + k) // factor]`, with `head = block_indices[g] % factor`; so a
transfer may start and end inside an offloaded block, and the sub-blocks it does not
name are left alone. Every check runs before any byte moves.

**How bytes move.** One index-based gather plus one scatter per layer per transfer
(`index_select` / `index_copy_`), never a launch per block. On CPU (the `cpu` device,
what the tests run) the copy happens inside `submit`. On CUDA the same code runs on a
dedicated stream per direction, against a device alias of the pinned slab (unified
virtual addressing: the kernels read and write host memory over the bus, so no host
thread copies anything and no staging buffer of the transfer's size is needed); a
transfer first waits for the compute stream (a store copies finished KV, a load
never overwrites blocks queued kernels still read); an event closes
each transfer, and transfers in one direction complete in submission order.
`await transfer(spec)` polls that event with a short backoff and never synchronises
the event loop thread; `submit` plus `get_finished` serve synchronous callers.

Not thread-safe: drive a worker from one thread (the event loop's).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import operator
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, SupportsIndex, TypeAlias

import anyio
import anyio.lowlevel
import torch

from tierkv.errors import ConfigError, TierKVError
from tierkv.layout import GroupSpec, KVLayout
from tierkv.primary import HostSlab
from tierkv.units import format_size

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

logger = logging.getLogger(__name__)

Direction = Literal["store", "load"]
"""`store`: GPU -> primary slots. `load`: primary slots -> GPU."""

BlockIds: TypeAlias = "Sequence[int] | torch.Tensor | npt.NDArray[np.integer[Any]]"
"""Block ids or slots: a sequence of ints, a 1-D integer tensor or a NumPy array (on
the host: ids on a GPU would force a synchronisation)."""

DIRECTIONS: tuple[Direction, ...] = ("store", "load")
POLL_INTERVAL = (5e-5, 2e-3)
"""Default first and longest wait, in seconds, between two looks at a CUDA event."""

# Copy words, widest first. complex128 serves only as a 16-byte container: the index
# kernels move it without arithmetic, so every bit pattern (NaN payloads included)
# survives; tests round-trip such patterns.
_WORDS = (
    (16, torch.complex128),
    (8, torch.int64),
    (4, torch.int32),
    (2, torch.int16),
    (1, torch.uint8),
)


class TransferSpecError(TierKVError, ValueError):
    """A transfer spec does not fit the worker's geometry; nothing was copied."""


def _non_negative_int(value: SupportsIndex, what: str) -> int:
    try:
        number = operator.index(value)
    except TypeError:
        number = -1
    if isinstance(value, bool) or number < 0:
        raise TransferSpecError(f"{what} must be a non-negative int, got {value!r}")
    return number


# -- public value types ---------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class TransferSpec:
    """One job of the worker: per group, GPU block ids, primary slots, block index.

    `gpu_blocks[g]` are group `g`'s GPU block ids in token order; `slots[g]` the
    primary slots of the offloaded blocks they fall in, in order; `block_indices[g]`
    the position of `gpu_blocks[g][0]` in the request (or in its offloaded block),
    so `block_indices[g] % block_size_factor` leading sub-blocks of the first slot are
    skipped. A group with nothing to move has empty `gpu_blocks[g]` and `slots[g]`.
    """

    direction: Direction
    gpu_blocks: Sequence[BlockIds]
    slots: Sequence[BlockIds]
    block_indices: Sequence[SupportsIndex]

    def __post_init__(self) -> None:
        if self.direction not in DIRECTIONS:
            raise TransferSpecError(
                f"direction must be 'store' (GPU -> primary) or 'load' (primary -> GPU), "
                f"got {self.direction!r}"
            )
        for name in ("gpu_blocks", "slots", "block_indices"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes, torch.Tensor)) or not isinstance(value, Sequence):
                raise TransferSpecError(
                    f"{name} must be a sequence with one entry per group, "
                    f"got {type(value).__name__}"
                )
            object.__setattr__(self, name, tuple(value))
        lengths = {len(self.gpu_blocks), len(self.slots), len(self.block_indices)}
        if len(lengths) != 1:
            raise TransferSpecError(
                f"gpu_blocks, slots and block_indices must each have one entry per group; "
                f"got {len(self.gpu_blocks)}, {len(self.slots)} and "
                f"{len(self.block_indices)} entries"
            )


@dataclass(frozen=True)
class TransferResult:
    """What one transfer did: GPU blocks and bytes moved, and how long the copy took
    (device time between the transfer's start and end events on CUDA)."""

    transfer_id: int
    direction: Direction
    num_blocks: int
    num_bytes: int
    seconds: float

    @property
    def bytes_per_second(self) -> float:
        return self.num_bytes / self.seconds if self.seconds > 0 else math.inf


class _Completion(Protocol):
    """When a launched copy is done, and how long it took."""

    def query(self) -> bool: ...

    def seconds(self) -> float: ...


@dataclass(eq=False)
class TransferHandle:
    """A submitted transfer. `result` is set once its copy is complete."""

    transfer_id: int
    direction: Direction
    num_blocks: int
    num_bytes: int
    result: TransferResult | None = None
    _completion: _Completion | None = field(default=None, repr=False)
    _keepalive: tuple[torch.Tensor, ...] = field(default=(), repr=False)
    _claimed: bool = field(default=False, repr=False)
    _wakeup: anyio.Event | None = field(default=None, repr=False)

    def done(self) -> bool:
        return self.result is not None


# -- geometry -------------------------------------------------------------------------
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


def _word(*values: int) -> tuple[int, torch.dtype]:
    """The widest element (16, 8, 4, 2 or 1 bytes) every offset and size is a multiple
    of: index kernels move one element per step, so wider elements move bytes faster."""
    for size, dtype in _WORDS:
        if all(v % size == 0 for v in values):
            return size, dtype
    raise AssertionError("unreachable: every int is a multiple of 1")


def _rows(storage_owner: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor of `dtype` over the whole storage of `storage_owner`."""
    base = torch.empty(0, dtype=dtype, device=storage_owner.device)
    return base.set_(storage_owner.untyped_storage())


class _CudaArray:
    """Exposes host memory to `torch.as_tensor` through the CUDA array interface."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._owner = tensor  # the alias keeps this object, so the memory, alive
        self.__cuda_array_interface__ = {
            "shape": (tensor.numel() * tensor.element_size(),),
            "typestr": "|u1",
            "data": (tensor.data_ptr(), False),
            "strides": None,
            "version": 2,
        }


def uva_view(pinned: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A 1-D uint8 CUDA tensor over the bytes of the pinned host tensor `pinned`.

    With unified virtual addressing (every 64-bit CUDA platform), pinned host memory
    is mapped into the device's address space at the same address, so kernels may read
    and write it directly. Pass your engine's own helper as `TransferWorker(...,
    device_view=...)` if it has one."""
    return torch.as_tensor(_CudaArray(pinned), device=device)


@dataclass(frozen=True)
class _LayerMove:
    gpu: torch.Tensor  # [num_gpu_blocks, page // word]
    slab: torch.Tensor  # [num_slots * factor, page // word], rows sub_block_stride apart


@dataclass
class _Lane:
    """One direction: its CUDA stream (None on CPU) and its transfers in flight, oldest
    first. Waiters are the handles being awaited, in submission order."""

    stream: torch.cuda.Stream | None
    in_flight: deque[TransferHandle] = field(default_factory=deque)
    waiters: list[TransferHandle] = field(default_factory=list)


@dataclass(frozen=True)
class _Plan:
    direction: Direction
    indices: torch.Tensor  # int64, per group: GPU ids then flat slab rows
    counts: tuple[int, ...]
    num_blocks: int
    num_bytes: int


class _Finished:
    """CPU: the copy ran inside `submit`."""

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds

    def query(self) -> bool:
        return True

    def seconds(self) -> float:
        return self._seconds


def _new_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]


def _timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


class _CudaEvents:
    def __init__(self, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        self._start = start
        self._end = end

    def query(self) -> bool:
        return bool(self._end.query())  # type: ignore[no-untyped-call]

    def seconds(self) -> float:
        return float(self._start.elapsed_time(self._end)) / 1000.0


# -- the worker -----------------------------------------------------------------------
class TransferWorker:
    """Moves KV blocks between GPU KV caches and primary slots; see the module doc.

    `kv_caches[g]` are group `g`'s per-layer tensors (block index first), `primary` the
    primary slab (a `HostSlab` or its `[num_slots, block_bytes]` uint8 tensor, pinned
    when the KV caches are on CUDA), `layout` the cache's `KVLayout`, and
    `gpu_block_size` the engine's block size in tokens (one int, or one per group).
    `block_size_factor` is `layout.groups[g].block_size // gpu_block_size[g]` and must
    be the same for every group. Layout problems raise `ConfigError`, all at once.

    CUDA only: every transfer first waits on `compute_stream` (default: the current
    stream at submit): a store so it copies finished KV, a load so it does not
    overwrite GPU blocks that kernels queued earlier still read. `device_view(pinned_slab,
    device)` makes the device alias of the slab (default `uva_view`).
    """

    def __init__(
        self,
        kv_caches: Sequence[Sequence[torch.Tensor]],
        primary: HostSlab | torch.Tensor,
        layout: KVLayout,
        *,
        gpu_block_size: int | Sequence[int],
        compute_stream: torch.cuda.Stream | None = None,
        device_view: Callable[[torch.Tensor, torch.device], torch.Tensor] = uva_view,
        poll_interval: tuple[float, float] = POLL_INTERVAL,
    ) -> None:
        slab = primary.tensor if isinstance(primary, HostSlab) else primary
        problems: list[str] = []
        groups = self._check_kv_caches(kv_caches, layout, problems)
        factor = self._check_factor(layout, gpu_block_size, problems)
        self._check_slab(slab, layout, problems)
        if problems:
            raise ConfigError(problems, source="TransferWorker")
        assert factor is not None
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
        self.device: torch.device = groups[0][0].device
        self.block_size_factor = factor
        self.block_bytes = int(layout.block_bytes)
        self.sub_block_stride = self.block_bytes // factor
        self.page_bytes = page_bytes
        self.num_gpu_blocks = tuple(int(layers[0].shape[0]) for layers in groups)
        self.num_slots = int(slab.shape[0])
        self._slab = slab
        self._poll_min, self._poll_max = poll_interval
        self._ids = itertools.count(1)
        self._finished: list[TransferResult] = []
        self._compute_stream = compute_stream

        cuda = self.device.type == "cuda"
        slab_on_device = slab
        if cuda:  # CUDA only: the slab's device alias, one stream per direction
            slab_on_device = self._device_alias(slab, device_view)
        self._lanes: dict[Direction, _Lane] = {
            d: _Lane(_new_stream(self.device) if cuda else None) for d in DIRECTIONS
        }
        self._moves = tuple(
            tuple(
                self._layer_move(t, slab_on_device, sum(pages[:i]), pages[i])
                for i, t in enumerate(layers)
            )
            for layers, pages in zip(groups, page_bytes)
        )
        logger.debug(
            "transfer worker on %s: %d groups, factor %d, block %s, pages %s",
            self.device,
            len(groups),
            factor,
            format_size(self.block_bytes),
            page_bytes,
        )

    # -- construction checks ------------------------------------------------------------
    @staticmethod
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
                    f"kv_caches[{g}]: expected a list of per-layer tensors, "
                    f"got {type(layers).__name__}"
                )
                continue
            if not layers:
                problems.append(f"kv_caches[{g}]: a group needs at least one layer")
                continue
            ok: list[torch.Tensor] = []
            for i, t in enumerate(layers):
                where = f"kv_caches[{g}][{i}]"
                if not isinstance(t, torch.Tensor):
                    problems.append(f"{where}: expected a torch.Tensor, got {type(t).__name__}")
                    continue
                if t.layout != torch.strided or t.is_quantized or t.dtype == torch.bool:
                    problems.append(
                        f"{where}: dtype {t.dtype} ({t.layout}) is not plain strided data; "
                        "pass the KV cache tensor itself or a view of it as bytes"
                    )
                    continue
                if t.device.type not in ("cpu", "cuda"):
                    problems.append(f"{where}: device {t.device} is neither cpu nor cuda")
                    continue
                if t.dim() == 0 or t.shape[0] == 0:
                    problems.append(
                        f"{where}: shape {tuple(t.shape)} has no block dimension in front"
                    )
                    continue
                if page_bytes_of(t) == 0:
                    problems.append(f"{where}: shape {tuple(t.shape)} holds 0 bytes per block")
                    continue
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
                    continue
                devices.add(t.device)
                ok.append(t)
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

    @staticmethod
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

    @staticmethod
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

    def _device_alias(
        self,
        slab: torch.Tensor,
        device_view: Callable[[torch.Tensor, torch.device], torch.Tensor],
    ) -> torch.Tensor:
        """CUDA only: the slab as a device tensor over the same (pinned) host bytes."""
        if not slab.is_pinned():
            raise ConfigError(
                "primary: the slab is not pinned, and a CUDA worker copies asynchronously "
                "from and to pinned memory only; set primary.pin_memory to auto or true",
                source="TransferWorker",
            )
        try:
            alias = device_view(slab, self.device).view(torch.uint8).view(slab.shape)
        except Exception as exc:  # a driver without unified addressing, a bad helper
            raise ConfigError(
                f"primary: cannot map the pinned slab into {self.device} ({exc}); pass "
                "device_view= your engine's pinned-host-to-device view helper",
                source="TransferWorker",
            ) from exc
        probe = slice(0, min(64, slab.shape[1]))  # a kernel reads the slab: the real path
        if alias.device != self.device or not torch.equal(
            alias[0, probe].clone().cpu(), slab[0, probe]
        ):
            raise ConfigError(
                f"primary: the device view of the slab is on {alias.device} or does not "
                f"show the slab's bytes; allocate the slab after selecting {self.device} "
                "(torch.cuda.set_device) or pass device_view=",
                source="TransferWorker",
            )
        return alias

    def _layer_move(
        self, kv: torch.Tensor, slab: torch.Tensor, offset: int, page: int
    ) -> _LayerMove:
        es = kv.element_size()
        gpu_offset = int(kv.storage_offset()) * es
        gpu_stride = int(kv.stride(0)) * es
        slab_offset = int(slab.storage_offset()) + offset
        word, dtype = _word(
            page,
            gpu_offset,
            gpu_stride,
            kv.untyped_storage().data_ptr(),
            slab_offset,
            self.sub_block_stride,
            slab.untyped_storage().data_ptr(),
        )
        gpu = _rows(kv, dtype).as_strided(
            (int(kv.shape[0]), page // word), (gpu_stride // word, 1), gpu_offset // word
        )
        rows = self.num_slots * self.block_size_factor
        slab_rows = _rows(slab, dtype).as_strided(
            (rows, page // word), (self.sub_block_stride // word, 1), slab_offset // word
        )
        return _LayerMove(gpu, slab_rows)

    # -- geometry -----------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.page_bytes)

    def group_block_bytes(self, group: int) -> int:
        """Bytes of one GPU block of `group`, all layers: its share of a chunk."""
        return sum(self.page_bytes[group])

    def byte_range(self, group: int, layer: int, sub_block: int) -> tuple[int, int]:
        """Where, within a slot's row, `layer` of sub-block `sub_block` of a `group`
        block lives: `[start, stop)` in bytes."""
        if not 0 <= sub_block < self.block_size_factor:
            raise IndexError(f"sub_block {sub_block} out of range 0..{self.block_size_factor - 1}")
        pages = self.page_bytes[group]
        start = sub_block * self.sub_block_stride + sum(pages[:layer])
        return start, start + pages[layer]

    # -- submitting -----------------------------------------------------------------------
    def _index(self, what: str, values: BlockIds, limit: int) -> torch.Tensor:
        if isinstance(values, torch.Tensor):
            if values.device.type != "cpu":
                raise TransferSpecError(f"{what}: pass ids on the host, not on {values.device}")
            ids = values
        else:
            try:
                ids = torch.as_tensor(values) if len(values) else torch.empty(0, dtype=torch.int64)
            except (TypeError, ValueError, RuntimeError) as exc:
                raise TransferSpecError(f"{what}: not a sequence of ints ({exc})") from None
        if ids.dim() != 1 or ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise TransferSpecError(
                f"{what}: expected a 1-D sequence of ints, got dtype {ids.dtype} "
                f"shape {tuple(ids.shape)}"
            )
        ids = ids.to(torch.int64)
        if ids.numel():
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= limit:
                bad = low if low < 0 else high
                raise TransferSpecError(f"{what}: {bad} is out of range 0..{limit - 1}")
        return ids

    def _plan(self, spec: TransferSpec) -> _Plan:
        """Check `spec` against the geometry and build its index tensor. Raises
        TransferSpecError before anything is copied."""
        if not isinstance(spec, TransferSpec):
            raise TransferSpecError(f"expected a TransferSpec, got {type(spec).__name__}")
        if len(spec.gpu_blocks) != self.num_groups:
            raise TransferSpecError(
                f"the spec names {len(spec.gpu_blocks)} groups but the worker has "
                f"{self.num_groups}; give every group an entry (empty when it moves nothing)"
            )
        factor = self.block_size_factor
        parts: list[torch.Tensor] = []
        all_slots: list[torch.Tensor] = []
        counts: list[int] = []
        num_bytes = 0
        for g in range(self.num_groups):
            index = _non_negative_int(spec.block_indices[g], f"block_indices[{g}]")
            gpu = self._index(f"gpu_blocks[{g}]", spec.gpu_blocks[g], self.num_gpu_blocks[g])
            slots = self._index(f"slots[{g}]", spec.slots[g], self.num_slots)
            n, head = gpu.numel(), index % factor
            spans = -(-(head + n) // factor) if n else 0
            if slots.numel() != spans:
                raise TransferSpecError(
                    f"group {g}: {n} GPU blocks starting at sub-block {head} "
                    f"(block_indices[{g}]={index} % block_size_factor {factor}) span {spans} "
                    f"offloaded blocks, but {slots.numel()} slots were given"
                )
            if spec.direction == "load" and torch.unique(gpu).numel() != n:
                raise TransferSpecError(
                    f"gpu_blocks[{g}]: a GPU block appears twice; a load would write it twice"
                )
            position = torch.arange(head, head + n, dtype=torch.int64)
            parts += [gpu, slots[position // factor] * factor + position % factor]
            all_slots.append(slots)
            counts.append(n)
            num_bytes += n * self.group_block_bytes(g)
        if spec.direction == "store":
            every = torch.cat(all_slots)
            if torch.unique(every).numel() != every.numel():
                raise TransferSpecError(
                    "slots: a slot appears twice (within or across groups); a store would "
                    "write it twice"
                )
        indices = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        return _Plan(spec.direction, indices, tuple(counts), sum(counts), num_bytes)

    def _copy(self, plan: _Plan, indices: torch.Tensor) -> None:
        """The copy itself: one gather and one scatter per layer of each group."""
        offset = 0
        for moves, n in zip(self._moves, plan.counts):
            gpu_ids = indices[offset : offset + n]
            slab_rows = indices[offset + n : offset + 2 * n]
            offset += 2 * n
            if not n:
                continue
            for move in moves:
                if plan.direction == "store":
                    move.slab.index_copy_(0, slab_rows, move.gpu.index_select(0, gpu_ids))
                else:
                    move.gpu.index_copy_(0, gpu_ids, move.slab.index_select(0, slab_rows))

    def _launch(self, plan: _Plan, lane: _Lane) -> tuple[_Completion, tuple[torch.Tensor, ...]]:
        """Start the copy of `plan`; return how to tell it is done and the tensors to
        keep alive until then."""
        if lane.stream is None:
            start = time.perf_counter()
            self._copy(plan, plan.indices)
            return _Finished(time.perf_counter() - start), ()
        # CUDA only. Every tensor made here is allocated on `stream`, so the caching
        # allocator reuses its memory only for later work on that same stream; the
        # pinned host indices are also held until the end event has completed.
        stream = lane.stream
        compute = self._compute_stream
        if compute is None:
            compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream):
            # a store copies finished KV; a load must not overwrite GPU blocks that
            # kernels queued before it (of the blocks' previous owner) still read
            stream.wait_stream(compute)
            start_event = _timing_event()
            end_event = _timing_event()
            start_event.record(stream)
            host_indices = plan.indices.pin_memory()
            indices = host_indices.to(self.device, non_blocking=True)
            self._copy(plan, indices)
            end_event.record(stream)
        return _CudaEvents(start_event, end_event), (host_indices, indices)

    def submit(self, spec: TransferSpec) -> TransferHandle:
        """Check `spec` and start its copy (on CPU: do it). Results of submitted
        transfers that nobody awaits with `wait` are handed out by `get_finished`."""
        return self._submit(spec, claimed=False)

    def _submit(self, spec: TransferSpec, *, claimed: bool) -> TransferHandle:
        plan = self._plan(spec)
        lane = self._lanes[plan.direction]
        completion, keepalive = self._launch(plan, lane)
        handle = TransferHandle(
            next(self._ids),
            plan.direction,
            plan.num_blocks,
            plan.num_bytes,
            _completion=completion,
            _keepalive=keepalive,
            _claimed=claimed,
        )
        lane.in_flight.append(handle)
        self._reap()
        return handle

    # -- completion ---------------------------------------------------------------------
    def _reap(self) -> None:
        """Finish, in order, every transfer whose copy is complete, and wake the first
        waiter of each direction if its transfer is done."""
        for lane in self._lanes.values():
            while lane.in_flight:
                handle = lane.in_flight[0]
                assert handle._completion is not None
                if not handle._completion.query():
                    break
                lane.in_flight.popleft()
                handle.result = TransferResult(
                    handle.transfer_id,
                    handle.direction,
                    handle.num_blocks,
                    handle.num_bytes,
                    handle._completion.seconds(),
                )
                handle._completion, handle._keepalive = None, ()
                if not handle._claimed:
                    self._finished.append(handle.result)
            if lane.waiters and lane.waiters[0].done() and lane.waiters[0]._wakeup:
                lane.waiters[0]._wakeup.set()

    def get_finished(self) -> list[TransferResult]:
        """Results of completed transfers that no `wait` claimed, in submission order
        within each direction; each result is handed out once."""
        self._reap()
        finished, self._finished = self._finished, []
        return finished

    @property
    def num_in_flight(self) -> int:
        return sum(len(lane.in_flight) for lane in self._lanes.values())

    async def wait(self, handle: TransferHandle) -> TransferResult:
        """Wait for `handle`'s copy without blocking the event loop, and return its
        result. Waits in one direction return in submission order. If the wait is
        cancelled, the result goes to `get_finished` instead."""
        if handle._claimed:
            raise RuntimeError(f"transfer {handle.transfer_id} is already being awaited")
        handle._claimed = True
        return await self._wait_claimed(handle)

    async def _wait_claimed(self, handle: TransferHandle) -> TransferResult:
        for i, result in enumerate(self._finished):  # done before anyone waited
            if result is handle.result:
                del self._finished[i]
                break
        lane = self._lanes[handle.direction]
        lane.waiters.append(handle)
        delivered = False
        try:
            await anyio.lowlevel.checkpoint()
            delay = self._poll_min
            while True:
                self._reap()
                if handle.done() and lane.waiters[0] is handle:
                    delivered = True
                    break
                # Only the first waiter polls; the others wait for their turn.
                first = lane.waiters[0] is handle
                handle._wakeup = anyio.Event()
                with anyio.move_on_after(delay if first else math.inf):
                    await handle._wakeup.wait()
                if first:
                    delay = min(2 * delay, self._poll_max)
        finally:
            lane.waiters.remove(handle)
            handle._wakeup = None
            if not delivered:
                handle._claimed = False
                if handle.result is not None:
                    self._finished.append(handle.result)
            if lane.waiters and lane.waiters[0]._wakeup:
                lane.waiters[0]._wakeup.set()
        assert handle.result is not None
        return handle.result

    async def transfer(self, spec: TransferSpec) -> TransferResult:
        """Copy `spec` and return once the bytes are in place.

        Once submitted, the copy is awaited to its end even if the caller is cancelled
        (the wait is shielded, and copies are bounded): the caller frees or reuses the
        slots and GPU blocks as soon as this returns or raises, so it must not return
        while a queued copy could still touch them."""
        handle = self._submit(spec, claimed=True)
        with anyio.CancelScope(shield=True):
            result = await self._wait_claimed(handle)
        return result

    async def drain(self) -> None:
        """Wait until no transfer is in flight (results stay where they would go)."""
        delay = self._poll_min
        while True:
            self._reap()
            if not self.num_in_flight:
                return
            await anyio.sleep(delay)
            delay = min(2 * delay, self._poll_max)


# -- measuring --------------------------------------------------------------------------
@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def benchmark(
    total_bytes: int = 256 * 2**20,
    *,
    page_bytes: int = 32 * 2**10,
    num_layers: int = 32,
    block_size_factor: int = 1,
    repeats: int = 3,
    device: str = "cpu",
    seed: int = 0,
) -> dict[str, Any]:
    """Throughput of a store and a load of `total_bytes` (random GPU blocks to random
    slots) against a raw `copy_` of the same bytes between the same two memories,
    measured in the same run with one torch thread; best of `repeats`."""
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    block = num_layers * page_bytes
    count = max(1, total_bytes // block)
    moved = count * block
    kv = [
        torch.randint(0, 256, (2 * count, page_bytes), dtype=torch.uint8, generator=gen).to(dev)
        for _ in range(num_layers)
    ]
    pinned = dev.type == "cuda"
    slots_total = -(-2 * count // block_size_factor)
    slab = torch.zeros(
        (slots_total, block * block_size_factor), dtype=torch.uint8, pin_memory=pinned
    )
    layout = KVLayout(
        block_bytes=block * block_size_factor,
        groups=(GroupSpec(block_size=16 * block_size_factor),),
    )
    worker = TransferWorker([kv], slab, layout, gpu_block_size=16)
    gpu_ids = torch.randperm(2 * count, generator=gen)[:count]
    slots = torch.randperm(slots_total, generator=gen)[: -(-count // block_size_factor)]
    src = torch.empty(moved, dtype=torch.uint8, device=dev)
    dst = torch.empty(moved, dtype=torch.uint8, pin_memory=pinned)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def best(run: Callable[[], object]) -> float:
        times = []
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            run()
            sync()
            times.append(time.perf_counter() - start)
        return min(times)

    def move(direction: Direction) -> None:
        worker.submit(TransferSpec(direction, [gpu_ids], [slots], [0]))
        worker.get_finished()

    with _one_thread():
        raw_store = best(lambda: dst.copy_(src, non_blocking=True))
        raw_load = best(lambda: src.copy_(dst, non_blocking=True))
        store = best(lambda: move("store"))
        load = best(lambda: move("load"))
    gbps = moved / 1e9
    return {
        "bytes": moved,
        "device": str(dev),
        "store_GBps": gbps / store,
        "load_GBps": gbps / load,
        "raw_store_GBps": gbps / raw_store,
        "raw_load_GBps": gbps / raw_load,
        "store_ratio": raw_store / store,
        "load_ratio": raw_load / load,
    }
