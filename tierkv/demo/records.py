"""What a `tierkv demo` run is asked to do (`DemoOptions`) and what it records per
turn (`TurnRecord`), shared by the run (`run.py`) and its report (`run_report.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tierkv.demo.hybrid_model import HybridConfig
from tierkv.demo.model import ModelConfig
from tierkv.demo.sizing import gpu_blocks_for
from tierkv.demo.workload import WorkloadConfig

__all__ = ["DEFAULT_ATOL", "DemoOptions", "TurnRecord"]

DEFAULT_ATOL = {"float32": 1e-3, "float16": 5e-2, "bfloat16": 2e-1}
"""Largest |logit difference| accepted between a run with a cache and the run without.
The prefix KV is the same bytes either way; only the order of floating-point sums in the
prefill differs (a suffix computed against a loaded prefix vs the whole prompt)."""


@dataclass(frozen=True)
class DemoOptions:
    model: ModelConfig = field(default_factory=ModelConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    device: str = "auto"
    gpu_block_tokens: int = 16
    block_factor: int = 2
    gpu_blocks: int | None = None  # default: the longest request
    primary_capacity: int | None = None  # overrides the chain's primary capacity
    atol: float | None = None  # default: DEFAULT_ATOL[dtype]
    threaded: bool = True
    hybrid: HybridConfig | None = None  # full attention mixed with window or state layers

    def __post_init__(self) -> None:
        if self.hybrid is not None and self.model.layers < 2:
            raise ValueError(
                f"a hybrid model needs at least 2 layers (one of each kind), got "
                f"{self.model.layers}"
            )

    @property
    def tolerance(self) -> float:
        return self.atol if self.atol is not None else DEFAULT_ATOL[self.model.dtype]

    def kv_blocks(self) -> int:
        """KV blocks per engine: `gpu_blocks`, or room for the longest request, so the
        GPU prefix cache keeps the shared system prompt warm while the users, taking
        turns, evict each other's conversations (which tierkv then serves)."""
        if self.gpu_blocks is not None:
            return self.gpu_blocks
        return gpu_blocks_for(self.workload, self.gpu_block_tokens)


@dataclass
class TurnRecord:
    user: int
    index: int
    prompt_tokens: int
    ttft: dict[str, float]  # seconds, by column
    gpu_hit_blocks: dict[str, int]  # blocks the GPU prefix cache served, by column
    reused_tokens: int  # tokens tierkv's tiers served (tierkv column)
    looked_up_blocks: int  # full prompt blocks the request could reuse
    sources: dict[str, int]  # blocks loaded per medium (tierkv column)
    load_failures: int
    stored_blocks: int
    rejected_blocks: int
    tokens_match: bool
    max_logit_diff: float
    # per cached column against no cache: which one went wrong, when one did
    column_match: dict[str, bool] = field(default_factory=dict)
    column_diff: dict[str, float] = field(default_factory=dict)
    earlier_blocks: int = 0  # blocks served that this run never stored (an earlier run's)
    skipped_blocks: int = 0  # blocks a store left out: no checkpoint's hit needs them
    group_loaded: list[int] = field(default_factory=list)  # blocks loaded per KV group
    group_stored: list[int] = field(default_factory=list)  # blocks stored per KV group

    @property
    def ttft_without(self) -> float:
        return self.ttft["no_cache"]

    @property
    def ttft_with(self) -> float:
        return self.ttft["tierkv"]
