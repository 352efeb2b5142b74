"""Authenticated frames (tierkv.mac, tierkv.framing.Framer): the key comes from the
environment with clear errors, the flags are checked strictly, and a frame made
without the key is refused even when its checksum is right."""

from __future__ import annotations

import os
import struct

import pytest

from tierkv.errors import ConfigError, CorruptBlock
from tierkv.framing import FIXED_HEADER_BYTES, Framer, header_bytes, header_length
from tierkv.keys import make_offload_key
from tierkv.mac import MAC_BYTES, MacKey, load_mac_key
from tierkv.memory_tier import MemoryTier, MemoryTierConfig
from tierkv.slab import PrimaryView

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
    assert framer.header_bytes(KEY) == FIXED_HEADER_BYTES + len(KEY) + MAC_BYTES
    assert header_length(frame[:FIXED_HEADER_BYTES]) == framer.header_bytes(KEY)
    dest = memoryview(bytearray(len(PAYLOAD)))
    framer.decode_into(KEY, frame, dest)
    assert bytes(dest) == PAYLOAD


def test_a_right_checksum_under_the_wrong_key_is_refused(secret: str) -> None:
    reader = Framer("ns", load_mac_key(ENV))
    forged = Framer("ns", MacKey(os.urandom(32))).encode(KEY, PAYLOAD)
    dest = memoryview(bytearray(len(PAYLOAD)))
    with pytest.raises(CorruptBlock, match="MAC mismatch"):
        reader.decode_into(KEY, forged, dest)
    assert bytes(dest) == bytes(len(PAYLOAD)), "the slot is written only after every check"


def test_a_reader_with_a_key_refuses_frames_without_a_mac_and_vice_versa(secret: str) -> None:
    keyed = Framer("ns", load_mac_key(ENV))
    plain = Framer("ns")
    dest = memoryview(bytearray(len(PAYLOAD)))
    with pytest.raises(CorruptBlock, match="carries no MAC but this tier requires one"):
        keyed.decode_into(KEY, plain.encode(KEY, PAYLOAD), dest)
    with pytest.raises(CorruptBlock, match="carries a MAC but this tier has no MAC key"):
        plain.decode_into(KEY, keyed.encode(KEY, PAYLOAD), dest)


@pytest.mark.parametrize("flags", [0x0002, 0x8000, 0xFFFF])
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
