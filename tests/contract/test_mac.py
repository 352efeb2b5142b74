"""Authenticated frames (tierkv.contract.mac, tierkv.contract.framing.Framer): the key
comes from the environment with clear errors, the flags are checked strictly, and a
frame made without the key is refused even when its checksum is right."""

from __future__ import annotations

import os
import struct

import pytest

from tierkv.contract.errors import ConfigError, CorruptBlock, ForeignBlock
from tierkv.contract.framing import (
    FIXED_HEADER_BYTES,
    FLAG_MAC,
    FORMAT_VERSION,
    MAGIC,
    Framer,
    checksum,
    header_bytes,
    header_length,
    namespace_hash,
)
from tierkv.contract.keys import make_offload_key
from tierkv.contract.mac import KEY_ID_BYTES, MAC_BYTES, MacKey, load_mac_key
from tierkv.contract.slab import PrimaryView
from tierkv.memory_tier import MemoryTier, MemoryTierConfig

ENV = "TIERKV_TEST_MAC_KEY"
KEY = make_offload_key(b"h" * 16, 0)
PAYLOAD = os.urandom(4096)


@pytest.fixture
def secret(monkeypatch: pytest.MonkeyPatch) -> str:
    value = os.urandom(32).hex()
    monkeypatch.setenv(ENV, value)
    return value


def test_a_frame_with_a_mac_round_trips_and_says_so_in_its_flags(secret: str) -> None:
    framer = Framer("ns", load_mac_key(ENV))
    frame = framer.encode(KEY, PAYLOAD)
    assert len(frame) == header_bytes(KEY, mac=True) + len(PAYLOAD)
    assert framer.header_bytes(KEY) == FIXED_HEADER_BYTES + len(KEY) + KEY_ID_BYTES + MAC_BYTES
    assert header_length(frame[:FIXED_HEADER_BYTES]) == framer.header_bytes(KEY)
    dest = memoryview(bytearray(len(PAYLOAD)))
    framer.decode_into(KEY, frame, dest)
    assert bytes(dest) == PAYLOAD


def test_a_frame_signed_by_another_key_is_foreign_not_forged(secret: str) -> None:
    """Another trust domain's block: refused (never served), but as a ForeignBlock,
    which a shared tier leaves in place; decided from the header alone."""
    reader = Framer("ns", load_mac_key(ENV))
    other = Framer("ns", MacKey(os.urandom(32))).encode(KEY, PAYLOAD)
    dest = memoryview(bytearray(len(PAYLOAD)))
    with pytest.raises(ForeignBlock, match="another trust domain"):
        reader.decode_into(KEY, other, dest)
    with pytest.raises(ForeignBlock):
        reader.parse_header(other[: reader.header_bytes(KEY)])  # before any payload read
    assert bytes(dest) == bytes(len(PAYLOAD)), "the slot is written only after every check"


def test_a_frame_claiming_our_key_id_with_a_wrong_mac_is_forged(secret: str) -> None:
    """Only a frame that says our key signed it, and fails, is corrupt (deleted)."""
    key = load_mac_key(ENV)
    reader = Framer("ns", key)
    forged = bytearray(Framer("ns", MacKey(os.urandom(32))).encode(KEY, PAYLOAD))
    at = FIXED_HEADER_BYTES + len(KEY)
    forged[at : at + KEY_ID_BYTES] = key.key_id  # the forger copies our (public) key id
    dest = memoryview(bytearray(len(PAYLOAD)))
    with pytest.raises(CorruptBlock, match="claims this tier's key") as caught:
        reader.decode_into(KEY, forged, dest)
    assert not isinstance(caught.value, ForeignBlock)
    assert bytes(dest) == bytes(len(PAYLOAD))


def test_key_ids_name_the_key_not_the_secret() -> None:
    secret = os.urandom(32)
    assert MacKey(secret).key_id == MacKey(secret).key_id
    assert len(MacKey(secret).key_id) == KEY_ID_BYTES
    assert MacKey(secret).key_id != MacKey(os.urandom(32)).key_id
    assert MacKey(secret).key_id not in secret
    assert MacKey(secret).key_id.hex() in repr(MacKey(secret))


def test_a_reader_with_a_key_leaves_frames_without_a_mac_and_vice_versa(secret: str) -> None:
    keyed = Framer("ns", load_mac_key(ENV))
    plain = Framer("ns")
    dest = memoryview(bytearray(len(PAYLOAD)))
    with pytest.raises(ForeignBlock, match="carries no MAC; this tier accepts only"):
        keyed.decode_into(KEY, plain.encode(KEY, PAYLOAD), dest)
    with pytest.raises(ForeignBlock, match="this tier has no MAC key"):
        plain.decode_into(KEY, keyed.encode(KEY, PAYLOAD), dest)


