"""The core's own XXH3 (`_xxh3.c`), the checksum of every frame, against the `xxhash`
package the Python path checksums with: the same 64-bit value for every length class
(0-3, 4-8, 9-16, 17-128 and 129-240 bytes, then striped: on and around the stripe and
1 KiB block boundaries, many blocks) and any split of the input into parts, on each of
the stripe loop's code paths (AVX-512, AVX2, SSE2 and portable words, as far as this
CPU has them)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

BITS = (64, 128, 256, 512)
"""What `xxh3_64` may be asked for; it uses no wider vectors than the CPU has."""


BOUNDARIES = [0, 1, 3, 4, 8, 9, 16, 17, 32, 33, 64, 65, 96, 97, 128, 129, 239, 240, 241]
LENGTHS = st.one_of(
    st.integers(0, 300),
    st.sampled_from([*BOUNDARIES, 1023, 1024, 1025, 1088, 2048, 2049, 16 * 1024 + 1]),
    st.integers(0, 20 * 1024),
)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), length=LENGTHS, cuts=st.lists(st.integers(0, 20 * 1024), max_size=5))
def test_the_checksum_is_xxh3_64_on_every_path(
    core: Any,
    split: Callable[..., tuple[bytes, ...]],
    data: st.DataObject,
    length: int,
    cuts: list[int],
) -> None:
    payload = data.draw(st.binary(min_size=length, max_size=length))
    want = xxhash.xxh3_64_intdigest(payload)
    for bits in BITS:
        got = core.xxh3_64(split(payload, cuts), bits)
        assert got == want, (length, cuts, bits)


@pytest.mark.parametrize("length", [(64 << 10) - 1, 64 << 10, (1 << 20) + 17, 3 << 20])
def test_large_inputs_in_frame_shaped_parts(core: Any, length: int) -> None:
    """Many 1 KiB blocks, split as the core hashes a payload of two regions (a page's K
    and V) and as one; the default width is the CPU's widest."""
    payload = os.urandom(length)
    want = xxhash.xxh3_64_intdigest(payload)
    for bits in (0, *BITS):
        assert core.xxh3_64((payload,), bits) == want, bits
        halves = (payload[: length // 2], payload[length // 2 :])
        assert core.xxh3_64(halves, bits) == want, bits


def test_every_buffer_kind_is_hashed_in_place(core: Any) -> None:
    payload = os.urandom(5000)
    parts = (memoryview(payload)[:100], bytearray(payload[100:3000]), payload[3000:])
    assert core.xxh3_64(parts) == xxhash.xxh3_64_intdigest(payload)


def test_what_is_not_a_buffer_is_refused(core: Any) -> None:
    with pytest.raises(TypeError):
        core.xxh3_64(("text",))
    with pytest.raises(TypeError):
        core.xxh3_64([b"a list"])


def test_the_core_says_how_wide_its_stripe_loop_runs(core: Any) -> None:
    assert core.XXH3_VECTOR_BITS in BITS
