"""`tierkv.gpu.bench`: the worker's throughput next to a raw copy, per backend, and
`tierkv bench --gpu`, which on a machine without CUDA says so and exits 0."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tierkv.cli import main
from tierkv.gpu.bench import benchmark, format_gpu_report, gpu_report, plan_cost


@pytest.mark.parametrize("copy_backend", ["kernel", "dma"])
def test_benchmark_reports_throughput_against_a_raw_copy(copy_backend: Any) -> None:
    threads = torch.get_num_threads()
    report = benchmark(1 << 20, page_bytes=4096, num_layers=4, repeats=1, copy_backend=copy_backend)
    assert torch.get_num_threads() == threads
    assert report["bytes"] == 1 << 20 and report["copy_backend"] == copy_backend
    for key in ("store_GBps", "load_GBps", "raw_store_GBps", "store_ratio", "load_ratio"):
        assert report[key] > 0


def test_plan_cost_counts_every_page() -> None:
    cost = plan_cost(num_blocks=8, num_layers=4, repeats=2)
    assert cost["pages"] == 32 and cost["plan_us"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_bench_gpu_without_cuda_says_so_and_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--gpu"]) == 0
    out = capsys.readouterr().out
    assert "no CUDA device here" in out and "DMA plan on the host" in out
    report = gpu_report(1 << 20, 1)
    assert report["cuda"] is False and "rows" not in report
    assert format_gpu_report(report).startswith("tierkv bench --gpu: no CUDA device")
