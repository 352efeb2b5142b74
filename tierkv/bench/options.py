"""What a bench run is asked for (`BenchOptions`, the CLI's flags), and the two ways
it refuses or fails."""

from __future__ import annotations

from dataclasses import dataclass

from tierkv.contract.units import format_size


@dataclass(frozen=True)
class BenchOptions:
    block_bytes: int = 1 << 20
    total_bytes: int = 256 << 20
    batch: int = 8
    concurrency: int = 8
    repeat: int = 3
    media: tuple[str, ...] | None = None  # which media to measure; None: all
    orchestrator_keys: int = 1_000_000  # 0: skip the orchestrator measurement
    lookup_batch: int = 128
    seed: int = 0
    # the streaming phase (a chain with an nvme tier): one request of `streaming_bytes`
    # (default 4 x total_bytes: 1 GiB) through a primary of `streaming_primary_bytes`
    # (default total_bytes / 4: 64 MiB); 0 skips it
    streaming_bytes: int | None = None
    streaming_primary_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_bytes", "batch", "concurrency", "repeat", "lookup_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.total_bytes < self.block_bytes:
            raise ValueError(
                f"total {format_size(self.total_bytes)} is less than one block of "
                f"{format_size(self.block_bytes)}"
            )
        if self.orchestrator_keys and self.orchestrator_keys < self.lookup_batch:
            raise ValueError(
                f"orchestrator keys ({self.orchestrator_keys}) must be 0 (skip) or at least "
                f"one lookup batch ({self.lookup_batch})"
            )

    @property
    def num_blocks(self) -> int:
        return self.total_bytes // self.block_bytes

    @property
    def streaming_blocks(self) -> int:
        total = 4 * self.total_bytes if self.streaming_bytes is None else self.streaming_bytes
        return total // self.block_bytes

    @property
    def streaming_primary_blocks(self) -> int:
        size = (
            self.total_bytes // 4
            if self.streaming_primary_bytes is None
            else self.streaming_primary_bytes
        )
        return max(4, size // self.block_bytes)


class UnknownMedium(ValueError):
    """A medium asked for is not in the chain."""


class BenchFailure(RuntimeError):
    """tierkv did not move every block (a tier failed or dropped some)."""
