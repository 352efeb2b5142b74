"""The stored frame: every way a read-back can be wrong is caught and named."""

from __future__ import annotations

import itertools
import os
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tierkv.contract.errors import CorruptBlock
from tierkv.contract.framing import (
    FIXED_HEADER_BYTES,
    Framer,
    copy_into,
    decode_into,
    encode_block,
    encode_header,
    header_bytes,
    parse_header,
    slice_payload,
)
from tierkv.contract.keys import make_offload_key
from tierkv.contract.mac import MacKey

KEY = b"k" * 16 + b"\x00\x00\x00\x01"
PAYLOAD = bytes(range(256)) * 4


def dest(n: int = len(PAYLOAD)) -> memoryview:
    return memoryview(bytearray(b"\xee" * n))


@given(key=st.binary(min_size=5, max_size=64), payload=st.binary(min_size=1, max_size=4096))
def test_round_trip(key: bytes, payload: bytes) -> None:
    out = dest(len(payload))
    decode_into(key, encode_block(key, payload, "ns"), out, "ns")
    assert bytes(out) == payload


def test_header_layout_is_fixed_plus_key() -> None:
    header = encode_header(KEY, PAYLOAD, "ns")
    assert len(header) == header_bytes(KEY) == FIXED_HEADER_BYTES + len(KEY)
    assert header.startswith(b"TKVB")
    parsed = parse_header(header + PAYLOAD, "ns")
    assert (
        parsed.key == KEY and parsed.payload_length == len(PAYLOAD) and parsed.size == len(header)
    )


def corrupt_cases() -> list[tuple[str, bytes, str]]:
    frame = encode_block(KEY, PAYLOAD, "ns")
    flipped = bytearray(frame)
    flipped[-1] ^= 1
    bad_version = bytearray(frame)
    struct.pack_into("<H", bad_version, 4, 99)
    other_key = encode_block(b"x" * 20, PAYLOAD, "ns")
    return [
        ("flipped payload byte", bytes(flipped), "checksum mismatch"),
        ("truncated payload", frame[:-10], "payload is"),
        ("truncated header", frame[:10], "shorter than its header"),
        ("truncated key", frame[: FIXED_HEADER_BYTES + 3], "truncated inside its key"),
        ("not a tierkv block", b"PK\x03\x04" + frame[4:], "bad magic"),
        ("a future format", bytes(bad_version), "format version 99"),
        ("another key's block", other_key, "expected " + KEY.hex()),
        ("another namespace", encode_block(KEY, PAYLOAD, "other"), "another namespace"),
        ("wrong block size", encode_block(KEY, PAYLOAD[:512], "ns"), "payload length 512"),
        ("pickle", b"\x80\x04\x95" + b"\x00" * 60, "bad magic"),
    ]


@pytest.mark.parametrize(
    ("name", "frame", "message"),
    corrupt_cases(),
    ids=lambda v: v if isinstance(v, str) and " " in v else "",
)
def test_corruption_is_detected_and_destination_untouched(
    name: str, frame: bytes, message: str
) -> None:
    out = dest()
    with pytest.raises(CorruptBlock, match=message):
        decode_into(KEY, frame, out, "ns")
    assert bytes(out) == b"\xee" * len(PAYLOAD)


def test_overlong_key_is_rejected() -> None:
    with pytest.raises(ValueError, match="longer than"):
        encode_header(b"k" * 70000, PAYLOAD, "ns")


def test_header_length_from_the_fixed_part() -> None:
    from tierkv.contract.framing import header_length

    frame = encode_block(KEY, PAYLOAD, "ns")
    assert header_length(frame[:FIXED_HEADER_BYTES]) == header_bytes(KEY)
    assert header_length(bytearray(frame)) == header_bytes(KEY)
    with pytest.raises(CorruptBlock, match="shorter than its header"):
        header_length(frame[:5])


@pytest.mark.parametrize("cuts", [(), (60,), (200, 3000), (4000, 4100, 4130)])
def test_a_frame_in_parts_decodes_straight_into_the_slot(cuts: tuple[int, ...]) -> None:
    framer = Framer("ns")
    key = make_offload_key(b"p" * 16, 0)
    payload = os.urandom(4096)
    frame = framer.encode(key, payload)
    edges = [0, *cuts, len(frame)]
    parts = [frame[a:b] for a, b in itertools.pairwise(edges)]
    dest = memoryview(bytearray(4096))
    framer.decode_parts_into(key, parts, dest)
    assert bytes(dest) == payload


def test_a_frame_in_parts_with_a_bad_piece_or_length_is_corrupt() -> None:
    framer = Framer("ns")
    key = make_offload_key(b"q" * 16, 0)
    frame = bytearray(framer.encode(key, os.urandom(4096)))
    dest = memoryview(bytearray(4096))
    flipped = bytearray(frame)
    flipped[-1] ^= 1
    with pytest.raises(CorruptBlock, match="checksum"):
        framer.decode_parts_into(key, [flipped[:100], flipped[100:]], dest)
    with pytest.raises(CorruptBlock, match="header says 4096"):
        framer.decode_parts_into(key, [frame[:100], frame[100:-1]], dest)
    with pytest.raises(CorruptBlock, match="no parts"):
        framer.decode_parts_into(key, [], dest)


def _split_check(framer: Framer, head: bytes, key: bytes, payload: bytes) -> str | None:
    """What `parse_header` + `check` + `verify` say about (head, payload): None or the
    error."""
    try:
        header = framer.parse_header(head)
        framer.check(header, key, len(payload))
        framer.verify(header, payload)
    except CorruptBlock as exc:
        return str(exc)
    return None