def _frame_without_key_id(mac: MacKey, payload: bytes) -> bytes:
    """A signed frame as tierkv wrote it before key ids: MAC right after the key."""
    fixed = struct.pack(
        "<4sHHQQQH",
        MAGIC,
        FORMAT_VERSION,
        FLAG_MAC,
        namespace_hash("ns"),
        len(payload),
        checksum(payload),
        len(KEY),
    )
    return fixed + KEY + mac.tag(fixed, KEY, payload) + payload


def test_signed_frames_written_before_key_ids_still_read_and_are_judged_by_their_mac(
    secret: str,
) -> None:
    key = load_mac_key(ENV)
    reader = Framer("ns", key)
    old = _frame_without_key_id(key, PAYLOAD)
    assert header_length(old[:FIXED_HEADER_BYTES]) == FIXED_HEADER_BYTES + len(KEY) + MAC_BYTES
    dest = memoryview(bytearray(len(PAYLOAD)))
    reader.decode_into(KEY, old, dest)
    assert bytes(dest) == PAYLOAD
    other = _frame_without_key_id(MacKey(os.urandom(32)), PAYLOAD)
    with pytest.raises(CorruptBlock, match="MAC mismatch") as caught:
        reader.decode_into(KEY, other, memoryview(bytearray(len(PAYLOAD))))
    assert not isinstance(caught.value, ForeignBlock), "no key id: nothing says whose it is"


def test_a_key_id_without_a_mac_is_corrupt() -> None:
    frame = bytearray(Framer("ns").encode(KEY, PAYLOAD))
    struct.pack_into("<H", frame, 6, 0x0002)
    with pytest.raises(CorruptBlock, match="a key id without a MAC"):
        Framer("ns").decode_into(KEY, frame, memoryview(bytearray(len(PAYLOAD))))


@pytest.mark.parametrize("flags", [0x0004, 0x8000, 0xFFFF])
def test_unknown_flag_bits_are_refused(flags: int) -> None:
    frame = bytearray(Framer("ns").encode(KEY, PAYLOAD))
    struct.pack_into("<H", frame, 6, flags)
    with pytest.raises(CorruptBlock, match="unknown header flags"):
        Framer("ns").decode_into(KEY, frame, memoryview(bytearray(len(PAYLOAD))))


def test_a_tampered_header_field_fails_the_mac(secret: str) -> None:
    framer = Framer("ns", load_mac_key(ENV))
    frame = bytearray(framer.encode(KEY, PAYLOAD))
    frame[FIXED_HEADER_BYTES] ^= 0x01  # the key's first byte: header check or MAC
    with pytest.raises(CorruptBlock):
        framer.decode_into(KEY, frame, memoryview(bytearray(len(PAYLOAD))))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (None, f"environment variable {ENV} is not set"),
        ("", f"environment variable {ENV} is not set"),
        ("too-short", f"environment variable {ENV} holds 9 bytes; a MAC secret needs at least 32"),
    ],
)
def test_a_missing_or_short_key_is_a_config_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, value: str | None, message: str
) -> None:
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    with pytest.raises(ValueError, match=message) as info:
        MemoryTierConfig(type="memory", mac_key_env=ENV)
    assert value is None or value == "" or value not in str(info.value)


def test_the_key_is_read_when_the_tier_is_made(
    monkeypatch: pytest.MonkeyPatch, secret: str
) -> None:
    config = MemoryTierConfig(type="memory", mac_key_env=ENV)
    view = PrimaryView(bytearray(4096), 4096, "ns")
    assert MemoryTier(config, view).framer.mac
    monkeypatch.delenv(ENV)
    with pytest.raises(ConfigError, match=f"mac_key_env: environment variable {ENV}"):
        MemoryTier(config, view)


def test_a_bad_variable_name_is_refused() -> None:
    with pytest.raises(ValueError, match="not an environment variable name"):
        MemoryTierConfig(type="memory", mac_key_env="NOT A NAME")


def test_the_key_never_shows(secret: str) -> None:
    key = load_mac_key(ENV)
    assert secret not in repr(key)
    config = MemoryTierConfig(type="memory", mac_key_env=ENV)
    assert secret not in repr(config) and secret not in str(config.model_dump())
