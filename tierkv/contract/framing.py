"""The frame every tier stores around a block's bytes.

    magic "TKVB" | version u16 | flags u16 | namespace hash u64 | payload length u64
    | payload checksum u64 (xxh3_64) | key length u16 | key
    | [MAC key id, 8 bytes] | [MAC, 32 bytes] | payload

Bytes read back from a tier are untrusted (a shared Redis, an S3 bucket, a disk that
lost power): a `Framer` rejects anything whose magic, version, flags, namespace, key,
length, checksum or MAC does not match, with a `CorruptBlock` that says which. Nothing
is ever unpickled.

Flags: bit 0 (`FLAG_MAC`) says the frame carries a MAC, a keyed BLAKE3 of everything
before the MAC (header, key, key id) and of the payload (`tierkv.contract.mac`); bit 1
(`FLAG_KEY_ID`, only with a MAC) says the MAC is preceded by the id of the key that
made it. Every other bit must be 0. A tier with `mac_key_env` set writes both.

Trust domains: servers with different MAC keys may share one namespace on one Redis
or bucket. What a reader does with a frame depends on whose it is:
- signed with our key id and the MAC checks: served;
- signed with our key id and the MAC fails: forged or altered, `CorruptBlock` (the
  tier deletes it);
- signed by another key id, signed while we hold no key, or unsigned while we
  require a signature: `ForeignBlock` (a `CorruptBlock`): a miss for us, left in
  place for the servers it belongs to;
- signed without a key id (written before key ids, tierkv 2026-11 and earlier): the
  MAC decides, as it did then.
Frames without a MAC are byte-identical to what earlier versions wrote. A reader
older than key ids refuses signed frames with the new flag ("unknown header flags")
and deletes them: upgrade every signing server of a namespace together.

Overhead per block, for capacity accounting: `Framer.header_bytes(key)` =
FIXED_HEADER_BYTES (34) + len(key) (+ KEY_ID_BYTES (8) + MAC_BYTES (32) with a MAC).
A tier with `capacity: C` holds about C // (header_bytes(key) + block_bytes) blocks.

A tier that can read in two steps (header, then payload straight into the primary
slot) uses `parse_header` + `check` + `verify` (or `check_frame`, the three at once);
one that gets the whole value at once uses `decode_into`. All of them are CPU work on
a whole block (checksum, MAC, a copy): remote tiers run them in a worker thread, not
on the event loop.

The module-level functions are the frame without a MAC, kept for code written before
`Framer`.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from tierkv.contract.errors import CorruptBlock, ForeignBlock
from tierkv.contract.keys import OffloadKey
from tierkv.contract.mac import KEY_ID_BYTES, MAC_BYTES, MacKey
from tierkv.contract.slab import Regions

MAGIC = b"TKVB"
FORMAT_VERSION = 1
FLAG_MAC = 0x0001
FLAG_KEY_ID = 0x0002
KNOWN_FLAGS = FLAG_MAC | FLAG_KEY_ID
_SIGNATURE_BYTES = KEY_ID_BYTES + MAC_BYTES  # what a signed frame adds after its key
_FIXED = struct.Struct("<4sHHQQQH")
FIXED_HEADER_BYTES = _FIXED.size
MAX_KEY_BYTES = 2**16 - 1

Buffer = bytes | bytearray | memoryview
Payload = bytes | bytearray | memoryview | Regions
"""A block's bytes: one buffer, or the regions of a `StridedView` block in order (the
frame is the same as for those regions joined; nothing here joins them)."""


def payload_length(payload: Payload) -> int:
    """Bytes of `payload` (all its regions)."""
    if isinstance(payload, tuple):
        return sum(map(len, payload))
    return len(payload)


def namespace_hash(namespace: str) -> int:
    """A 64-bit tag of the namespace, stored in every frame."""
    return int(xxhash.xxh3_64_intdigest(namespace.encode()))


def checksum(payload: Payload) -> int:
    """xxh3_64 of the payload (~12 GB/s; sha256 would be ~8x slower); of regions, the
    xxh3_64 of their concatenation, hashed in place."""
    if isinstance(payload, tuple):
        if len(payload) == 1:
            return int(xxhash.xxh3_64_intdigest(payload[0]))
        hasher = xxhash.xxh3_64()
        for region in payload:
            hasher.update(region)
        return int(hasher.intdigest())
    return int(xxhash.xxh3_64_intdigest(payload))


def _parts(payload: Payload) -> tuple[Buffer, ...]:
    return payload if isinstance(payload, tuple) else (payload,)


def header_bytes(key: OffloadKey, *, mac: bool = False) -> int:
    """Total header length for `key` (with room for a key id and a MAC if `mac`)."""
    return FIXED_HEADER_BYTES + len(key) + (_SIGNATURE_BYTES if mac else 0)


PAYLOAD_ALIGNMENT = 64
"""The file or buffer offset a payload is best read from: a multiple of 64. A read
copies a frame's payload to its slot; where the slot's address lies 1-63 bytes past the
payload's offset (modulo a 4 KiB page) that copy is several times slower on x86 CPUs
that copy with `rep movsb`, the kernel's copy from the page cache included (measured on
the dev VM: 13.5 us for 32 KiB instead of 2.2; see the nvme tier's
`blockfile.SHORT_DISTANCE`). Engines' buffers are 64-byte aligned (torch's CPU
allocator, SGLang's host pools), so a header that is a multiple of 64 bytes puts every
slot at a distance of 0 or a multiple of 64 from its payload: an adapter that chooses
its keys' length makes it so with `aligned_key_bytes`."""


