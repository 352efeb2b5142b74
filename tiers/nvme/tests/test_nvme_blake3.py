"""The core's own keyed BLAKE3 (`_blake3.c`), the MAC of signed frames, against the
`blake3` package `tierkv.contract.mac` signs with: the same 32 bytes for any key, any
length (empty, inside one chunk, on and around chunk and subtree boundaries, many
chunks) and any split of the input into parts, on each of the core's code paths (one
chunk at a time, eight (AVX2) and sixteen (AVX-512) side by side, as far as this CPU
has them)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import blake3
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

LANES = (1, 8, 16)
"""What `keyed_hash` may be asked for; it uses no more than the CPU has."""


LENGTHS = st.one_of(
    st.integers(0, 3 * 1024),
    st.sampled_from([1023, 1024, 1025, 8 * 1024, 16 * 1024, 16 * 1024 + 1, 17 * 1024]),
    st.integers(0, 70 * 1024),
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    key=st.binary(min_size=32, max_size=32),
    length=LENGTHS,
    seed=st.binary(min_size=8, max_size=8),
    cuts=st.lists(st.integers(0, 70 * 1024), max_size=4),
)
def test_the_mac_is_blake3_keyed_on_every_path(
    core: Any,
    split: Callable[..., tuple[bytes, ...]],
    key: bytes,
    length: int,
    seed: bytes,
    cuts: list[int],
) -> None:
    data = (seed * (length // 8 + 1))[:length]
    data = bytes(b ^ (i * 131 % 251) for i, b in enumerate(data))  # not periodic per chunk
    want = blake3.blake3(data, key=key).digest()
    for lanes in LANES:
        assert core.keyed_hash(key, split(data, cuts), lanes) == want, (length, cuts, lanes)


@pytest.mark.parametrize("length", [(1 << 20) - 1, 1 << 20, (1 << 20) + 1024 * 17 + 5, 3 << 20])
def test_large_inputs_make_whole_trees(core: Any, length: int) -> None:
    """Inputs of many subtrees (a 1 MiB block is 1,024 chunks): the side-by-side
    subtrees, the chunks left over and the stack of subtrees that joins them."""
    key, data = os.urandom(32), os.urandom(length)
    want = blake3.blake3(data, key=key).digest()
    for lanes in LANES:
        parts = (data[:70], data[70 : length // 2], data[length // 2 :])  # a frame header first
        assert core.keyed_hash(key, parts, lanes) == want, lanes


def test_a_key_of_the_wrong_length_is_refused(core: Any) -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        core.keyed_hash(b"short", (b"data",))


def test_the_core_says_how_many_chunks_it_hashes_at_once(core: Any) -> None:
    assert core.BLAKE3_LANES in LANES
