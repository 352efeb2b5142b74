"""Durations and sizes with units."""

from __future__ import annotations

import pytest

from tierkv.units import approx_size, format_size, parse_duration


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