def _whole_check(framer: Framer, head: bytes, key: bytes, payload: bytes) -> str | None:
    try:
        framer.check_frame(head, key, payload)
    except CorruptBlock as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("mac", [False, True])
def test_check_frame_agrees_with_the_three_steps_on_every_byte(mac: bool) -> None:
    """`check_frame` (one unpack and compare for unsigned frames) accepts exactly what
    `parse_header` + `check` + `verify` accept and raises the same message otherwise:
    every byte of the header flipped, the payload flipped, another key, namespace or
    block size."""
    from tierkv.contract.mac import MacKey

    framer = Framer("ns", MacKey(b"s" * 32) if mac else None)
    head = framer.encode_header(KEY, PAYLOAD)
    cases = [(head, KEY, PAYLOAD)]
    for i in range(len(head)):
        bent = bytearray(head)
        bent[i] ^= 0x41
        cases.append((bytes(bent), KEY, PAYLOAD))
    flipped = bytearray(PAYLOAD)
    flipped[7] ^= 1
    cases.append((head, KEY, bytes(flipped)))
    cases.append((head, b"x" * len(KEY), PAYLOAD))
    cases.append((head, KEY, PAYLOAD[:-1]))
    cases.append((Framer("other").encode_header(KEY, PAYLOAD), KEY, PAYLOAD))
    for case in cases:
        assert _whole_check(framer, *case) == _split_check(framer, *case)
    assert _whole_check(framer, *cases[0]) is None
    assert all(_whole_check(framer, *case) is not None for case in cases[1:])


# -- a block of several regions (StridedView) --------------------------------------------
@given(
    cuts=st.lists(st.integers(min_value=1, max_value=len(PAYLOAD) - 1), max_size=4, unique=True),
    mac=st.booleans(),
)
def test_regions_frame_exactly_as_their_joined_bytes(cuts: list[int], mac: bool) -> None:
    """Header (length, checksum, MAC) of regions = header of the joined bytes, so a
    block written as regions reads back as one buffer and the other way round."""
    framer = Framer("ns", MacKey(b"s" * 32) if mac else None)
    bounds = [0, *sorted(cuts), len(PAYLOAD)]
    regions = tuple(memoryview(PAYLOAD)[a:b] for a, b in itertools.pairwise(bounds))
    assert framer.encode_header(KEY, regions) == framer.encode_header(KEY, PAYLOAD)
    assert framer.encode(KEY, regions) == framer.encode(KEY, PAYLOAD)
    head = framer.encode_header(KEY, PAYLOAD)
    framer.check_frame(head, KEY, regions)
    out = tuple(memoryview(bytearray(b - a)) for a, b in itertools.pairwise(bounds))
    framer.decode_into(KEY, framer.encode(KEY, PAYLOAD), out)
    assert b"".join(bytes(r) for r in out) == PAYLOAD


def test_a_changed_region_fails_its_check() -> None:
    framer = Framer("ns")
    regions = (memoryview(bytearray(PAYLOAD[:512])), memoryview(bytearray(PAYLOAD[512:])))
    head = framer.encode_header(KEY, regions)
    regions[1][7] ^= 1
    with pytest.raises(CorruptBlock, match="checksum"):
        framer.check_frame(head, KEY, regions)
    with pytest.raises(CorruptBlock, match="payload length"):
        framer.check_frame(head, KEY, regions[:1])


@given(
    # the first part holds the whole header, as redis's parts of 1 KiB and more do
    part_cuts=st.lists(st.integers(min_value=54, max_value=1077), max_size=4, unique=True),
    region_cuts=st.lists(
        st.integers(min_value=1, max_value=len(PAYLOAD) - 1), max_size=3, unique=True
    ),
    start=st.integers(min_value=0, max_value=len(PAYLOAD)),
    length=st.integers(min_value=0, max_value=len(PAYLOAD)),
)
def test_a_frame_in_parts_lands_in_regions_and_regions_slice_as_joined(
    part_cuts: list[int], region_cuts: list[int], start: int, length: int
) -> None:
    """A split frame (redis parts) copied into regions, and any slice of regions,
    are the bytes of the joined payload."""
    framer = Framer("ns")
    frame = framer.encode(KEY, PAYLOAD)
    bounds = [0, *sorted(c for c in part_cuts if c < len(frame)), len(frame)]
    parts = [frame[a:b] for a, b in itertools.pairwise(bounds)]
    cuts = [0, *sorted(region_cuts), len(PAYLOAD)]
    regions = tuple(memoryview(bytearray(b - a)) for a, b in itertools.pairwise(cuts))
    framer.decode_parts_into(KEY, parts, regions)
    assert b"".join(bytes(r) for r in regions) == PAYLOAD
    end = min(len(PAYLOAD), start + length)
    sliced = slice_payload(regions, start, end)
    assert isinstance(sliced, tuple)
    assert b"".join(bytes(r) for r in sliced) == PAYLOAD[start:end]


def test_copy_into_refuses_more_bytes_than_the_regions_hold() -> None:
    regions = (memoryview(bytearray(4)), memoryview(bytearray(4)))
    copy_into(regions, [b"abcdef", b"gh"])
    assert bytes(regions[0]) + bytes(regions[1]) == b"abcdefgh"
    with pytest.raises(ValueError, match="more bytes"):
        copy_into(regions, [b"abcdefghi"])