def aligned_key_bytes(minimum: int, *, mac: bool = False) -> int:
    """The shortest key length of at least `minimum` bytes whose frame header (with a
    key id and MAC if `mac`) is a multiple of PAYLOAD_ALIGNMENT bytes."""
    if minimum < 1:
        raise ValueError(f"a key has at least 1 byte, got {minimum}")
    fixed = header_bytes(b"", mac=mac)
    return minimum + (-(fixed + minimum)) % PAYLOAD_ALIGNMENT


def _extra_bytes(flags: int) -> int:
    """Bytes between the key and the payload that `flags` announce."""
    return (MAC_BYTES if flags & FLAG_MAC else 0) + (KEY_ID_BYTES if flags & FLAG_KEY_ID else 0)


def header_length(fixed: Buffer) -> int:
    """Total header length announced by the first `FIXED_HEADER_BYTES` of a frame, so a
    reader can fetch exactly the header before the payload."""
    if len(fixed) < FIXED_HEADER_BYTES:
        raise CorruptBlock(f"frame of {len(fixed)} bytes is shorter than its header")
    fields = _FIXED.unpack_from(fixed)
    flags: int = fields[2]
    key_len: int = fields[6]
    return FIXED_HEADER_BYTES + key_len + _extra_bytes(flags)


