"""What the demo runs by default on each device.

On the CPU, today's small model (4 layers x 256 hidden, float32): a few seconds.
On CUDA a model that small recomputes a prompt faster than anything can be loaded
(measured on an H100: tierkv 0.90x), which says nothing about a real server. There the
demo takes a ~1B-parameter bfloat16 model and a 4096-token shared system prompt, so
prefill is real work, scaled down (fewer layers) until the weights, three engines' KV
caches and the prefill's working memory fit the GPU's free memory with room to spare.

The engine's KV cache holds the longest request by default: its GPU prefix cache keeps
the shared system prompt warm, but a returning user's conversation has been evicted by
the others, which is where tierkv's tiers come in.

The CUDA profile ran on an H200 on 2026-11-26: 970M parameters, 20 layers, 16 of 16
turns identical, tierkv 1.48x TTFT over the GPU prefix cache alone (docs/demo.md). Its
arithmetic is tested on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tierkv.demo.model import ModelConfig
from tierkv.demo.workload import WorkloadConfig


@dataclass(frozen=True)
class DemoProfile:
    """Defaults for one device; explicit command-line options override each field."""

    model: ModelConfig
    workload: WorkloadConfig
    primary_capacity: int  # bytes, for the default chain


CPU_PROFILE = DemoProfile(
    model=ModelConfig(vocab=4096, hidden=256, layers=4, heads=4, dtype="float32"),
    workload=WorkloadConfig(
        users=4, turns=4, system_tokens=512, message_tokens=96, reply_tokens=16
    ),
    primary_capacity=8 << 20,
)

CUDA_PROFILE = DemoProfile(
    # 20 x (10 x 2048^2) + 2 x 32000 x 2048 = 0.97e9 parameters, 1.9 GB in bfloat16
    model=ModelConfig(vocab=32000, hidden=2048, layers=20, heads=16, dtype="bfloat16"),
    workload=WorkloadConfig(
        users=4, turns=4, system_tokens=4096, message_tokens=256, reply_tokens=32
    ),
    # 160 KiB of KV per token: the conversations' 8,576 distinct tokens are 1.3 GiB;
    # the primary holds most of them, the nvme tier below it the rest
    primary_capacity=1 << 30,
)

ENGINES = 3
"""KV caches the demo allocates: no cache, GPU prefix cache, GPU prefix cache + tierkv."""


def parameters(model: ModelConfig) -> int:
    """Parameter count of `TinyDecoder(model)` (norm weights included)."""
    h = model.hidden
    per_layer = 3 * h * h + h * h + 2 * 2 * h * h + 2 * h * h + 2 * h
    return model.layers * per_layer + 2 * model.vocab * h + h


def kv_bytes_per_token(model: ModelConfig) -> int:
    """K and V of every layer for one token."""
    itemsize = 4 if model.dtype == "float32" else 2
    return 2 * model.layers * model.hidden * itemsize


def gpu_blocks_for(workload: WorkloadConfig, block_tokens: int) -> int:
    """KV blocks for the longest request of `workload` (prompt and reply)."""
    return -(-(workload.longest_prompt + workload.reply_tokens) // block_tokens)


def gpu_memory_needed(profile: DemoProfile, block_tokens: int) -> int:
    """Bytes of GPU memory the demo takes with `profile`: weights, every engine's KV
    cache, and the largest prefill's activations (the attention of one layer over the
    whole prompt, in float32 as SDPA's math path keeps it, plus the MLP)."""
    model, wl = profile.model, profile.workload
    itemsize = 4 if model.dtype == "float32" else 2
    weights = parameters(model) * itemsize
    kv = ENGINES * gpu_blocks_for(wl, block_tokens) * block_tokens
    kv *= kv_bytes_per_token(model)
    n = wl.longest_prompt
    attention = model.heads * n * n * 4 + n * n  # scores + the boolean mask
    activations = n * 6 * model.hidden * itemsize * 4
    return weights + kv + attention + activations


def fit_to_memory(
    profile: DemoProfile, free_bytes: int, block_tokens: int, *, headroom: float = 0.7
) -> DemoProfile:
    """`profile` with fewer layers (down to 2), then a shorter system prompt, until it
    needs at most `headroom` of `free_bytes`."""
    budget = int(free_bytes * headroom)
    fitted = profile
    while gpu_memory_needed(fitted, block_tokens) > budget:
        model, wl = fitted.model, fitted.workload
        if model.layers > 2:
            fitted = replace(fitted, model=replace(model, layers=max(2, model.layers * 3 // 4)))
        elif wl.system_tokens > 256:
            fitted = replace(fitted, workload=replace(wl, system_tokens=wl.system_tokens // 2))
        else:
            break
    return fitted


def profile_for(
    device_type: str, *, free_bytes: int | None = None, block_tokens: int = 16
) -> DemoProfile:
    """The defaults for a device type (`cpu` or `cuda`); on CUDA fitted to
    `free_bytes` of GPU memory when given."""
    if device_type != "cuda":
        return CPU_PROFILE
    if free_bytes is None:
        return CUDA_PROFILE
    return fit_to_memory(CUDA_PROFILE, free_bytes, block_tokens)


def cuda_free_bytes() -> int | None:
    """Free memory of the current CUDA device, or None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info()
    return int(free)
