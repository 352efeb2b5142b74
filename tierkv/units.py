"""Sizes and durations with units, as they are written in YAML.

Sizes use pydantic's `ByteSize` (`8GiB`, `512MiB`, `4096`); durations read `250ms`,
`2s`, `1.5m`, `1h`, or a bare number of seconds. Internally everything is bytes and
seconds.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BeforeValidator, ByteSize, Field

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(us|µs|ms|s|m|h)?\s*$")
_SCALE = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(value: object) -> float:
    """Seconds from `250ms`, `2s`, `1m`, `1h` or a plain number of seconds."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration (use e.g. 250ms, 2s, 1m)")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.match(value)):
        seconds = float(m.group(1)) * _SCALE[m.group(2)]
    else:
        raise ValueError(f"{value!r} is not a duration (use e.g. 250ms, 2s, 1m)")
    if seconds < 0:
        raise ValueError(f"{value!r} is negative; a duration must be >= 0")
    return seconds


Duration = Annotated[float, BeforeValidator(parse_duration), Field(ge=0)]
"""A duration in seconds that YAML may write with a unit."""

Size = Annotated[ByteSize, Field(ge=0)]
"""A size in bytes that YAML may write with a unit (`8GiB`)."""


def format_size(num_bytes: int) -> str:
    """`2097152` -> `2MiB`: the shortest exact binary unit, for messages."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes and num_bytes % scale == 0:
            return f"{num_bytes // scale}{unit}"
    return f"{num_bytes}B"


def approx_size(num_bytes: float, *, sep: str = "") -> str:
    """`1572864` -> `1.5MiB` (`1.5 MiB` with `sep=" "`): one decimal in the largest
    binary unit reached, for reports and messages where exactness does not matter."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f}{sep}{unit}"
    return f"{int(num_bytes)}{sep}B"
