"""The units a config writes its sizes in.

pydantic's `ByteSize` reads `2MB` as 2,000,000 bytes and `4Gb` as 4,000,000,000: a
block of 2,000,000 bytes, or a capacity that meant gigabits, is almost surely a
mistake. So, for every size field of the chain (the core's and each tier's, by YAML
path):

- a size in bits (`4Gb`, `512Mbit`, `8gib`: a lowercase `b` is a bit) is an error
  everywhere: read as bits it is 8 times smaller than read as bytes, and no one sizes
  a cache in bits;
- a decimal size (`2MB`, `2kB`, `2M`) is an error for a block size (`layout.block_bytes`:
  a slab row, a frame, a GPU page are binary), and a warning elsewhere (a capacity of
  `500GB` is plausible): the warning names the binary spelling and says to write the
  plain number of bytes to keep the decimal size.

Numbers without a unit are bytes and never questioned.
"""

from __future__ import annotations

import typing
from collections.abc import Iterator, Mapping
from typing import Any

from pydantic import BaseModel, ByteSize, TypeAdapter, ValidationError

from tierkv.config.messages import inner_model, yaml_path
from tierkv.contract.units import unit_hint
from tierkv.layout import KVLayout

BINARY_ONLY: tuple[tuple[type[BaseModel], str], ...] = ((KVLayout, "block_bytes"),)
"""The size fields a decimal unit may not be written in."""

_BYTES = TypeAdapter(ByteSize)


def unit_problems(
    model: type[BaseModel], data: Any, prefix: tuple[Any, ...] = ()
) -> tuple[list[str], list[str]]:
    """(errors, warnings) about the units of the sizes in `data` (a section validated
    by `model`, at YAML path `prefix`), one line each starting with its path. A value
    that is no size at all is left to pydantic's own error."""
    errors: list[str] = []
    warnings: list[str] = []
    for loc, value, binary_only in _written_sizes(model, data, prefix):
        try:
            num_bytes = int(_BYTES.validate_python(value))
        except ValidationError:
            continue
        hint = unit_hint(value, num_bytes, binary_only=binary_only)
        if hint is not None:
            is_error, message = hint
            (errors if is_error else warnings).append(f"{yaml_path(loc)}: {message}")
    return errors, warnings


def _written_sizes(
    model: type[BaseModel], data: Any, loc: tuple[Any, ...]
) -> Iterator[tuple[tuple[Any, ...], str, bool]]:
    """(path, value, binary only) of every size written as a string in `data`."""
    if not isinstance(data, Mapping):
        return
    for name, value in data.items():
        field = model.model_fields.get(name) if isinstance(name, str) else None
        if field is None:
            continue
        where = (*loc, name)
        if _is_size(field.annotation):
            if isinstance(value, str):
                binary_only = any(
                    issubclass(model, owner) and name == field_name
                    for owner, field_name in BINARY_ONLY
                )
                yield where, value, binary_only
            continue
        inner = inner_model(field.annotation)
        if inner is None:
            continue
        if isinstance(value, Mapping):
            yield from _written_sizes(inner, value, where)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                yield from _written_sizes(inner, item, (*where, i))


def _is_size(annotation: Any) -> bool:
    """A `ByteSize` field, `Size` or `Size | None` included."""
    if annotation is ByteSize:
        return True
    return any(_is_size(arg) for arg in typing.get_args(annotation))
