"""The nvme tier's layouts side by side (issue 51, item 2): one file per block, as the
tier writes them today and with the payload page-aligned, against slabs of fixed slots,
buffered and O_DIRECT, and rawio's plain files. Compiles nvme_layouts.c (cc, with the
core's `_xxh3.c`) into a temporary directory and runs it over a matrix, layouts
interleaved per round:

    python benchmarks/nvme_layouts.py [--media tmpfs=/dev/shm,disk=/var/tmp]
        [--sizes 16KiB,64KiB,1MiB] [--threads 1,2] [--mib 256] [--rounds 3]
        [--fsync-media disk] [--lock /tmp/tierkv-cpu.lock] [--rawio ../shared/tools/rawio.c]
        [--json results.jsonl] [--verify] [--phases write,scan] [--qd 16|1]
        [--fsync-only]

Per medium, block size and thread count: write (new files / fresh slab extents),
rewrite (every block again under a new key, as a full tier's store that evicts: a new
file and the old one unlinked; a slot overwritten in place), and on a disk
rewrite+flush (the rewrite and a syncfs after it, over their summed time), read (warm
page cache) and cold (after syncfs and posix_fadvise(DONTNEED) of every file or slab);
then scan, what `open`'s index rebuild reads (cold the same way): every file's header,
length and key, or every slot's header (wall us per block in the table);
with `--fsync-media`, write and rewrite again with every block made durable (`fsync:
always`: fdatasync per file, RWF_DSYNC per slot). Each cell is the range over the
rounds: GB/s of payload, then the process's CPU us per block (user + system; the
kernel's writeback threads are not in it). The `rawio.c` column is the reference tool
itself (open + pwrite|pread + close, no frame; its rewrite truncates the same files),
run beside when `--rawio` names it. Every file is created under a fresh directory below
each medium's path and removed at the end of each run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
LAYOUTS = ("files", "files-pad", "files-trail", "slab", "slab-direct", "raw")
UNITS = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "": 1}


def parse_size(text: str) -> int:
    text = text.strip().upper()
    for unit in ("KIB", "MIB", "GIB", ""):
        if text.endswith(unit) and text[: len(text) - len(unit)].isdigit():
            return int(text[: len(text) - len(unit)]) * UNITS[unit]
    raise argparse.ArgumentTypeError(f"not a size: {text}")


def size_name(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


def fs_type(path: str) -> str:
    """The filesystem type of the mount holding `path` (longest /proc/mounts prefix)."""
    real, best, kind = os.path.realpath(path), "", "?"
    with open("/proc/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            point = fields[1]
            inside = real == point or real.startswith(point.rstrip("/") + "/")
            if inside and len(point) > len(best):
                best, kind = point, fields[2]
    return kind


def compile_tools(work: Path, rawio: str | None) -> tuple[Path, Path | None]:
    binary = work / "nvme_layouts"
    cmd = ["cc", "-O2", "-std=gnu11", "-pthread", "-o", str(binary), str(HERE / "nvme_layouts.c")]
    subprocess.run([*cmd, str(HERE.parent / "tiers/nvme/tierkv_nvme/_xxh3.c")], check=True)
    raw = None
    if rawio:
        raw = work / "rawio"
        subprocess.run(["cc", "-O2", "-pthread", "-o", str(raw), rawio], check=True)
    return binary, raw


def locked(lock: str | None, cmd: list[str]) -> list[str]:
    return ["flock", lock, *cmd] if lock else cmd


def run_layouts(
    binary: Path,
    layout: str,
    base: str,
    size: int,
    blocks: int,
    threads: int,
    phases: str,
    fsync: bool,
    args: argparse.Namespace,
) -> list[dict]:
    run_dir = tempfile.mkdtemp(prefix="tierkv-layouts-", dir=base)
    os.rmdir(run_dir)  # the tool creates it (and removes it with everything in it)
    cmd = [str(binary), layout, run_dir, str(size), str(blocks), str(threads), phases]
    cmd += ["--fsync"] if fsync else []
    cmd += ["--verify"] if args.verify else []
    cmd += ["--qd", str(args.qd)]
    try:
        out = subprocess.run(locked(args.lock, cmd), capture_output=True, text=True)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr}{out.stdout}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def run_rawio(
    raw: Path, base: str, size: int, blocks: int, threads: int, args: argparse.Namespace
) -> list[dict]:
    """rawio.c itself, write then read (warm), on a directory of its own."""
    run_dir = tempfile.mkdtemp(prefix="tierkv-rawio-", dir=base)
    rows = []
    try:
        for op, phase in (("write", "write"), ("write", "rewrite"), ("read", "read")):
            cmd = [str(raw), op, run_dir, str(blocks), str(size), str(threads)]
            out = subprocess.run(locked(args.lock, cmd), capture_output=True, text=True)
            if out.returncode != 0:
                sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append({**row, "layout": "rawio.c", "phase": phase, "fsync": False})
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return rows


def flushed(rows: list[dict]) -> list[dict]:
    """A rewrite+flush row per run that has both: payload over their summed time."""
    out = []
    for flush in (r for r in rows if r["phase"] == "flush"):
        same = ("layout", "block_bytes", "blocks", "threads", "fsync")
        rewrite = next(
            r for r in rows if r["phase"] == "rewrite" and all(r[k] == flush[k] for k in same)
        )
        seconds = rewrite["seconds"] + flush["seconds"]
        cpu = rewrite["cpu_us_per_block"] + flush["cpu_us_per_block"]
        gbps = flush["blocks"] * flush["block_bytes"] / seconds / 1e9
        out.append(
            {
                **flush,
                "phase": "rewrite+flush",
                "seconds": seconds,
                "GBps": gbps,
                "cpu_us_per_block": cpu,
            }
        )
    return out


def span(values: list[float], digits: int) -> str:
    lo, hi = min(values), max(values)
    if f"{lo:.{digits}f}" == f"{hi:.{digits}f}":
        return f"{lo:.{digits}f}"
    return f"{lo:.{digits}f}-{hi:.{digits}f}"


def table(results: list[dict], columns: list[str]) -> str:
    """One markdown table: a row per medium, durability, block, threads and phase; a
    cell per layout, 'GB/s (CPU us per block)' as ranges over the rounds."""
    cells: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in results:
        if r["phase"] == "flush":
            continue
        key = (r["medium"], r["fsync"], r["block_bytes"], r["threads"], r["phase"])
        cells[key][r["layout"]].append(r)
    head = ["medium", "block", "thr", "phase", *columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (medium, fsync, size, threads, phase), by_layout in cells.items():
        row = [medium, size_name(size), str(threads), phase + (" +fsync" if fsync else "")]
        for layout in columns:
            got = by_layout.get(layout)
            if not got:
                row.append("")
                continue
            gbps = span([g["GBps"] for g in got], 2)
            if phase == "scan":  # a rebuild moves no payload: wall us per block instead
                gbps = span([g["seconds"] / g["blocks"] * 1e6 for g in got], 1) + " us"
            cpu = span([g["cpu_us_per_block"] for g in got], 0)
            row.append(f"{gbps} ({cpu})")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--media",
        default="tmpfs=/dev/shm,disk=/var/tmp",
        help="name=path pairs; cold reads are measured where the filesystem is not tmpfs",
    )
    parser.add_argument("--sizes", default="16KiB,64KiB,1MiB")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--mib", type=int, default=256, help="payload per run (MiB)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--fsync-media",
        default="disk",
        help="media (names) where durable writes are measured too; '' none",
    )
    parser.add_argument(
        "--fsync-only", action="store_true", help="only the durable writes (--fsync-media)"
    )
    parser.add_argument(
        "--phases",
        default=None,
        help="instead of the default phases (write,rewrite,"
        "flush,read,cold,scan; no flush or cold on tmpfs)",
    )
    parser.add_argument(
        "--qd",
        type=int,
        default=16,
        choices=(1, 16),
        help="slab-direct: blocks in flight per thread (16: one io_submit per group; "
        "1: a plain pwritev2/preadv2 per block)",
    )
    parser.add_argument("--lock", default=None, help="flock this file around every run")
    parser.add_argument("--rawio", default=None, help="rawio.c to build and run beside")
    parser.add_argument("--json", default=None, help="append every result line here")
    parser.add_argument(
        "--verify", action="store_true", help="compare every payload read with what was written"
    )
    args = parser.parse_args()

    media = [tuple(m.split("=", 1)) for m in args.media.split(",") if m]
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    layouts = [x for x in args.layouts.split(",") if x]
    fsync_media = set(filter(None, args.fsync_media.split(",")))
    results: list[dict] = []
    sink = open(args.json, "a") if args.json else None  # noqa: SIM115

    with tempfile.TemporaryDirectory(prefix="tierkv-layouts-build-") as work:
        binary, raw = compile_tools(Path(work), args.rawio)
        for name, base in media:
            kind = fs_type(base)
            disk = kind != "tmpfs"
            print(f"# {name}: {base} ({kind}), {args.mib} MiB per run", file=sys.stderr)
            phases = "write,rewrite,flush,read,cold,scan" if disk else "write,rewrite,read,scan"
            if args.phases:
                keep = [p for p in args.phases.split(",") if disk or p not in ("flush", "cold")]
                phases = ",".join(keep)
            passes = [] if args.fsync_only else [(False, phases)]
            if name in fsync_media:
                passes.append((True, "write,rewrite"))
            for fsync, phases in passes:
                for size in sizes:
                    blocks = max(1, (args.mib << 20) // size)
                    for t in threads:
                        for rnd in range(args.rounds):
                            rows = []
                            # each round starts at another layout: none always first
                            # (on a disk, what ran before can matter: see the README)
                            turn = rnd % len(layouts)
                            for layout in layouts[turn:] + layouts[:turn]:
                                rows += run_layouts(
                                    binary, layout, base, size, blocks, t, phases, fsync, args
                                )
                            if raw and not fsync:
                                rows += run_rawio(raw, base, size, blocks, t, args)
                            rows += flushed(rows)
                            for row in rows:
                                row.update(medium=name, fs=kind, round=rnd + 1)
                                if sink:
                                    sink.write(json.dumps(row) + "\n")
                            sink and sink.flush()
                            results += rows
                            print(
                                f"  {name} {size_name(size)} {t} thr fsync={fsync} "
                                f"round {rnd + 1}: done",
                                file=sys.stderr,
                            )
    if sink:
        sink.close()
    columns = layouts + (["rawio.c"] if raw else [])
    print(table(results, columns))


if __name__ == "__main__":
    main()
