"""Durations and sizes with units."""

from __future__ import annotations

import pytest

from tierkv.contract.units import approx_size, format_size, parse_duration, size_unit, unit_hint


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("250ms", 0.25),
        ("2s", 2.0),
        ("1.5m", 90.0),
        ("1h", 3600.0),
        (3, 3.0),
        ("10us", 1e-5),
        ("0.5", 0.5),
    ],
)
def test_durations_parse(text: object, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["fast", "5 parsecs", True, "-1s", -2, None])
def test_bad_durations_are_rejected(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_duration(bad)


def test_format_size_picks_exact_unit() -> None:
    assert format_size(2 * 2**20) == "2MiB"
    assert format_size(3 * 2**30) == "3GiB"
    assert format_size(1536) == "1536B"
    assert format_size(0) == "0B"


def test_approx_size_rounds_to_one_decimal_in_the_largest_unit() -> None:
    assert approx_size(1536 << 10) == "1.5MiB"
    assert approx_size(3 << 40, sep=" ") == "3.0 TiB"
    assert approx_size(2048) == "2.0KiB"
    assert approx_size(100, sep=" ") == "100 B"


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("2MiB", "binary"),
        ("2 MIB", "binary"),
        ("1.5GiB", "binary"),
        ("2MB", "decimal"),
        ("2kB", "decimal"),
        ("2M", "decimal"),
        ("4Gb", "bits"),
        ("8gib", "bits"),
        ("512Mbit", "bits"),
        ("4096", None),
        ("512B", None),
        ("512b", None),
        ("12 parsecs", None),
        (4096, None),
    ],
)
def test_size_unit_tells_binary_decimal_and_bits_apart(text: object, kind: str | None) -> None:
    assert size_unit(text) == kind


def test_unit_hint_names_the_binary_spelling_and_says_the_value_once() -> None:
    assert unit_hint("2MiB", 2 << 20, binary_only=True) is None
    assert unit_hint("2MB", 2_000_000, binary_only=True) == (
        True,
        "'2MB' is 2,000,000 bytes (decimal); block sizes are binary: did you mean '2MiB'?",
    )
    assert unit_hint("4GB", 4 * 10**9, binary_only=False) == (
        False,
        "'4GB' is 4,000,000,000 bytes (decimal); did you mean '4GiB' (4,294,967,296 bytes)? "
        "Write 4000000000 to keep this size",
    )
    for binary_only in (True, False):
        assert unit_hint("4Gb", 4 * 10**9, binary_only=binary_only) == (
            True,
            "'4Gb' is a size in bits (a lowercase b is a bit); sizes are in bytes: "
            "did you mean '4GiB'?",
        )


def test_parse_size_is_the_one_parser_of_yaml_and_cli() -> None:
    from tierkv.contract.units import parse_size

    assert parse_size("2MiB") == (2 << 20, None)
    assert parse_size(4096, binary_only=True) == (4096, None)
    num_bytes, warning = parse_size("2MB")
    assert num_bytes == 2_000_000 and warning is not None and "'2MiB'" in warning
    with pytest.raises(ValueError, match="block sizes are binary: did you mean '2MiB'"):
        parse_size("2MB", binary_only=True)
    with pytest.raises(ValueError, match="is negative; a size must be positive"):
        parse_size("-1GiB")
    with pytest.raises(ValueError, match="is not a size"):
        parse_size("lots")
