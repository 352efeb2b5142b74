"""The slab's device alias: the pinned host slab seen as a CUDA tensor, so gather and
scatter kernels read and write host memory over the bus with no staging buffer.

Only the `kernel` copy backend needs it; DMA copies take host addresses directly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tierkv.contract.errors import ConfigError

DeviceView = Callable[[torch.Tensor, torch.device], torch.Tensor]


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


def require_pinned(slab: torch.Tensor) -> None:
    """CUDA copies to and from the slab are asynchronous only from pinned memory."""
    if not slab.is_pinned():
        raise ConfigError(
            "primary: the slab is not pinned, and a CUDA worker copies asynchronously "
            "from and to pinned memory only; set primary.pin_memory to auto or true",
            source="TransferWorker",
        )


def device_alias(slab: torch.Tensor, device: torch.device, device_view: DeviceView) -> torch.Tensor:
    """CUDA only: the slab as a device tensor over the same (pinned) host bytes,
    checked by reading a few bytes through it with a kernel, then writing one byte
    through it and reading it back on the host (a helper that silently hands a device
    copy would pass a read; then kernel stores would never reach the slab)."""
    require_pinned(slab)
    try:
        alias = device_view(slab, device).view(torch.uint8).view(slab.shape)
    except Exception as exc:  # a driver without unified addressing, a bad helper
        raise ConfigError(
            f"primary: cannot map the pinned slab into {device} ({exc}); pass "
            "device_view= your engine's pinned-host-to-device view helper, or use "
            "copy_backend='dma'",
            source="TransferWorker",
        ) from exc
    probe = slice(0, min(64, slab.shape[1]))  # a kernel reads the slab: the real path
    if alias.device != device or not torch.equal(alias[0, probe].clone().cpu(), slab[0, probe]):
        raise ConfigError(
            f"primary: the device view of the slab is on {alias.device} or does not "
            f"show the slab's bytes; allocate the slab after selecting {device} "
            "(torch.cuda.set_device) or pass device_view=",
            source="TransferWorker",
        )
    if not _writes_reach_the_slab(alias, slab):
        raise ConfigError(
            f"primary: the device view of the slab on {device} is a copy, not an alias: "
            "a byte written through it did not reach the host slab; pass device_view= a "
            "helper that maps the pinned host memory (zero-copy), or use copy_backend='dma'",
            source="TransferWorker",
        )
    return alias


def _writes_reach_the_slab(alias: torch.Tensor, slab: torch.Tensor) -> bool:
    """Flip the slab's first byte through `alias` with a kernel, read it on the host,
    flip it back (the slab is unchanged after, whatever the answer)."""
    before = int(slab[0, 0])
    flipped = before ^ 0xFF

    def settle() -> None:
        if alias.device.type == "cuda":
            torch.cuda.synchronize(alias.device)

    alias[0, 0:1].fill_(flipped)
    settle()
    reached = int(slab[0, 0]) == flipped
    if reached:
        alias[0, 0:1].fill_(before)
        settle()
    else:
        slab[0, 0] = before  # in case a partial mapping wrote elsewhere
    return reached and int(slab[0, 0]) == before
