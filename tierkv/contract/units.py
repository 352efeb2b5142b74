"""Sizes and durations with units, as they are written in YAML.

Sizes use pydantic's `ByteSize` (`8GiB`, `512MiB`, `4096`); durations read `250ms`,
`2s`, `1.5m`, `1h`, or a bare number of seconds. Internally everything is bytes and
seconds.

`ByteSize` also reads decimal units (`2MB` is 2,000,000 bytes, and so is `2M`) and
reads `Gb` as gigabytes. `size_unit` says which kind a written size is, and
`unit_hint` what to tell its author: the config (`tierkv.config.sizes`) makes a decimal
block size and any size in bits an error, and warns about a decimal size elsewhere.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BeforeValidator, ByteSize, Field, TypeAdapter

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(us|µs|ms|s|m|h)?\s*$")
_SCALE = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(value: object) -> float:
    """Seconds from `250ms`, `2s`, `1m`, `1h` or a plain number of seconds. A message
    says the value once, first: the config puts only its YAML path before it."""
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
"""A size in bytes that YAML may write with a unit (`8GiB`). Write binary units
(`KiB`, `MiB`, `GiB`, `TiB`): a chain's config warns about decimal ones (`GB`) and
refuses bits (`Gb`)."""

SizeUnit = Literal["binary", "decimal", "bits"]

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]+)\s*$")
_PREFIXES = "kmgtpe"
_BYTES = TypeAdapter(ByteSize)


def size_unit(value: object) -> SizeUnit | None:
    """How the unit of a size as written counts: `2MiB` binary; `2MB`, `2kB`, `2M`
    decimal (powers of 1000); `2Mb`, `2Gbit` bits (a lowercase `b` is a bit, though
    pydantic reads `2Mb` as 2,000,000 bytes). None for a plain number, bytes (`512B`)
    or anything that is not a size."""
    if not isinstance(value, str) or not (m := _SIZE.match(value)):
        return None
    unit = m.group(2)
    prefix = unit[0].lower()
    if unit.lower() in ("b", "bit") or prefix not in _PREFIXES:
        return None
    rest = unit[1:]
    if rest.lower() in ("bit", "ibit") or rest in ("b", "ib"):
        return "bits"
    if rest.lower() == "ib" and rest[-1] == "B":
        return "binary"
    if rest in ("", "B"):
        return "decimal"
    return None


def binary_spelling(value: str) -> str:
    """`2MB`, `2Mb`, `2M`, `2Gbit` -> `2MiB`, `2GiB`: the same number in the binary
    unit of the same prefix, as a hint of what was probably meant."""
    m = _SIZE.match(value)
    assert m is not None, value
    return f"{m.group(1)}{m.group(2)[0].upper()}iB"


def unit_hint(value: object, num_bytes: int, *, binary_only: bool) -> tuple[bool, str] | None:
    """What to tell the author of a size written as `value` (read as `num_bytes`):
    None when its unit is binary or it has none, else (is an error, the message). A
    size in bits is always an error; a decimal one is an error where `binary_only`
    (a block size) and a warning elsewhere. The message starts with the value, which
    it says once."""
    kind = size_unit(value)
    if kind is None or kind == "binary":
        return None
    assert isinstance(value, str)
    meant = binary_spelling(value)
    if kind == "bits":
        why = "" if value.rstrip().lower().endswith("bit") else " (a lowercase b is a bit)"
        return True, (
            f"{value!r} is a size in bits{why}; sizes are in bytes: did you mean {meant!r}?"
        )
    if binary_only:
        return True, (
            f"{value!r} is {num_bytes:,} bytes (decimal); block sizes are binary: "
            f"did you mean {meant!r}?"
        )
    exact = int(_BYTES.validate_python(meant))
    return False, (
        f"{value!r} is {num_bytes:,} bytes (decimal); did you mean {meant!r} "
        f"({exact:,} bytes)? Write {num_bytes} to keep this size"
    )


def is_negative_size(value: object) -> bool:
    """Whether `value` is a size with a minus sign (`-1GiB`, `-5`): a size that names
    no room, which deserves "must be positive" rather than "is not a size"."""
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return value < 0
    if not isinstance(value, str) or not value.strip().startswith("-"):
        return False
    try:
        _BYTES.validate_python(value.strip()[1:])
    except ValueError:
        return False
    return True


def parse_size(value: object, *, binary_only: bool = False) -> tuple[int, str | None]:
    """Bytes from a size written in YAML or on the command line, and a warning to show
    (None when there is nothing to say). The one parser of both: pydantic's `ByteSize`
    for the number, `unit_hint` for the unit. Raises ValueError, its message starting
    with the value, for what is no size, a negative size, a size in bits, and a decimal
    size where `binary_only` (a block size): `'2MB' is 2,000,000 bytes (decimal); block
    sizes are binary: did you mean '2MiB'?`."""
    if is_negative_size(value):
        raise ValueError(f"{value!r} is negative; a size must be positive (e.g. 8GiB)")
    try:
        num_bytes = int(_BYTES.validate_python(value))
    except ValueError:
        raise ValueError(f"{value!r} is not a size (use e.g. 8GiB, 512MiB, 4096)") from None
    hint = unit_hint(value, num_bytes, binary_only=binary_only)
    if hint is None:
        return num_bytes, None
    is_error, message = hint
    if is_error:
        raise ValueError(message)
    return num_bytes, message


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
