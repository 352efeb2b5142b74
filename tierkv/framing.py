"""The frame every tier stores around a block's bytes.

    magic "TKVB" | version u16 | flags u16 | namespace hash u64 | payload length u64
    | payload checksum u64 (xxh3_64) | key length u16 | key | payload

Bytes read back from a tier are untrusted (a shared Redis, an S3 bucket, a disk that
lost power): `check_header` and `verify_payload` reject anything whose magic, version,
namespace, key, length or checksum does not match, with a `CorruptBlock` that says
which. Nothing is ever unpickled.

A tier that can read in two steps (header, then payload straight into the primary
slot) uses `parse_header` + `verify_payload`; one that gets the whole value at once
uses `decode_into`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from tierkv.errors import CorruptBlock
from tierkv.keys import OffloadKey

MAGIC = b"TKVB"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<4sHHQQQH")
FIXED_HEADER_BYTES = _FIXED.size
MAX_KEY_BYTES = 2**16 - 1


def namespace_hash(namespace: str) -> int:
    """A 64-bit tag of the namespace, stored in every frame."""
    return int(xxhash.xxh3_64_intdigest(namespace.encode()))


def checksum(payload: bytes | bytearray | memoryview) -> int:
    """xxh3_64 of the payload (~12 GB/s; sha256 would be ~8x slower)."""
    return int(xxhash.xxh3_64_intdigest(payload))


def header_bytes(key: OffloadKey) -> int:
    """Total header length for `key`."""
    return FIXED_HEADER_BYTES + len(key)


def header_length(fixed: bytes | bytearray | memoryview) -> int:
    """Total header length announced by the first `FIXED_HEADER_BYTES` of a frame, so a
    reader can fetch exactly the header before the payload."""
    if len(fixed) < FIXED_HEADER_BYTES:
        raise CorruptBlock(f"frame of {len(fixed)} bytes is shorter than its header")
    key_len: int = _FIXED.unpack_from(fixed)[-1]
    return FIXED_HEADER_BYTES + key_len


def encode_header(key: OffloadKey, payload: bytes | memoryview, namespace: str) -> bytes:
    """The header to write before `payload`; the caller writes both back to back."""
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"key of {len(key)} bytes is longer than {MAX_KEY_BYTES}")
    fixed = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        0,
        namespace_hash(namespace),
        len(payload),
        checksum(payload),
        len(key),
    )
    return fixed + key


def encode_block(key: OffloadKey, payload: bytes | memoryview, namespace: str) -> bytes:
    """Header and payload as one `bytes` (one copy of the payload)."""
    return encode_header(key, payload, namespace) + bytes(payload)


@dataclass(frozen=True)
class Header:
    key: OffloadKey
    payload_length: int
    payload_checksum: int
    size: int  # bytes of header, where the payload starts


def parse_header(data: bytes | bytearray | memoryview, namespace: str) -> Header:
    """Parse and check the header at the start of `data` (which may hold more)."""
    if len(data) < FIXED_HEADER_BYTES:
        raise CorruptBlock(f"frame of {len(data)} bytes is shorter than its header")
    magic, version, _flags, ns_hash, length, check, key_len = _FIXED.unpack_from(data)
    if magic != MAGIC:
        raise CorruptBlock(f"bad magic {bytes(magic)!r}: not a tierkv block")
    if version != FORMAT_VERSION:
        raise CorruptBlock(f"format version {version} (this tierkv reads {FORMAT_VERSION})")
    if ns_hash != namespace_hash(namespace):
        raise CorruptBlock("block belongs to another namespace")
    end = FIXED_HEADER_BYTES + key_len
    if len(data) < end:
        raise CorruptBlock("frame truncated inside its key")
    return Header(bytes(data[FIXED_HEADER_BYTES:end]), length, check, end)


def check_header(header: Header, key: OffloadKey, block_bytes: int) -> None:
    """The header names `key` and a payload of exactly `block_bytes`."""
    if header.key != key:
        raise CorruptBlock(f"frame holds key {header.key.hex()}, expected {key.hex()}")
    if header.payload_length != block_bytes:
        raise CorruptBlock(f"payload length {header.payload_length} != block size {block_bytes}")


def verify_payload(header: Header, payload: bytes | bytearray | memoryview) -> None:
    """The payload has the header's length and checksum."""
    if len(payload) != header.payload_length:
        raise CorruptBlock(f"payload is {len(payload)} bytes, header says {header.payload_length}")
    if checksum(payload) != header.payload_checksum:
        raise CorruptBlock("payload checksum mismatch")


def decode_into(
    key: OffloadKey, frame: bytes | bytearray | memoryview, dest: memoryview, namespace: str
) -> None:
    """Check a whole frame read back for `key` and copy its payload into `dest`.

    `dest` is written only after every check passes."""
    header = parse_header(frame, namespace)
    check_header(header, key, len(dest))
    view = memoryview(frame)[header.size :]
    verify_payload(header, view)
    dest[:] = view
