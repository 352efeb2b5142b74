"""Validation errors as one line each, by YAML path, in the words of YAML rather than
pydantic's, with the offending value said once and secrets never shown."""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, Union

from pydantic import BaseModel, ByteSize, ValidationError

from tierkv.contract.redact import is_secret_field, redact_text, redact_url
from tierkv.contract.units import is_negative_size


def yaml_path(loc: tuple[Any, ...]) -> str:
    """`("tiers", 0, "capacity")` -> `tiers[0].capacity`."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def model_at(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class that the error location `loc` points inside."""
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        field = current.model_fields.get(part)
        if field is None:
            return None
        current = inner_model(field.annotation)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def inner_model(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType, list, tuple, typing.Annotated) or origin is not None:
        for arg in typing.get_args(annotation):
            found = inner_model(arg)
            if found is not None:
                return found
    return None


_UNION_TAG = re.compile(
    r"^(bool|int|float|str|bytes|none|list|dict|tuple|set|"
    r"(literal|function-\w+|constrained-\w+|lax-or-strict|json-or-python|is-instance|"
    r"tagged-union|union|nullable|definition-ref|model|chain)(\[.*\])?)$"
)


def _clean_loc(model: type[BaseModel], loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """`loc` without pydantic's union-member tags (`literal['auto']`, `bool`): a user
    wrote `pin_memory`, not `pin_memory.bool`."""
    out: list[Any] = []
    for part in loc:
        if isinstance(part, str) and _UNION_TAG.match(part):
            owner = model_at(model, tuple(out))
            if owner is None or part not in owner.model_fields:
                continue
        out.append(part)
    return tuple(out)


_SHOULD_BE = "Input should be "


def _merge_union_errors(
    errors: list[dict[str, Any]], model: type[BaseModel]
) -> list[dict[str, Any]]:
    """One error per YAML path: the branches of a union (`'auto'` or a boolean) become
    one message, `should be 'auto' or true/false`; a `too_short` on a list whose items
    failed is dropped (the items' errors say what is wrong)."""
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    for err in errors:
        loc = _clean_loc(model, tuple(err["loc"]))
        msg = str(err["msg"])
        if err["type"] in ("bool_parsing", "bool_type"):
            msg = _SHOULD_BE + "true or false"
        if loc in merged:
            first = merged[loc]
            tail = msg[len(_SHOULD_BE) :] if msg.startswith(_SHOULD_BE) else msg
            if tail not in first["msg"]:
                first["msg"] = f"{first['msg']} or {tail}"
            first["type"] = "union"
            continue
        merged[loc] = {**err, "loc": loc, "msg": msg}
    failed_items = {loc[:-2] for loc in merged if len(loc) >= 2}
    failed_items |= {loc[:i] for loc in merged for i in range(len(loc)) if isinstance(loc[i], int)}
    return [
        e for loc, e in merged.items() if not (e["type"] == "too_short" and loc in failed_items)
    ]


def _describe(err: Mapping[str, Any], model: type[BaseModel], prefix: tuple[Any, ...]) -> str:
    loc = tuple(err["loc"])
    path = yaml_path((*prefix, *loc))
    value = err.get("input")
    kind = err["type"]
    if kind == "missing":
        return f"{path}: is required"
    if kind == "extra_forbidden":
        owner = model_at(model, loc[:-1])
        allowed = sorted(owner.model_fields) if owner else []
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        listed = f" (allowed: {', '.join(allowed)})" if allowed else ""
        return f"{path}: unknown field{hint}{listed}"
    if kind == "string_pattern_mismatch" and loc and loc[-1] == "name":
        return (
            f"{path}: {shown(loc, value)} is not a tier name (letters, digits, _ . -; "
            "at most 63, starting with a letter or digit)"
        )
    if kind in ("byte_size", "byte_size_unit"):
        if is_negative_size(value):
            return f"{path}: {shown(loc, value)} is negative; a size must be positive (e.g. 8GiB)"
        return f"{path}: {shown(loc, value)} is not a size (use e.g. 8GiB, 512MiB, 4096)"
    if kind == "greater_than" and _is_size_at(model, loc) and err.get("ctx", {}).get("gt") == 0:
        return f"{path}: {shown(loc, value)} holds nothing; it must be positive (e.g. 1GiB)"
    message = str(err["msg"])
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"{path}: expected a mapping, got {shown(loc, value)}"
    message = _scrub(message, value)
    if kind == "union":
        message = message.replace(_SHOULD_BE, "should be ", 1)
    if isinstance(value, Mapping):  # a check over a whole section: its values may be secrets
        return f"{path}: {message}"
    if message.startswith(repr(value)):  # the validator named the value: say it once
        return f"{path}: {shown(loc, value)}{message[len(repr(value)) :]}"
    return f"{path}: {shown(loc, value)}: {message}"


def _is_size_at(model: type[BaseModel], loc: tuple[Any, ...]) -> bool:
    """Whether the field at `loc` holds a size (a `ByteSize`)."""
    owner = model_at(model, loc[:-1]) if loc else None
    field = owner.model_fields.get(str(loc[-1])) if owner is not None else None
    if field is None:
        return False
    return field.annotation is ByteSize or ByteSize in typing.get_args(field.annotation)


def _userinfo(value: str) -> str | None:
    """The `user:password` of `scheme://user:password@host...` (a password may hold `/`)."""
    if "@" not in value:
        return None
    rest = value.split("://", 1)[1] if "://" in value else value
    info = rest.rsplit("@", 1)[0]
    return info or None


def _scrub(message: str, value: Any) -> str:
    """A validator's own message with every piece of the value's credentials masked
    (a plugin may quote the URL, or a bucket name cut out of it)."""
    message = redact_text(message)
    info = _userinfo(value) if isinstance(value, str) else None
    if info is not None:
        pieces = {info, *re.split(r"[:/@]", info)}
        for piece in sorted(pieces, key=len, reverse=True):
            if len(piece) >= 2:
                message = message.replace(piece, "***")
    return message


_PLAIN_WORD = re.compile(r"^[A-Za-z0-9_.-]{1,40}$")


def briefly(value: Any) -> str:
    """A value an error may quote: a short plain word as written, anything else (a
    mapping, a string that may hold a password) by its kind only."""
    if isinstance(value, str) and _PLAIN_WORD.match(value):
        return repr(value)
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, str):
        return "a string"
    return f"a {type(value).__name__}"


def shown(loc: tuple[Any, ...], value: Any) -> str:
    """`value` as an error message may show it: secrets masked, URLs without passwords."""
    field = str(loc[-1]) if loc else ""
    if is_secret_field(field):
        return "'***'"
    if isinstance(value, str) and ("url" in field.lower() or "://" in value or "@" in value):
        info = _userinfo(value)
        if info is not None and (":" in info or "://" not in value):
            head = value.split("://", 1)[0] + "://" if "://" in value else ""
            masked = f"{info.split(':', 1)[0]}:***" if head else "***"
            return repr(f"{head}{masked}@{value.rsplit('@', 1)[1]}")
        return repr(redact_url(value) if "://" in value else value)
    if isinstance(value, Mapping) or ("url" in field.lower() and not isinstance(value, str)):
        return f"a {type(value).__name__}"
    return repr(value)


def format_validation_error(
    exc: ValidationError, model: type[BaseModel], prefix: tuple[Any, ...] = ()
) -> list[str]:
    """One line per problem, each starting with its YAML path."""
    errors = _merge_union_errors([dict(e) for e in exc.errors()], model)
    return [_describe(err, model, prefix) for err in errors]
