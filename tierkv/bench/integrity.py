"""`tierkv bench`'s integrity section: what an authenticated frame (`mac_key_env`)
costs next to the checksum-only frame, per block of the bench's size.

For each way of framing, the time to frame a block (`Framer.encode`: header, checksum,
MAC, one copy) and to check it back into a slot (`Framer.decode_into`), best of a few
rounds over the same random blocks, one thread. The ratio is MAC / checksum-only
(encode + decode): 1.0 would be free. Keyed BLAKE2b (hashlib) is timed beside keyed
BLAKE3 over the same bytes, the measurement `tierkv.contract.mac` chose BLAKE3 by.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from tierkv.contract.framing import Framer
from tierkv.contract.keys import make_offload_key
from tierkv.contract.mac import MacKey

_ROUNDS = 5


def _best_per_call(fn: Callable[[], object], calls: int) -> float:
    """Seconds per call of `fn`, the best of _ROUNDS rounds of `calls` calls."""
    best = float("inf")
    for _ in range(_ROUNDS):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def bench_integrity(block_bytes: int, blocks: int = 8) -> dict[str, Any]:
    """Seconds per block to frame and to check, with and without a MAC, and the ratio."""
    blocks = max(1, blocks)
    payloads = [os.urandom(block_bytes) for _ in range(blocks)]
    keys = [make_offload_key(os.urandom(16), 0) for _ in range(blocks)]
    dest = memoryview(bytearray(block_bytes))
    secret = os.urandom(32)
    result: dict[str, Any] = {"block_bytes": block_bytes}
    for name, framer in (
        ("checksum", Framer("bench")),
        ("mac", Framer("bench", MacKey(secret))),
    ):
        frames = [framer.encode(k, p) for k, p in zip(keys, payloads)]
        turn = itertools.count()

        def encode(f: Framer = framer, t: Iterator[int] = turn) -> None:
            i = next(t) % blocks
            f.encode(keys[i], payloads[i])

        def decode(f: Framer = framer, fr: list[bytes] = frames, t: Iterator[int] = turn) -> None:
            i = next(t) % blocks
            f.decode_into(keys[i], fr[i], dest)

        result[f"{name}_encode_s"] = _best_per_call(encode, blocks)
        result[f"{name}_decode_s"] = _best_per_call(decode, blocks)
    plain = result["checksum_encode_s"] + result["checksum_decode_s"]
    result["mac_ratio"] = (result["mac_encode_s"] + result["mac_decode_s"]) / plain
    b3_key = os.urandom(32)
    result["blake3_GBps"] = (
        block_bytes / _best_per_call(lambda: MacKey(b3_key + b3_key).tag(payloads[0]), blocks) / 1e9
    )
    result["blake2b_GBps"] = (
        block_bytes
        / _best_per_call(
            lambda: hashlib.blake2b(payloads[0], key=b3_key, digest_size=32).digest(), blocks
        )
        / 1e9
    )
    return result


def integrity_summary(report: dict[str, Any]) -> list[str]:
    """Lines for the terminal."""
    ms = 1e3
    return [
        f"integrity, per {report['block_bytes'] >> 10} KiB block (one thread): "
        f"checksum-only frame {report['checksum_encode_s'] * ms:.3f} ms to write, "
        f"{report['checksum_decode_s'] * ms:.3f} ms to check; with MAC "
        f"{report['mac_encode_s'] * ms:.3f} / {report['mac_decode_s'] * ms:.3f} ms: "
        f"MAC costs {report['mac_ratio']:.2f}x checksum-only "
        f"(keyed BLAKE3 {report['blake3_GBps']:.1f} GB/s, "
        f"keyed BLAKE2b {report['blake2b_GBps']:.1f} GB/s)",
    ]
