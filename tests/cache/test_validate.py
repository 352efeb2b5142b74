"""check_keys: the fast all-good pass and the message naming the first bad key."""

from __future__ import annotations

import pytest

from tierkv.cache.validate import check_keys
from tierkv.contract.keys import make_offload_key

GOOD = [make_offload_key(bytes([i]) * 8, 0) for i in range(5)]


class Key(bytes):
    """A bytes subclass (what a NewType at runtime is not, but a caller may pass)."""


def test_good_keys_and_no_keys_pass() -> None:
    check_keys(GOOD, "keys")
    check_keys([], "keys")
    check_keys([Key(k) for k in GOOD], "keys")  # subclasses of bytes are keys too


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("a-string-key", r"keys\[3\] must be bytes \(an OffloadKey\), got str"),
        (b"\x00\x00\x00\x01", r"keys\[3\] is 4 bytes; an offload key is a block hash plus 4"),
        (bytearray(b"123456789"), r"keys\[3\] must be bytes \(an OffloadKey\), got bytearray"),
    ],
)
def test_the_first_bad_key_is_named_wherever_it_is(bad: object, message: str) -> None:
    keys = [*GOOD[:3], bad, *GOOD[3:]]
    with pytest.raises(ValueError, match=message):
        check_keys(keys, "keys")  # type: ignore[arg-type]
