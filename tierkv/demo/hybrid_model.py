"""The hybrid demo model: full-attention layers mixed with sliding-window attention
layers or with gated-recurrence layers, for `tierkv demo --hybrid`.

Hybrid models are where KV caches go wrong: a restored sliding-window block from the
wrong place, or a recurrent state from the wrong boundary, gives plausible but wrong
tokens. This model makes each kind its own KV-cache group, as a serving engine does:

- group 0: the full-attention layers, a paged KV cache and block table (`model.py`);
- group 1, `window`: the sliding-window layers, their own paged KV cache and block
  table; a token attends only to itself and the `window - 1` tokens before it, and
  the pass uses nothing before that (so blocks outside the window need not exist: the
  rows before the first query's window are read as zeros, masked anyway). The keys'
  span starts at position 0 whether or not a cache served a prefix, as full attention's
  does: in bfloat16 the kernels' rounding depends on the span, and one starting at the
  window after a hit made the 20-layer demo's greedy tokens diverge from the uncached
  run's (on an H200 and on the CPU, in the GPU prefix cache column too: the model, not
  the cache);
- group 1, `state`: the recurrent layers, one state per block boundary in a
  `StateCache` (`recurrent.py`); the pass starts from the state at its first position
  (the boundary's slot, or the request's running state between boundaries).

Layers alternate, full first: 4 layers are full, other, full, other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from tierkv.demo.model import (
    AttentionLayer,
    ModelConfig,
    PagedKVCache,
    RMSNorm,
    init_weights,
)
from tierkv.demo.recurrent import STATE_DTYPE, GatedRecurrence, StateCache

HybridKind = Literal["window", "state"]
HYBRID_KINDS: tuple[HybridKind, ...] = ("window", "state")


@dataclass(frozen=True)
class HybridConfig:
    """Which other layer kind joins full attention; `window` in tokens (window kind);
    `checkpoint_every` in tokens: where stored requests' hits may land, so stores keep
    only the window blocks and states a hit there needs (`tierkv.retention`; None:
    every block boundary, nothing skipped)."""

    kind: HybridKind
    window: int | None = None
    checkpoint_every: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in HYBRID_KINDS:
            raise ValueError(f"hybrid kind {self.kind!r} is not one of {', '.join(HYBRID_KINDS)}")
        if self.kind == "window" and (self.window is None or self.window < 2):
            raise ValueError(f"a sliding window needs at least 2 tokens, got {self.window}")
        if self.kind != "window" and self.window is not None:
            raise ValueError(f"a {self.kind} hybrid takes no window")

    def layer_kinds(self, layers: int) -> list[str]:
        """`full` or the other kind per layer: alternating, full first."""
        return ["full" if i % 2 == 0 else self.kind for i in range(layers)]

    def fingerprint(self) -> str:
        """What decides the cached values besides the model config."""
        return f"hybrid-{self.kind}" + (f"{self.window}" if self.window else "")


@dataclass
class HybridCaches:
    """The model's caches: group 0's KV, group 1's KV (window) or states (state).
    `state_tokens`: tokens between two cached states (the offloaded block size)."""

    full: PagedKVCache
    other: PagedKVCache | StateCache
    state_tokens: int


def _rows(
    table: Sequence[int], first: int, end: int, block_tokens: int, dev: torch.device
) -> torch.Tensor:
    """Cache rows of positions `[first, end)` through a block table."""
    ids = torch.tensor(table, dtype=torch.long, device=dev)
    every = torch.arange(first, end, device=dev)
    rows: torch.Tensor = ids[every // block_tokens] * block_tokens + every % block_tokens
    return rows


class HybridDecoder(nn.Module):
    """`forward(tokens, start, tables, caches, running)`: the tokens at positions
    `start, ...` of a sequence whose earlier positions are in the caches, through
    `tables[0]` (group 0's KV blocks) and `tables[1]` (group 1's KV blocks, or its state
    slots per block boundary); `running` is the request's running state (state kind).
    Returns the logits of the last token."""

    def __init__(
        self, config: ModelConfig, hybrid: HybridConfig, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        if config.layers < 2:
            raise ValueError(f"a hybrid model needs at least 2 layers, got {config.layers}")
        self.config = config
        self.hybrid = hybrid
        self.kinds = hybrid.layer_kinds(config.layers)
        dev = torch.device(device)
        gen = torch.Generator(device=dev).manual_seed(config.seed)
        h = config.hidden
        with dev:
            self.embed = nn.Embedding(config.vocab, h)
            self.layers = nn.ModuleList(
                GatedRecurrence(config) if kind == "state" else AttentionLayer(config)
                for kind in self.kinds
            )
            self.norm = RMSNorm(h)
            self.lm_head = nn.Linear(h, config.vocab, bias=False)
        init_weights(self, gen)
        self.to(device=dev, dtype=config.torch_dtype)
        for layer in self.layers:  # the decays stay float32, as the states do
            if isinstance(layer, GatedRecurrence):
                layer.decay_bias.data = layer.decay_bias.data.to(STATE_DTYPE)
        self.eval()

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def layers_per_group(self) -> tuple[int, int]:
        full = self.kinds.count("full")
        return full, len(self.kinds) - full

    def caches(
        self, num_blocks: int, block_tokens: int, factor: int, device: torch.device
    ) -> HybridCaches:
        """Caches for `num_blocks` KV blocks of `block_tokens` per group; the state kind
        gets one state slot per `factor` KV blocks (one per offloaded block)."""
        full, other = self.layers_per_group
        kv = PagedKVCache(self.config, num_blocks, block_tokens, device, layers=full)
        second: PagedKVCache | StateCache
        if self.hybrid.kind == "state":
            second = StateCache(self.config.hidden, other, num_blocks // factor, factor, device)
        else:
            second = PagedKVCache(self.config, num_blocks, block_tokens, device, layers=other)
        return HybridCaches(kv, second, block_tokens * factor)

    @torch.inference_mode()
    def forward(
        self,
        tokens: list[int],
        start: int,
        tables: Sequence[Sequence[int]],
        caches: HybridCaches,
        running: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        dev = self.device
        n = len(tokens)
        end = start + n
        bt = caches.full.block_tokens
        if end > len(tables[0]) * bt:
            raise ValueError(f"{end} positions do not fit {len(tables[0])} blocks of {bt}")
        positions = torch.arange(start, end, device=dev)
        full_read = _rows(tables[0], 0, end, bt, dev)
        full_write = full_read[start:]
        window = self.hybrid.window
        other = caches.other
        if isinstance(other, PagedKVCache):
            win_read, win_write, blank = self._window_rows(tables[1], start, end, bt)
        else:
            begin, writes = _state_steps(tables[1], start, n, caches.state_tokens, other, running)
        x = self.embed(torch.tensor(tokens, dtype=torch.long, device=dev))
        g0 = g1 = 0
        for layer, kind in zip(self.layers, self.kinds):
            if kind == "full":
                k, v = caches.full.k[g0], caches.full.v[g0]
                x = layer(x, positions, k, v, full_write, full_read)
                g0 += 1
            elif isinstance(other, PagedKVCache):
                k, v = other.k[g1], other.v[g1]
                x = layer(x, positions, k, v, win_write, win_read, window=window, blank=blank)
                g1 += 1
            else:
                assert running is not None
                x, running[g1] = layer(x, begin[g1], other.states[g1], writes)
                g1 += 1
        logits: torch.Tensor = self.lm_head(self.norm(x[-1:]))[0].float()
        return logits

    def _window_rows(
        self, table: Sequence[int], start: int, end: int, bt: int
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The window group's cache rows a pass over `[start, end)` reads and writes,
        and how many leading rows of the read are outside every query's window."""
        window = self.hybrid.window
        assert window is not None
        if end > len(table) * bt:
            raise ValueError(f"{end} positions do not fit {len(table)} window blocks")
        # the keys' span starts at position 0, as in a pass without a cache, so the
        # attention kernels see the same shapes and round alike with and without
        # one (see the module doc); rows before the first query's window are outside
        # every query's window and read as zeros (their blocks may not exist)
        read = _rows(table, 0, end, bt, self.device)
        return read, read[start:], max(0, start - (window - 1))


def _state_steps(
    table: Sequence[int],
    start: int,
    n: int,
    state_tokens: int,
    cache: StateCache,
    running: list[torch.Tensor] | None,
) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """For a pass of `n` tokens from `start` through the state group's slots `table`:
    the state each recurrent layer starts from (zeros at position 0, the cached state
    at a block boundary, else the request's `running` state), and the `(token, slot)`
    pairs where a block boundary's state is written."""
    if running is None:
        raise ValueError("a recurrent model needs the request's running state")
    st = state_tokens
    end = start + n
    if end // st > len(table):
        raise ValueError(f"{end} positions need {end // st} state slots")
    if start == 0:
        begin = [torch.zeros_like(r) for r in running]
    elif start % st == 0:  # at a boundary: the cached state (restored or not)
        begin = [s[table[start // st - 1]] for s in cache.states]
    else:
        begin = list(running)
    writes = [(i, table[(start + i + 1) // st - 1]) for i in range(n) if (start + i + 1) % st == 0]
    return begin, writes
