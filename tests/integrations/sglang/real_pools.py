"""SGLang's OWN host pool classes on a CPU machine, for the tests.

`sglang.srt.mem_cache.pool_host.mha` imports, through `memory_pool`, SGLang's model
configs and quantization layers, and a handful of those import packages a CPU test
machine cannot have (torchvision: the package index's wheel is a CUDA build that fails
over the CPU torch) or does not need (sentencepiece, compressed_tensors, gguf). None of
them is used by a host pool. `import_around_missing` imports a module and, each time
the import fails on a missing package, puts an inert stand-in in place of the SGLang
module that asked for it (its names are empty classes) and tries again: 15 modules of
SGLang 0.5.23, every one about a model family or a quantization format. The pools are
then built exactly as SGLang builds them: a device pool (`MHATokenToKVPool`,
`MLATokenToKVPool`) on device "cpu" and the host pool over its buffer info; a
`MambaPoolHost` over state buffers on "cpu".

Loaded by the conftest with `importlib` (the tests run in importlib mode).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import traceback
import types
from typing import Any


class _Inert(type):
    """An empty class whose every attribute reads as a name (a registry keyed by
    `cls.model_type` still builds)."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return f"{cls.__name__}.{name}"


def _inert_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)

    def missing(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        value = _Inert(attr, (), {})
        setattr(module, attr, value)
        return value

    module.__getattr__ = missing  # type: ignore[method-assign]
    return module


STUBBED: list[str] = []


def import_around_missing(target: str, tries: int = 60) -> types.ModuleType:
    for _ in range(tries):
        before = set(sys.modules)
        try:
            return importlib.import_module(target)
        except ModuleNotFoundError as exc:
            if exc.name is None or exc.name.startswith("sglang"):
                raise
            trace = traceback.extract_tb(exc.__traceback__)
            frames = [f for f in trace if "/sglang/" in f.filename]
            if not frames:
                raise
            path = frames[-1].filename.split("site-packages/")[-1]
            name = path[: -len(".py")].replace("/", ".").removesuffix(".__init__")
            for loaded in [n for n in set(sys.modules) - before if n.startswith("sglang")]:
                del sys.modules[loaded]
            sys.modules[name] = _inert_module(name)
            STUBBED.append(name)
    raise RuntimeError(f"{target} still does not import after stubbing {STUBBED}")


def mha_host_pool(*, pages: int, page_size: int, layout: str, layers: int = 2,
                  heads: int = 2, head_dim: int = 64) -> Any:
    import torch

    memory_pool = import_around_missing("sglang.srt.mem_cache.memory_pool")
    mha = import_around_missing("sglang.srt.mem_cache.pool_host.mha")
    device = memory_pool.MHATokenToKVPool(
        size=pages * page_size, page_size=page_size, dtype=torch.bfloat16, head_num=heads,
        head_dim=head_dim, layer_num=layers, device="cpu", enable_memory_saver=False,
        start_layer=0, end_layer=layers - 1,
    )
    return mha.MHATokenToKVPoolHost(
        device._mha_buffer_info(), 1.0, 0, page_size, layout, pin_memory=False,
        device="cpu", device_capacity_tokens=pages * page_size, start_layer=0,
        end_layer=layers - 1,
    )


def mla_host_pool(*, pages: int, page_size: int, layout: str, layers: int = 2) -> Any:
    import torch

    memory_pool = import_around_missing("sglang.srt.mem_cache.memory_pool")
    mla = import_around_missing("sglang.srt.mem_cache.pool_host.mla")
    device = memory_pool.MLATokenToKVPool(
        size=pages * page_size, page_size=page_size, dtype=torch.bfloat16, kv_lora_rank=64,
        qk_rope_head_dim=32, layer_num=layers, device="cpu", enable_memory_saver=False,
        start_layer=0, end_layer=layers - 1,
    )
    return mla.MLATokenToKVPoolHost(
        device._mla_buffer_info(), 1.0, 0, page_size, layout, pin_memory=False,
        device="cpu", device_capacity_tokens=pages * page_size, start_layer=0,
        end_layer=layers - 1, target_layer_num=layers,
    )


def mamba_host_pool(*, slots: int, layers: int = 2,
                    temporal_shape: tuple[int, ...] = (4, 16),
                    conv_shapes: tuple[tuple[int, ...], ...] = ((3, 32), (3, 8))) -> Any:
    """SGLang's `MambaPoolHost` (page_first) over device state buffers on "cpu"."""
    import torch

    info_module = import_around_missing("sglang.srt.mem_cache.device_pool_info")
    mamba = import_around_missing("sglang.srt.mem_cache.pool_host.mamba")
    info = info_module.MambaStateBufferInfo(
        temporal=torch.zeros((layers, slots, *temporal_shape)),
        conv=tuple(
            torch.zeros((layers, slots, *shape), dtype=torch.bfloat16) for shape in conv_shapes
        ),
    )
    return mamba.MambaPoolHost(
        info, 1.0, 0, device_capacity=slots, pin_memory=False, device="cpu",
        layout="page_first",
    )
