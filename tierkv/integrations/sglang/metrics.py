"""What SGLang's `--enable-storage-metrics` reads from a storage backend: per get and
set call, the pages moved and the GB/s (its `StorageMetrics`), gathered from SGLang's
threads and taken by `get_stats`."""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any

FIELDS = ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth")


@functools.lru_cache(maxsize=1)
def _storage_metrics() -> Any:
    """SGLang's `StorageMetrics` class, or None where its module does not import (it
    reaches torchvision on a CPU install); looked up once."""
    try:
        from sglang.srt.observability.metrics_collector import StorageMetrics
    except Exception:
        return None
    return StorageMetrics


@dataclass
class Gathered:
    """`StorageMetrics`' fields (what `get_stats` returns where SGLang's class does
    not import)."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)


class CallMetrics:
    """Pages and GB/s per call, from any thread, until taken."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gathered = Gathered()

    def record(self, kind: str, pages: int, nbytes: int, elapsed: float) -> None:
        bandwidth = nbytes / 1e9 / elapsed if elapsed > 0 else 0.0
        with self._lock:
            if kind == "load":
                self._gathered.prefetch_pgs.append(pages)
                self._gathered.prefetch_bandwidth.append(bandwidth)
            else:
                self._gathered.backup_pgs.append(pages)
                self._gathered.backup_bandwidth.append(bandwidth)

    def take(self) -> Any:
        """SGLang's `StorageMetrics` since the last call."""
        with self._lock:
            taken, self._gathered = self._gathered, Gathered()
        factory = _storage_metrics()
        if factory is None:
            return taken
        metrics = factory()
        for name in FIELDS:
            getattr(metrics, name).extend(getattr(taken, name))
        return metrics
