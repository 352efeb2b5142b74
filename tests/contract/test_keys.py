"""Offload keys and prefix-chained block hashes."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tierkv.contract.keys import (
    get_offload_block_hash,
    get_offload_group_idx,
    hash_token_blocks,
    make_offload_key,
)


def test_key_is_hash_then_big_endian_group() -> None:
    key = make_offload_key(b"\xab" * 16, 0x01020304)
    assert key == b"\xab" * 16 + b"\x01\x02\x03\x04"
    assert get_offload_block_hash(key) == b"\xab" * 16
    assert get_offload_group_idx(key) == 0x01020304


@given(st.binary(min_size=1, max_size=64), st.integers(0, 2**32 - 1))
def test_key_round_trips(block_hash: bytes, group: int) -> None:
    key = make_offload_key(block_hash, group)
    assert get_offload_block_hash(key) == block_hash
    assert get_offload_group_idx(key) == group


@pytest.mark.parametrize("group", [-1, 2**32, 2**40])
def test_group_out_of_range_is_rejected(group: int) -> None:
    with pytest.raises(ValueError, match=r"group_idx must be in 0\.\.4294967295"):
        make_offload_key(b"h", group)


@pytest.mark.parametrize("bad", ["abc", bytearray(b"abc"), 123, None])
def test_non_bytes_hash_is_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="block_hash must be bytes"):
        make_offload_key(bad, 0)  # type: ignore[arg-type]


def test_bool_group_and_empty_hash_are_rejected() -> None:
    with pytest.raises(ValueError, match="must be an int"):
        make_offload_key(b"h", True)
    with pytest.raises(ValueError, match="must not be empty"):
        make_offload_key(b"", 0)


def test_too_short_key_is_rejected_by_accessors() -> None:
    with pytest.raises(ValueError, match="block hash plus 4 group bytes"):
        get_offload_group_idx(b"\x00\x00\x00\x01")


TOKENS = list(range(100, 164))  # 64 tokens = 4 blocks of 16


@pytest.mark.parametrize("algorithm", ["sha256", "xxh3_128"])
def test_one_hash_per_full_block(algorithm: str) -> None:
    hashes = hash_token_blocks([*TOKENS, 1, 2, 3], 16, namespace="ns", algorithm=algorithm)  # type: ignore[arg-type]
    assert len(hashes) == 4  # the partial trailing block gets no hash
    assert len(set(hashes)) == 4
    assert all(len(h) == (32 if algorithm == "sha256" else 16) for h in hashes)


def test_changed_token_changes_that_block_and_every_later_one() -> None:
    base = hash_token_blocks(TOKENS, 16, namespace="ns")
    changed = TOKENS.copy()
    changed[20] += 1  # inside block 1
    other = hash_token_blocks(changed, 16, namespace="ns")
    assert other[0] == base[0]
    assert all(a != b for a, b in zip(other[1:], base[1:]))


def test_namespaces_never_share_hashes_even_with_a_foreign_parent() -> None:
    a = hash_token_blocks(TOKENS, 16, namespace="model-a")
    b = hash_token_blocks(TOKENS, 16, namespace="model-b")
    assert not set(a) & set(b)
    cont_a = hash_token_blocks(TOKENS[:16], 16, namespace="model-a", parent=a[0])
    cont_b = hash_token_blocks(TOKENS[:16], 16, namespace="model-b", parent=a[0])
    assert cont_a != cont_b


def test_parent_continues_the_chain() -> None:
    whole = hash_token_blocks(TOKENS, 16, namespace="ns")
    first = hash_token_blocks(TOKENS[:32], 16, namespace="ns")
    rest = hash_token_blocks(TOKENS[32:], 16, namespace="ns", parent=first[-1])
    assert first + rest == whole


def test_extra_changes_hashes_per_block() -> None:
    base = hash_token_blocks(TOKENS, 16, namespace="ns")
    lora = hash_token_blocks(TOKENS, 16, namespace="ns", extra=b"lora-7")
    assert not set(base) & set(lora)
    per_block = hash_token_blocks(TOKENS, 16, namespace="ns", extra=[None, b"img", None, None])
    assert per_block[0] == base[0]
    assert per_block[1] != base[1] and per_block[3] != base[3]
    with pytest.raises(ValueError, match="extra has 2 entries but there are 4 full blocks"):
        hash_token_blocks(TOKENS, 16, namespace="ns", extra=[None, None])


def test_algorithms_differ() -> None:
    assert hash_token_blocks(TOKENS, 16, namespace="ns") != hash_token_blocks(
        TOKENS, 16, namespace="ns", algorithm="xxh3_128"
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 0}, "block_size must be a positive int"),
        ({"namespace": ""}, "namespace must be a non-empty string"),
        ({"algorithm": "md5"}, "algorithm must be"),
        ({"parent": "str"}, "parent must be bytes"),
    ],
)
def test_bad_arguments_are_rejected(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"block_size": 16, "namespace": "ns", **kwargs}
    with pytest.raises(ValueError, match=message):
        hash_token_blocks(TOKENS, **args)  # type: ignore[arg-type]


def test_non_integer_tokens_are_rejected() -> None:
    with pytest.raises(ValueError, match="token ids must be 64-bit ints"):
        hash_token_blocks([1.5] * 16, 16, namespace="ns")  # type: ignore[list-item]


@pytest.mark.parametrize("algorithm", ["sha256", "xxh3_128"])
def test_hashes_are_stable_across_processes(algorithm: str) -> None:
    code = (
        "from tierkv.contract.keys import hash_token_blocks;"
        f"print(','.join(h.hex() for h in hash_token_blocks(list(range(100, 164)), 16,"
        f" namespace='ns', algorithm={algorithm!r})))"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
        ).stdout.strip()
        for seed in ("1", "2")
    }
    here = ",".join(
        h.hex() for h in hash_token_blocks(TOKENS, 16, namespace="ns", algorithm=algorithm)
    )  # type: ignore[arg-type]
    assert outputs == {here}
