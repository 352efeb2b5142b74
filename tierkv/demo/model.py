"""A small decoder-only transformer with a paged KV cache, for the demo.

Random weights from a fixed seed (nothing is downloaded): pre-norm blocks of RMSNorm,
multi-head attention with rotary positions and a SiLU-gated MLP. What matters for
tierkv is the KV cache: per layer one K and one V tensor of shape
`[num_gpu_blocks, block_tokens, heads, head_dim]`, addressed through a block table
exactly like a serving engine's. A forward pass writes the K/V of its tokens into
their blocks and attends to every earlier position of the sequence through the same
table, so KV that tierkv loaded into a block is used as if it had been computed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

DType = Literal["float32", "float16", "bfloat16"]


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 4096
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    seed: int = 0
    dtype: DType = "float32"

    def __post_init__(self) -> None:
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ValueError(
                f"hidden {self.hidden} must split into {self.heads} heads of an even size"
            )
        for name in ("vocab", "hidden", "layers", "heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    def fingerprint(self) -> str:
        """Everything that decides the KV values, for the cache namespace."""
        return "-".join(f"{k}{v}" for k, v in asdict(self).items())


class PagedKVCache:
    """The engine's KV cache: per layer a K and a V tensor, block index first, and a
    free list of block ids. `block_tokens` tokens per block."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_tokens: int,
        device: torch.device,
        *,
        layers: int | None = None,
    ) -> None:
        """`layers`: how many attention layers use this cache (default: all of the
        model's; a hybrid model gives each attention kind its own cache)."""
        if num_blocks < 1 or block_tokens < 1:
            raise ValueError("the KV cache needs at least one block of at least one token")
        count = config.layers if layers is None else layers
        shape = (num_blocks, block_tokens, config.heads, config.head_dim)
        self.k = [torch.zeros(shape, dtype=config.torch_dtype, device=device) for _ in range(count)]
        self.v = [torch.zeros(shape, dtype=config.torch_dtype, device=device) for _ in range(count)]
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        self._free = list(range(num_blocks - 1, -1, -1))

    def layers(self) -> list[torch.Tensor]:
        """The per-layer tensors in the order the transfer worker takes them."""
        return [t for pair in zip(self.k, self.v) for t in pair]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(
                f"the KV cache has {len(self._free)} free blocks of {self.num_blocks}; "
                f"a request needs {count}"
            )
        return [self._free.pop() for _ in range(count)]

    def release(self, block_ids: list[int]) -> None:
        self._free.extend(reversed(block_ids))

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return (x.float() * scale).to(x.dtype) * self.weight


