"""The nvme core's own hashes against the packages the Python path uses, on one core:
the frame checksum (`_xxh3.c`, xxh3_64, on each stripe-loop width the CPU has) against
`xxhash.xxh3_64_intdigest`, and the frame MAC (`_blake3.c`, keyed BLAKE3, on each lane
count) against `blake3.blake3(key=...)`.

    .venv/bin/python benchmarks/nvme_hashes.py [--sizes-kib 16,64,1024] [--rounds 3] \
        [--buffer-mib 64]

Prints GB/s (10^9 bytes/s) per size, best of --rounds, each round hashing ~256 MiB
from a --buffer-mib buffer (64: the inputs come from memory, as a stored block's do;
2: from the caches, as a block just read does), and the core's ratio to the package.
Both sides are called the same way from Python (a lambda and the call: a few hundred
nanoseconds, which shows at 16 KiB).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import blake3
import xxhash
from tierkv_nvme import native

ROUND_BYTES = 256 << 20


def speed(hash_one: Callable[[memoryview], object], size: int, rounds: int, buffer: int) -> float:
    """Best GB/s of `rounds` rounds of hashing ROUND_BYTES in `size` pieces of a
    `buffer`-byte buffer."""
    data = memoryview(os.urandom(max(buffer, size)))
    pieces = [data[at : at + size] for at in range(0, len(data) - size + 1, size)]
    calls = max(1, ROUND_BYTES // size)
    best = 0.0
    for _ in range(rounds):
        started = time.perf_counter()
        for i in range(calls):
            hash_one(pieces[i % len(pieces)])
        best = max(best, calls * size / (time.perf_counter() - started) / 1e9)
    return best


def main(args: argparse.Namespace) -> None:
    core = native._core
    if core is None:
        raise SystemExit(native.reason)
    key = os.urandom(32)
    widths = [b for b in (512, 256, 128, 64) if b <= core.XXH3_VECTOR_BITS]
    lanes = [n for n in (16, 8, 1) if n <= core.BLAKE3_LANES]
    print(f"one core; xxh3 widths {widths} (CPU: {core.XXH3_VECTOR_BITS}), blake3 lanes {lanes}")
    print(f"inputs from a {args.buffer_mib} MiB buffer")
    print("size    hash     implementation       GB/s  core/package")
    buffer = args.buffer_mib << 20
    for size in (int(k) << 10 for k in args.sizes_kib.split(",")):
        label = f"{size >> 10}K"
        package = speed(lambda p: xxhash.xxh3_64_intdigest(p), size, args.rounds, buffer)
        print(f"{label:>6}  xxh3_64  xxhash package  {package:9.1f}")
        for bits in widths:
            got = speed(lambda p, b=bits: core.xxh3_64((p,), b), size, args.rounds, buffer)
            print(f"{label:>6}  xxh3_64  core, {bits:3d}-bit   {got:9.1f}  {got / package:12.2f}")
        package = speed(lambda p: blake3.blake3(p, key=key).digest(), size, args.rounds, buffer)
        print(f"{label:>6}  blake3   blake3 package  {package:9.1f}")
        for n in lanes:
            got = speed(lambda p, n=n: core.keyed_hash(key, (p,), n), size, args.rounds, buffer)
            print(f"{label:>6}  blake3   core, {n:2d} lanes   {got:9.1f}  {got / package:12.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-kib", default="16,64,1024")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--buffer-mib", type=int, default=64)
    main(parser.parse_args())
