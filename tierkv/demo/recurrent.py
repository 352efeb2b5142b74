"""The recurrent half of the hybrid demo model: a gated linear recurrence and the cache
of its states, the demo's stand-in for Mamba / linear-attention layers.

Per channel, `h_t = a_t * h_{t-1} + (1 - a_t) * u_t`, with the decay `a_t` and the input
`u_t` computed from token `t` alone. What a later token needs of everything before it
is `h`, one vector per layer, whatever the prefix length: that is what a `state` group
caches (`tierkv.layout`). Block `j` of the group is the state after tokens
`[0, (j + 1) * block_tokens)`, so restoring block `L // block_tokens - 1` lets the model
continue at `L` exactly as if it had computed the prefix.

The decays start from a per-channel bias spread between fast and very slow (`a` up to
~0.998): some channels remember hundreds of tokens, so a state restored from the wrong
boundary changes the logits visibly rather than fading out.

The recurrence runs token by token, elementwise: the same operations in the same order
whichever part of a sequence one forward pass covers, so a state computed in one pass
and restored into another continues bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tierkv.demo.model import ModelConfig, RMSNorm

STATE_DTYPE = torch.float32
"""States are kept in float32 whatever the model's dtype (as Mamba kernels keep them):
a bfloat16 state would lose the slow channels' memory within a few hundred steps."""


class StateCache:
    """Per recurrent layer, `num_slots` states of `hidden` float32 values. A request's
    state table maps block boundary `j` to a slot.

    `layers()` is what the transfer worker copies: each layer's tensor seen as
    `num_slots * factor` "GPU blocks" of `hidden / factor` values, so one slot is the
    `factor` GPU blocks of one offloaded block, as a chunk of KV blocks is."""

    def __init__(
        self, hidden: int, layers: int, num_slots: int, factor: int, device: torch.device
    ) -> None:
        if hidden % factor:
            raise ValueError(
                f"a state of {hidden} values does not split into {factor} GPU blocks "
                "(block_factor must divide hidden)"
            )
        if num_slots < 1:
            raise ValueError("the state cache needs at least one slot")
        self.hidden = hidden
        self.factor = factor
        self.num_slots = num_slots
        self.states = [
            torch.zeros(num_slots, hidden, dtype=STATE_DTYPE, device=device) for _ in range(layers)
        ]

    def layers(self) -> list[torch.Tensor]:
        """The per-layer tensors as the transfer worker takes them (block index first)."""
        return [
            s.view(self.num_slots * self.factor, self.hidden // self.factor) for s in self.states
        ]

    def running(self) -> list[torch.Tensor]:
        """A request's own running state per layer (where it is between boundaries)."""
        first = self.states[0] if self.states else None
        device = first.device if first is not None else None
        return [torch.zeros(self.hidden, dtype=STATE_DTYPE, device=device) for _ in self.states]


class GatedRecurrence(nn.Module):
    """A pre-norm block: the gated recurrence (output gated by SiLU, then projected),
    then the same SiLU-gated MLP as the attention layers."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden
        self.mix_norm = RMSNorm(h)
        self.proj = nn.Linear(h, 3 * h, bias=False)  # decay, input, output gate
        # sigmoid(1..6): a from 0.73 (forgets in a few tokens) to 0.998 (hundreds)
        self.decay_bias = nn.Parameter(torch.linspace(1.0, 6.0, h))
        self.out = nn.Linear(h, h, bias=False)
        self.mlp_norm = RMSNorm(h)
        self.gate_up = nn.Linear(h, 2 * 2 * h, bias=False)
        self.down = nn.Linear(2 * h, h, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        h: torch.Tensor,
        states: torch.Tensor,
        writes: Sequence[tuple[int, int]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the tokens of `x` [n, hidden] from state `h`; after token `i` of each
        `(i, slot)` in `writes` (a block boundary) the state goes into `states[slot]`.
        Returns the layer's output and the state after the last token."""
        n = x.shape[0]
        decay, inp, gate = self.proj(self.mix_norm(x)).chunk(3, dim=-1)
        a = torch.sigmoid(decay.to(STATE_DTYPE) + self.decay_bias.to(STATE_DTYPE))
        u = (1 - a) * inp.to(STATE_DTYPE)
        out = torch.empty(n, h.shape[0], dtype=STATE_DTYPE, device=x.device)
        at = dict(writes)
        for i in range(n):
            h = torch.addcmul(u[i], a[i], h)
            out[i] = h
            slot = at.get(i)
            if slot is not None:
                states[slot].copy_(h)
        mixed = (out * F.silu(gate.to(STATE_DTYPE))).to(x.dtype)
        x = x + self.out(mixed)
        g, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        result: torch.Tensor = x + self.down(F.silu(g) * up)
        return result, h
