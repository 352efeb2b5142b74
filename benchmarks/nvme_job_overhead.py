"""Where one nvme tier job's time goes: the tier's `store`/`load` of a job beside the
compiled core's batch call on the same blocks, interleaved job by job in one process,
so the machine's noise hits both alike.

    .venv/bin/python benchmarks/nvme_job_overhead.py [--block-kib 16] [--batch 128]

Per job of --batch blocks, one job at a time, tmpfs (--path, default /dev/shm), the
tier's chunk set to the whole job (one core call a job, as the direct call makes):

- `tier`: `NvmeTier.store` / `.load` of the job (event loop, runner, bookkeeping,
  one worker-thread hand-off, the core call);
- `in core`: the time inside the tier's worker-thread call (`_write_files` /
  `_read_files`: the core's batch call and its directory handle);
- `direct`: the core's batch call on other keys of the same size, handed to a worker
  thread the same way (`in_thread`), with nothing of the tier around it;
- `hand-off`: a worker-thread call that does nothing, alone.

`tier - in core` is what the tier adds around the core; `direct - in core` about one
hand-off.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
from tierkv_nvme import NvmeTier, NvmeTierConfig, native

from tierkv.contract.jobs import JobMetadata
from tierkv.contract.runner import in_thread
from tierkv.primary import PrimaryTier
from tierkv.testing import random_keys


def timed(into: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - started)

    return call


async def measure(args: argparse.Namespace) -> None:
    block, batch = args.block_kib << 10, args.batch
    jobs = args.jobs
    primary = PrimaryTier(batch, block, pin_memory=False, namespace="nvme-job-overhead")
    primary.view._bytes[:] = os.urandom(256) * (primary.view.num_blocks * block // 256)
    path = Path(args.path) / "tierkv-nvme-job-overhead"
    shutil.rmtree(path, ignore_errors=True)
    n = 2 * jobs * batch
    config = NvmeTierConfig(
        type="nvme", path=path, capacity=4 * n * block, io_engine="native", fsync="never"
    )
    tier = NvmeTier(config, primary.view)
    await tier.open()
    try:
        if not tier.describe().get("batch_calls"):
            raise SystemExit(f"the core's batch calls are not in use: {tier.describe()}")
        tier.chunk_size = lambda pairs, verb: pairs  # type: ignore[method-assign]
        inside: dict[str, list[float]] = {"store": [], "load": []}
        tier._write_files = timed(inside["store"], tier._write_files)  # type: ignore[method-assign]
        tier._read_files = timed(inside["load"], tier._read_files)  # type: ignore[method-assign]
        keys = random_keys(n)
        slots = list(range(batch))
        threads = native.default_threads(batch)
        spent = {(verb, way): 0.0 for verb in ("store", "load") for way in ("tier", "direct")}
        ids = iter(range(1, 10**9))
        for verb in ("store", "load"):
            for j in range(2 * jobs):
                ks = keys[j * batch : (j + 1) * batch]
                started = time.perf_counter()
                if j % 2 == 0:
                    job = JobMetadata(next(ids), tuple(ks), tuple(slots))
                    result = await (tier.store(job) if verb == "store" else tier.load(job))
                    assert result.ok, result.error
                    spent[verb, "tier"] += time.perf_counter() - started
                    continue
                if verb == "store":
                    call = functools.partial(
                        native.write_batch, tier._root_fd, ks, slots, primary.view,
                        tier._lanes, tier.framer, fsync=False, threads=threads,
                    )  # fmt: skip
                else:
                    call = functools.partial(
                        native.read_batch, tier._root_fd, ks, slots, primary.view,
                        tier._lanes, None, tier.framer, threads=threads,
                    )  # fmt: skip
                outcomes = await in_thread(call)
                assert not any(outcomes), outcomes
                spent[verb, "direct"] += time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(200):
            await in_thread(lambda: None)
        hand_off = (time.perf_counter() - started) / 200
    finally:
        await tier.close()
        shutil.rmtree(path, ignore_errors=True)
    print(
        f"{args.block_kib} KiB blocks, jobs of {batch}, {jobs} each way, under {args.path}; "
        f"ms per job (hand-off alone: {hand_off * 1e3:.2f} ms)"
    )
    print("verb    tier  in core  direct  tier - in core")
    for verb in ("store", "load"):
        t = spent[verb, "tier"] / jobs * 1e3
        c = sum(inside[verb]) / jobs * 1e3
        d = spent[verb, "direct"] / jobs * 1e3
        per_block = (t - c) / batch * 1e3
        print(f"{verb:5} {t:6.2f}  {c:7.2f}  {d:6.2f}  {t - c:6.2f} ({per_block:.1f} us/block)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-kib", type=int, default=16)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--jobs", type=int, default=48, help="jobs each way, per verb")
    parser.add_argument("--path", default="/dev/shm")
    anyio.run(measure, parser.parse_args())


if __name__ == "__main__":
    main()
