"""The frame every tier stores around a block's bytes.

    magic "TKVB" | version u16 | flags u16 | namespace hash u64 | payload length u64
    | payload checksum u64 (xxh3_64) | key length u16 | key | [MAC, 32 bytes] | payload

Bytes read back from a tier are untrusted (a shared Redis, an S3 bucket, a disk that
lost power): a `Framer` rejects anything whose magic, version, flags, namespace, key,
length, checksum or MAC does not match, with a `CorruptBlock` that says which. Nothing
is ever unpickled.

Flags: bit 0 (`FLAG_MAC`) says the frame carries a MAC, a keyed BLAKE3 of the header
(without the MAC) and the payload (`tierkv.mac`); every other bit must be 0. A tier
with `mac_key_env` set writes MACs and accepts only frames whose MAC checks under its
key; a tier without one accepts only frames without a MAC.

Overhead per block, for capacity accounting: `Framer.header_bytes(key)` =
FIXED_HEADER_BYTES (34) + len(key) (+ MAC_BYTES (32) with a MAC). A tier with
`capacity: C` holds about C // (header_bytes(key) + block_bytes) blocks.

A tier that can read in two steps (header, then payload straight into the primary
slot) uses `parse_header` + `check` + `verify`; one that gets the whole value at once
uses `decode_into`. All of them are CPU work on a whole block (checksum, MAC, a copy):
remote tiers run them in a worker thread, not on the event loop.

The module-level functions are the frame without a MAC, kept for code written before
`Framer`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from tierkv.errors import CorruptBlock
from tierkv.keys import OffloadKey
from tierkv.mac import MAC_BYTES, MacKey

MAGIC = b"TKVB"
FORMAT_VERSION = 1
FLAG_MAC = 0x0001
KNOWN_FLAGS = FLAG_MAC
_FIXED = struct.Struct("<4sHHQQQH")
FIXED_HEADER_BYTES = _FIXED.size
MAX_KEY_BYTES = 2**16 - 1

Buffer = bytes | bytearray | memoryview


def namespace_hash(namespace: str) -> int:
    """A 64-bit tag of the namespace, stored in every frame."""
    return int(xxhash.xxh3_64_intdigest(namespace.encode()))


def checksum(payload: Buffer) -> int:
    """xxh3_64 of the payload (~12 GB/s; sha256 would be ~8x slower)."""
    return int(xxhash.xxh3_64_intdigest(payload))


def header_bytes(key: OffloadKey, *, mac: bool = False) -> int:
    """Total header length for `key` (with room for a MAC if `mac`)."""
    return FIXED_HEADER_BYTES + len(key) + (MAC_BYTES if mac else 0)


def header_length(fixed: Buffer) -> int:
    """Total header length announced by the first `FIXED_HEADER_BYTES` of a frame, so a
    reader can fetch exactly the header before the payload."""
    if len(fixed) < FIXED_HEADER_BYTES:
        raise CorruptBlock(f"frame of {len(fixed)} bytes is shorter than its header")
    fields = _FIXED.unpack_from(fixed)
    flags: int = fields[2]
    key_len: int = fields[6]
    return FIXED_HEADER_BYTES + key_len + (MAC_BYTES if flags & FLAG_MAC else 0)


@dataclass(frozen=True)
class Header:
    key: OffloadKey
    payload_length: int
    payload_checksum: int
    size: int  # bytes of header, where the payload starts
    mac: bytes | None = None  # the MAC the frame carries
    signed: bytes = b""  # fixed header + key: what the MAC covers before the payload


class Framer:
    """Writes and checks frames for one namespace, with or without a MAC.

    Every tier has one (`SecondaryTierManager.framer`), built from its config's
    `mac_key_env`. Thread-safe: it holds no mutable state."""

    __slots__ = ("_mac", "_ns_hash", "namespace")

    def __init__(self, namespace: str, mac_key: MacKey | None = None) -> None:
        self.namespace = namespace
        self._ns_hash = namespace_hash(namespace)
        self._mac = mac_key

    @property
    def namespace_tag(self) -> int:
        """The 64-bit namespace hash every frame of this namespace carries."""
        return self._ns_hash

    @property
    def mac(self) -> bool:
        """Whether frames carry (and must carry) a MAC."""
        return self._mac is not None

    def header_bytes(self, key: OffloadKey) -> int:
        """Bytes a frame of `key` adds to its block: the per-block overhead."""
        return header_bytes(key, mac=self._mac is not None)

    def frame_bytes(self, key: OffloadKey, block_bytes: int) -> int:
        """Bytes of a whole frame of `key` holding `block_bytes` of payload."""
        return self.header_bytes(key) + block_bytes

    # -- writing --------------------------------------------------------------------
    def encode_header(self, key: OffloadKey, payload: Buffer) -> bytes:
        """The header to write before `payload`; the caller writes both back to back."""
        if len(key) > MAX_KEY_BYTES:
            raise ValueError(f"key of {len(key)} bytes is longer than {MAX_KEY_BYTES}")
        fixed = _FIXED.pack(
            MAGIC,
            FORMAT_VERSION,
            FLAG_MAC if self._mac is not None else 0,
            self._ns_hash,
            len(payload),
            checksum(payload),
            len(key),
        )
        if self._mac is None:
            return fixed + key
        return fixed + key + self._mac.tag(fixed, key, payload)

    def encode(self, key: OffloadKey, payload: Buffer) -> bytes:
        """Header and payload as one `bytes` (one copy of the payload)."""
        return b"".join((self.encode_header(key, payload), payload))

    # -- reading --------------------------------------------------------------------
    def parse_header(self, data: Buffer) -> Header:
        """Parse and check the header at the start of `data` (which may hold more):
        magic, version, flags (strictly), namespace, and that the key (and MAC) fit."""
        if len(data) < FIXED_HEADER_BYTES:
            raise CorruptBlock(f"frame of {len(data)} bytes is shorter than its header")
        magic, version, flags, ns_hash, length, check, key_len = _FIXED.unpack_from(data)
        if magic != MAGIC:
            raise CorruptBlock(f"bad magic {bytes(magic)!r}: not a tierkv block")
        if version != FORMAT_VERSION:
            raise CorruptBlock(f"format version {version} (this tierkv reads {FORMAT_VERSION})")
        if flags & ~KNOWN_FLAGS:
            raise CorruptBlock(f"unknown header flags 0x{flags:04x}")
        has_mac = bool(flags & FLAG_MAC)
        if has_mac and self._mac is None:
            raise CorruptBlock("frame carries a MAC but this tier has no MAC key (mac_key_env)")
        if not has_mac and self._mac is not None:
            raise CorruptBlock("frame carries no MAC but this tier requires one (mac_key_env)")
        if ns_hash != self._ns_hash:
            raise CorruptBlock("block belongs to another namespace")
        key_end = FIXED_HEADER_BYTES + key_len
        end = key_end + (MAC_BYTES if has_mac else 0)
        if len(data) < end:
            where = "key" if len(data) < key_end else "MAC"
            raise CorruptBlock(f"frame truncated inside its {where}")
        signed = bytes(data[:key_end])
        return Header(
            key=signed[FIXED_HEADER_BYTES:],
            payload_length=length,
            payload_checksum=check,
            size=end,
            mac=bytes(data[key_end:end]) if has_mac else None,
            signed=signed,
        )

    def check(self, header: Header, key: OffloadKey, block_bytes: int) -> None:
        """The header names `key` and a payload of exactly `block_bytes`."""
        check_header(header, key, block_bytes)

    def verify(self, header: Header, payload: Buffer) -> None:
        """The payload has the header's length and checksum, and the MAC checks."""
        verify_payload(header, payload)
        mac = self._mac
        if mac is not None and (
            header.mac is None or not mac.verify(header.mac, header.signed, payload)
        ):
            raise CorruptBlock("MAC mismatch: written without this tier's key, or altered")

    def decode_into(self, key: OffloadKey, frame: Buffer, dest: memoryview) -> None:
        """Check a whole frame read back for `key` and copy its payload into `dest`.

        `dest` is written only after every check passes."""
        header = self.parse_header(frame)
        check_header(header, key, len(dest))
        view = memoryview(frame)[header.size :]
        self.verify(header, view)
        dest[:] = view


