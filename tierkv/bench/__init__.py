"""`tierkv bench`: how fast tierkv moves blocks through each tier of a chain, as a
ratio to the raw medium measured in the same run, and what the orchestrator costs.

For each medium of the chain (the primary `cpu`, then every secondary tier on its
own, behind a primary of its own):

- tierkv: `--concurrency` `TieredCache.store` calls of `--batch` blocks in flight
  until `total` bytes are stored, then `flush()` (for a secondary tier: until every
  block reached it); then the primary is emptied and the same blocks are loaded back
  the same way (for a secondary tier: every block is promoted from it). The cache is
  opened fresh for every repetition; the tier's section of the chain is used as
  written, except `write_policy: write_through` and a `max_inflight_bytes` large
  enough that nothing is dropped.
- raw: the same bytes in the same batches through the medium's plain client with the
  tier's own concurrency (`io_concurrency`, `max_connections`, `max_concurrency`):
  torch `copy_` for the primary, `os.pwrite`/`os.pread` in a thread pool for `nvme`,
  concurrent redis-py SET/GET for `redis`, s3fs `_pipe_file`/`_cat_file` for `s3`,
  `MooncakeDistributedStore` put/get from one thread for `mooncake`.
  A tier of another type (a plugin) is measured without a ratio.

Throughput is MB/s (10^6 bytes per second); each figure is the median of the
repetitions, with the spread (min..max). Latency percentiles are per batch: for the
tierkv store to a secondary tier the tier's job latency (`stats()`), otherwise the
call as the caller sees it. Loads from disk read the disk: before each load phase
the files of both sides are dropped from the page cache (`posix_fadvise`).

The orchestrator's own cost: a primary of `--keys` tiny blocks filled to the brim,
with a `memory` tier behind it that never receives a block (selective write policy
with an unreachable hit count) so nothing but bookkeeping runs; then lookups of
resident and of unknown keys, and loads, `--lookup-batch` keys per call.

Targets (`targets.py`): the project's own bounds on the streaming ratios, the
promotion against its slower stage and the bookkeeping costs, for its developers:
`check_targets(report)` on a `--json` report says per figure whether it was met. They
are not shown to users (a user's bench reports measurements and ratios, not a
project's pass or fail).

With `--config`, a tier that keeps files is measured in a temporary directory made in
its path (its own disk), removed afterwards (`scratch`); the streaming phase runs
through the chain's nvme tier only when that tier is among the media asked for.

`tierkv bench` with no flags is a quick run (32 MiB per medium, 100,000 resident
keys: well under a minute and 1 GB on a small machine); `--full` is the run the
project's tables quote (256 MiB per medium, 1,000,000 keys).

One phase per module:

- `options`: `BenchOptions`, and the errors (`UnknownMedium`, `BenchFailure`)
- `timing`: batches driven `concurrency` at a time, their timings and medians
- `chain`: the chain rebuilt for one measurement, its keys, `empty_primary`
- `raw`, `raw_files`, `raw_remote`: the raw media (host memory; nvme's one file and
  file per block; redis, s3)
- `medium`: one medium of the chain against its raw baseline
- `streaming`: one request much larger than the primary, through nvme
- `orchestrator`, `bookkeeping`: the cache's own cost, with no I/O and no copies
- `integrity`: framing with and without a MAC
- `targets`: the project's bounds; `summary`: the report for the terminal
- `run`: `run_bench`, every phase in one report
- `scratch`: `tierkv bench --config`'s temporary directories under the tiers' paths
- `tier_scripts`: helpers for a tier package's own `bench_*.py`
"""

from tierkv.bench.chain import BLOCK_TOKENS, empty_primary
from tierkv.bench.integrity import bench_integrity, integrity_summary
from tierkv.bench.medium import RAW_BASELINES, raw_baseline_for
from tierkv.bench.options import BenchFailure, BenchOptions, UnknownMedium
from tierkv.bench.orchestrator import bench_orchestrator
from tierkv.bench.raw import RawMedium, RawMemcpy
from tierkv.bench.raw_files import RawBlockFiles, RawFile
from tierkv.bench.raw_remote import RawMooncake, RawRedis, RawS3
from tierkv.bench.run import run_bench
from tierkv.bench.streaming import bench_streaming
from tierkv.bench.summary import bench_summary
from tierkv.bench.targets import TARGETS, Target, check_targets
from tierkv.bench.tier_scripts import TierJobBench, best_of, timed
from tierkv.bench.timing import Batch

__all__ = [
    "BLOCK_TOKENS",
    "RAW_BASELINES",
    "TARGETS",
    "Batch",
    "BenchFailure",
    "BenchOptions",
    "RawBlockFiles",
    "RawFile",
    "RawMedium",
    "RawMemcpy",
    "RawMooncake",
    "RawRedis",
    "RawS3",
    "Target",
    "TierJobBench",
    "UnknownMedium",
    "bench_integrity",
    "bench_orchestrator",
    "bench_streaming",
    "bench_summary",
    "best_of",
    "check_targets",
    "empty_primary",
    "integrity_summary",
    "raw_baseline_for",
    "run_bench",
    "timed",
]