@dataclass(frozen=True)
class Header:
    key: OffloadKey
    payload_length: int
    payload_checksum: int
    size: int  # bytes of header, where the payload starts
    mac: bytes | None = None  # the MAC the frame carries
    signed: bytes = b""  # fixed header + key (+ key id): what the MAC covers before the payload
    key_id: bytes | None = None  # which MAC key signed the frame, when it says


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

    @property
    def mac_key(self) -> MacKey | None:
        """The key frames are signed with (None: unsigned), for a compiled data path
        that signs and checks them itself (the nvme tier's core)."""
        return self._mac

    def header_bytes(self, key: OffloadKey) -> int:
        """Bytes a frame of `key` adds to its block: the per-block overhead."""
        return header_bytes(key, mac=self._mac is not None)

    def frame_bytes(self, key: OffloadKey, block_bytes: int) -> int:
        """Bytes of a whole frame of `key` holding `block_bytes` of payload."""
        return self.header_bytes(key) + block_bytes

    # -- writing --------------------------------------------------------------------
    def encode_header(self, key: OffloadKey, payload: Payload) -> bytes:
        """The header to write before `payload` (one buffer or regions); the caller
        writes both back to back."""
        if len(key) > MAX_KEY_BYTES:
            raise ValueError(f"key of {len(key)} bytes is longer than {MAX_KEY_BYTES}")
        mac = self._mac
        fixed = _FIXED.pack(
            MAGIC,
            FORMAT_VERSION,
            FLAG_MAC | FLAG_KEY_ID if mac is not None else 0,
            self._ns_hash,
            payload_length(payload),
            checksum(payload),
            len(key),
        )
        if mac is None:
            return fixed + key
        return fixed + key + mac.key_id + mac.tag(fixed, key, mac.key_id, *_parts(payload))

    def encode(self, key: OffloadKey, payload: Payload) -> bytes:
        """Header and payload as one `bytes` (one copy of the payload)."""
        return b"".join((self.encode_header(key, payload), *_parts(payload)))

    # -- reading --------------------------------------------------------------------
    def parse_header(self, data: Buffer) -> Header:
        """Parse and check the header at the start of `data` (which may hold more):
        magic, version, flags (strictly), namespace, that the key (and signature) fit,
        and whose the frame is: `ForeignBlock` when another key signed it (or none
        did, where this tier requires a signature, or one did, where it has no key)."""
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
        if flags & FLAG_KEY_ID and not has_mac:
            raise CorruptBlock(f"header flags 0x{flags:04x}: a key id without a MAC")
        if ns_hash != self._ns_hash:
            raise CorruptBlock("block belongs to another namespace")
        key_end = FIXED_HEADER_BYTES + key_len
        mac_start = key_end + (KEY_ID_BYTES if flags & FLAG_KEY_ID else 0)
        end = mac_start + (MAC_BYTES if has_mac else 0)
        if len(data) < end:
            where = "key" if len(data) < key_end else "signature"
            raise CorruptBlock(f"frame truncated inside its {where}")
        key_id = bytes(data[key_end:mac_start]) if flags & FLAG_KEY_ID else None
        mine = self._mac
        if has_mac and mine is None:
            raise ForeignBlock(
                f"frame signed by MAC key {_id(key_id)}; this tier has no MAC key "
                "(mac_key_env): left in place"
            )
        if not has_mac and mine is not None:
            raise ForeignBlock(
                "frame carries no MAC; this tier accepts only frames signed with its key "
                "(mac_key_env): left in place"
            )
        if mine is not None and key_id is not None and key_id != mine.key_id:
            raise ForeignBlock(
                f"frame signed by MAC key {_id(key_id)}, this tier's is {_id(mine.key_id)}: "
                "another trust domain's block, left in place"
            )
        signed = bytes(data[:mac_start])
        return Header(
            key=signed[FIXED_HEADER_BYTES:key_end],
            payload_length=length,
            payload_checksum=check,
            size=end,
            mac=bytes(data[mac_start:end]) if has_mac else None,
            signed=signed,
            key_id=key_id,
        )

    def check(self, header: Header, key: OffloadKey, block_bytes: int) -> None:
        """The header names `key` and a payload of exactly `block_bytes`."""
        check_header(header, key, block_bytes)

    def verify(self, header: Header, payload: Payload) -> None:
        """The payload (one buffer or regions) has the header's length and checksum,
        and the MAC checks."""
        verify_payload(header, payload)
        mac = self._mac
        if mac is not None and (
            header.mac is None or not mac.verify(header.mac, header.signed, *_parts(payload))
        ):
            raise CorruptBlock(
                "MAC mismatch: claims this tier's key but was written without it, or altered"
                if header.key_id is not None
                else "MAC mismatch: written without this tier's key, or altered"
            )

    def check_frame(self, head: Buffer, key: OffloadKey, payload: Payload) -> None:
        """`parse_header(head)`, `check(header, key, len(payload))` and
        `verify(header, payload)` in one call, for a tier that read the header
        (exactly `header_bytes(key)` bytes) and the payload apart.

        An unsigned frame (a tier without a MAC key) is checked with one unpack and a
        compare of every field against what this framer writes for `key` and
        `payload` (magic, version, flags 0, namespace, length, key length, key,
        checksum); any difference goes the full way, which raises the precise
        `CorruptBlock`. No Header is built per block."""
        if self._mac is None and len(head) == FIXED_HEADER_BYTES + len(key):
            fields = _FIXED.unpack_from(head)
            if (
                fields[0] == MAGIC
                and fields[1] == FORMAT_VERSION
                and fields[2] == 0
                and fields[3] == self._ns_hash
                and fields[4] == payload_length(payload)
                and fields[6] == len(key)
                and head[FIXED_HEADER_BYTES:] == key
                and fields[5] == checksum(payload)
            ):
                return
        header = self.parse_header(head)
        check_header(header, key, payload_length(payload))
        self.verify(header, payload)

    def decode_into(self, key: OffloadKey, frame: Buffer, dest: memoryview | Regions) -> None:
        """Check a whole frame read back for `key` and copy its payload into `dest`
        (one buffer, or regions filled in order).

        `dest` is written only after every check passes."""
        header = self.parse_header(frame)
        check_header(header, key, payload_length(dest))
        view = memoryview(frame)[header.size :]
        self.verify(header, view)
        if isinstance(dest, tuple):
            copy_into(dest, (view,))
        else:
            dest[:] = view

    def decode_parts_into(
        self, key: OffloadKey, parts: Sequence[Buffer], dest: memoryview | Regions
    ) -> None:
        """Like `decode_into` for a frame stored in pieces (`parts` joined in order are
        the frame), without joining them: the payload pieces are copied into `dest`,
        then checked there. Unlike `decode_into`, `dest` may have been written when a
        check of the payload fails (a tier's load may leave a failed slot dirty)."""
        if not parts:
            raise CorruptBlock("a frame of no parts")
        first = parts[0]
        header = self.parse_header(first)
        check_header(header, key, payload_length(dest))
        size = header.size
        total = sum(len(p) for p in parts)
        if total - size != header.payload_length:
            raise CorruptBlock(
                f"payload is {total - size} bytes, header says {header.payload_length}"
            )
        pieces = [memoryview(part) for part in parts]
        pieces[0] = pieces[0][size:]
        copy_into(dest if isinstance(dest, tuple) else (dest,), pieces)
        self.verify(header, dest)