def _rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of `x` [n, heads, head_dim] at `positions` [n]."""
    half = x.shape[-1] // 2
    freqs = 10000.0 ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None] * freqs[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def attention_mask(
    n: int, ctx: int, device: torch.device, window: int | None = None
) -> torch.Tensor | None:
    """Which of `ctx` consecutive key positions (the last `n` are the queries' own) each
    query sees: every earlier one, or with `window` only the `window - 1` before it. None
    when a single query sees every key (a decode step)."""
    if window is None:
        return None if n == 1 else torch.ones(n, ctx, dtype=torch.bool, device=device).tril(ctx - n)
    query = torch.arange(ctx - n, ctx, device=device)[:, None]
    key = torch.arange(ctx, device=device)[None, :]
    return (key <= query) & (key > query - window)


class AttentionLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden
        self.heads, self.head_dim = config.heads, config.head_dim
        self.attn_norm = RMSNorm(h)
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.out = nn.Linear(h, h, bias=False)
        self.mlp_norm = RMSNorm(h)
        self.gate_up = nn.Linear(h, 2 * 2 * h, bias=False)
        self.down = nn.Linear(2 * h, h, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        write_rows: torch.Tensor,
        read_rows: torch.Tensor,
        window: int | None = None,
        blank: int = 0,
    ) -> torch.Tensor:
        """`read_rows`: the cache rows of consecutive positions ending at the last
        query's; with `window` (a sliding-window layer) they may start anywhere at or
        before the first query's window, and only the window is attended to. The first
        `blank` rows are outside every query's window and may hold anything (NaN):
        they are read as zeros."""
        n = x.shape[0]
        q, k, v = self.qkv(self.attn_norm(x)).view(n, 3, self.heads, self.head_dim).unbind(1)
        q, k = _rotate(q, positions), _rotate(k, positions)
        flat_k = k_cache.view(-1, self.heads, self.head_dim)
        flat_v = v_cache.view(-1, self.heads, self.head_dim)
        flat_k.index_copy_(0, write_rows, k)
        flat_v.index_copy_(0, write_rows, v)
        keys = flat_k.index_select(0, read_rows)
        values = flat_v.index_select(0, read_rows)
        if blank:  # masked anyway, but 0 * NaN would still reach the output
            keys[:blank] = 0
            values[:blank] = 0
        keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # [heads, ctx, dim]
        # query i sits at position ctx - n + i and sees positions <= its own
        mask = attention_mask(n, read_rows.shape[0], x.device, window)
        attn = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask)
        x = x + self.out(attn.transpose(0, 1).reshape(n, -1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        out: torch.Tensor = x + self.down(F.silu(gate) * up)
        return out


KEEP_INIT = ("norm.weight", "decay_bias")
"""Parameters whose constructor value is kept (norm scales; a recurrence's decays)."""


def init_weights(model: nn.Module, gen: torch.Generator) -> None:
    """Seeded random weights, scaled by fan-in, with peaked logits (std ~3) so greedy
    choices are far from ties; a model's `lm_head` and `layers` as TinyDecoder has them."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(KEEP_INIT):
                continue
            fan_in = param.shape[-1] if name.startswith(("layers", "lm_head")) else 1
            noise = torch.randn(param.shape, generator=gen, device=param.device)
            param.copy_(noise.div_(math.sqrt(fan_in)))
        lm_head = model.get_submodule("lm_head")
        assert isinstance(lm_head, nn.Linear)
        lm_head.weight.mul_(3.0)


class TinyDecoder(nn.Module):
    """The demo model. `forward(tokens, start, block_table, kv)` runs the tokens at
    positions `start, start+1, ...` of a sequence whose earlier positions are already
    in `kv` (through `block_table`), and returns the logits of the last token."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.config = config
        dev = torch.device(device)
        # on CUDA the weights are made there (a 1B model's float32 copy on the host
        # would cost seconds); on the CPU the same seed gives the same weights as ever
        gen = torch.Generator(device=dev).manual_seed(config.seed)
        h = config.hidden
        with dev:
            self.embed = nn.Embedding(config.vocab, h)
            self.layers = nn.ModuleList(AttentionLayer(config) for _ in range(config.layers))
            self.norm = RMSNorm(h)
            self.lm_head = nn.Linear(h, config.vocab, bias=False)
        init_weights(self, gen)
        self.to(device=dev, dtype=config.torch_dtype)
        self.eval()

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @torch.inference_mode()
    def forward(
        self, tokens: list[int], start: int, block_table: list[int], kv: PagedKVCache
    ) -> torch.Tensor:
        dev = self.device
        n = len(tokens)
        bt = kv.block_tokens
        end = start + n
        if end > len(block_table) * bt:
            raise ValueError(f"{end} positions do not fit {len(block_table)} blocks of {bt}")
        positions = torch.arange(start, end, device=dev)
        table = torch.tensor(block_table, dtype=torch.long, device=dev)
        every = torch.arange(end, device=dev)
        read_rows = table[every // bt] * bt + every % bt
        write_rows = read_rows[start:]
        x = self.embed(torch.tensor(tokens, dtype=torch.long, device=dev))
        for layer, k_cache, v_cache in zip(self.layers, kv.k, kv.v):
            x = layer(x, positions, k_cache, v_cache, write_rows, read_rows)
        logits: torch.Tensor = self.lm_head(self.norm(x[-1:]))[0].float()
        return logits