def check_header(header: Header, key: OffloadKey, block_bytes: int) -> None:
    """The header names `key` and a payload of exactly `block_bytes`."""
    if header.key != key:
        raise CorruptBlock(f"frame holds key {header.key.hex()}, expected {key.hex()}")
    if header.payload_length != block_bytes:
        raise CorruptBlock(f"payload length {header.payload_length} != block size {block_bytes}")


def verify_payload(header: Header, payload: Buffer) -> None:
    """The payload has the header's length and checksum."""
    if len(payload) != header.payload_length:
        raise CorruptBlock(f"payload is {len(payload)} bytes, header says {header.payload_length}")
    if checksum(payload) != header.payload_checksum:
        raise CorruptBlock("payload checksum mismatch")


# -- the frame without a MAC, as plain functions ---------------------------------------
def encode_header(key: OffloadKey, payload: Buffer, namespace: str) -> bytes:
    """`Framer(namespace).encode_header(key, payload)`."""
    return Framer(namespace).encode_header(key, payload)


def encode_block(key: OffloadKey, payload: Buffer, namespace: str) -> bytes:
    """`Framer(namespace).encode(key, payload)`."""
    return Framer(namespace).encode(key, payload)


def parse_header(data: Buffer, namespace: str) -> Header:
    """`Framer(namespace).parse_header(data)`."""
    return Framer(namespace).parse_header(data)


def decode_into(key: OffloadKey, frame: Buffer, dest: memoryview, namespace: str) -> None:
    """`Framer(namespace).decode_into(key, frame, dest)`."""
    Framer(namespace).decode_into(key, frame, dest)