def copy_into(regions: Regions, pieces: Sequence[Buffer]) -> None:
    """Copy `pieces`, joined, into `regions`, filled in order (as many bytes in all)."""
    targets = iter(regions)
    target = next(targets, None)
    at = 0
    for piece in pieces:
        view = memoryview(piece)
        while len(view):
            if target is None:
                raise ValueError("the pieces hold more bytes than the regions")
            room = len(target) - at
            take = min(room, len(view))
            target[at : at + take] = view[:take]
            view = view[take:]
            at += take
            if at == len(target):
                target, at = next(targets, None), 0


def slice_payload(payload: Payload, start: int, end: int) -> Payload:
    """Bytes `start:end` of `payload` without a copy: a slice of one buffer, or the
    slices of the regions they span."""
    if not isinstance(payload, tuple):
        return payload[start:end]
    pieces: list[memoryview] = []
    offset = 0
    for region in payload:
        low, high = max(start, offset), min(end, offset + len(region))
        if low < high:
            pieces.append(region[low - offset : high - offset])
        offset += len(region)
    return tuple(pieces)


def _id(key_id: bytes | None) -> str:
    return key_id.hex() if key_id is not None else "(no key id: an older frame)"


def check_header(header: Header, key: OffloadKey, block_bytes: int) -> None:
    """The header names `key` and a payload of exactly `block_bytes`."""
    if header.key != key:
        raise CorruptBlock(f"frame holds key {header.key.hex()}, expected {key.hex()}")
    if header.payload_length != block_bytes:
        raise CorruptBlock(f"payload length {header.payload_length} != block size {block_bytes}")


def verify_payload(header: Header, payload: Payload) -> None:
    """The payload (one buffer or regions) has the header's length and checksum."""
    length = payload_length(payload)
    if length != header.payload_length:
        raise CorruptBlock(f"payload is {length} bytes, header says {header.payload_length}")
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
