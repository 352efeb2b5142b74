"""The YAML configuration of a tier chain, validated with pydantic.

    namespace: llama3-8b-bf16-tp1
    layout: {block_bytes: 2MiB, groups: [{kind: full, block_size: 16}]}
    primary: {capacity: 8GiB, eviction: arc}
    tiers:
      - {type: memory, capacity: 1GiB}

Each item of `tiers` is validated by the `Config` of the plugin its `type` names.
`${VAR}` (or `${VAR:-default}`, the default itself may hold `${OTHER}`) in any string
expands from the environment; `$$` writes a literal `$`. Every error names the YAML
path and the bad value, all problems at once:
`tiers[1].capacity: '12 parsecs' is not a size (use e.g. 8GiB, 512MiB)`. A file must be
UTF-8 and may not repeat a key. Secrets (fields named like `password`, the password of
a URL) never appear in an error, and `CacheConfig.model_dump()` masks them.
"""

from __future__ import annotations

import difflib
import os
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    SerializeAsAny,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
)

from tierkv.errors import ConfigError, PluginImportError, UnknownTierType
from tierkv.layout import KVLayout
from tierkv.primary import PrimaryConfig
from tierkv.redact import is_secret_field, mask_secrets, redact_text, redact_url
from tierkv.registry import get_tier_class
from tierkv.tier import TierConfig
from tierkv.units import Duration, format_size


class CacheConfig(BaseModel):
    """A whole tier chain: namespace, KV layout, primary, secondary tiers in order."""

    model_config = ConfigDict(extra="forbid")

    namespace: str = Field(
        min_length=1,
        description="mixed into every stored name: model, tokenizer, dtype, parallel "
        "layout, tenant. Two namespaces never see each other's blocks.",
    )
    layout: KVLayout
    primary: PrimaryConfig
    tiers: list[SerializeAsAny[TierConfig]] = Field(default_factory=list)
    promotion_reserve: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="share of primary slots that promotions (loads from lower tiers) may "
        "hold at once; stores leave the part no promotion holds free for them",
    )
    promotion_wait: Duration = Field(
        default=0.05,
        ge=0,
        description="how long a load may wait in all for primary room to promote its "
        "blocks before the rest is shed as misses: added time to first token vs "
        "recomputing those blocks (0: shed whenever no room is free at that instant)",
    )
    lookup_timeout: Duration | None = Field(
        default=0.05,
        description="a tier that does not answer a lookup in time is a miss (null: no limit)",
    )
    store_timeout: Duration = Field(
        default=30.0,
        gt=0,
        description="how long a store larger than the primary's free room may wait for "
        "cascades to release slots before the rest of it is rejected",
    )
    write_back_max_dirty: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="share of primary slots that may hold blocks not yet written to a "
        "write_back tier; past it they are written back (or, while the tier is down, "
        "dropped and counted)",
    )
    write_back_headroom: float = Field(
        default=0.125,
        ge=0,
        lt=1,
        description="with write_back tiers, demote blocks when free + evictable primary "
        "slots fall below this share",
    )
    close_timeout: Duration = Field(
        default=10.0, description="how long close() lets background jobs finish"
    )

    @model_serializer(mode="wrap")
    def _mask_secrets(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> Any:
        """`model_dump()` / `model_dump_json()` never hold a password: secret fields read
        `***`, URLs keep everything but their password."""
        return mask_secrets(handler(self))

    @property
    def primary_blocks(self) -> int:
        return int(self.primary.capacity) // int(self.layout.block_bytes)

    def tier_names(self) -> list[str]:
        """How the cache names each tier, in chain order: its `name:` when the YAML
        gives one, else its type, or `type-i` (i its position) when several unnamed
        tiers share a type."""
        return tier_names(self.tiers)


PRIMARY_NAME = "cpu"
"""The name the primary goes by in stats, metrics and load sources: no tier may take it."""


def tier_names(tiers: list[TierConfig]) -> list[str]:
    """See `CacheConfig.tier_names`."""
    unnamed = [t.type for t in tiers if t.name is None]
    return [
        t.name
        if t.name is not None
        else (t.type if unnamed.count(t.type) == 1 else f"{t.type}-{i}")
        for i, t in enumerate(tiers)
    ]


def _name_problems(tiers: list[tuple[int, TierConfig]]) -> list[str]:
    """Tier names must be unique and leave `cpu` to the primary."""
    configs = [t for _, t in tiers]
    names = tier_names(configs)
    problems = []
    first: dict[str, int] = {}
    for (i, config), name in zip(tiers, names):
        where = f"tiers[{i}].name" if config.name is not None else f"tiers[{i}]"
        if name == PRIMARY_NAME:
            problems.append(f"{where}: {name!r} is the primary's name; choose another")
        elif name in first:
            problems.append(
                f"{where}: {name!r} is already the name of tiers[{first[name]}]; tier "
                "names must be unique (set `name:` on one of them)"
            )
        else:
            first[name] = i
    return problems


def _path_problems(tiers: list[tuple[int, TierConfig]]) -> list[str]:
    """Two tiers that keep files may not share a directory (or nest one in another):
    each would take the other's files for its own."""
    seen: list[tuple[int, Path]] = []
    problems = []
    for i, config in tiers:
        raw = getattr(config, "path", None)
        if not isinstance(raw, (str, os.PathLike)):
            continue
        path = Path(os.path.abspath(os.path.expanduser(os.fspath(raw))))
        for j, other in seen:
            if path == other:
                problems.append(f"tiers[{i}].path: {str(path)!r} is also the path of tiers[{j}]")
            elif other in path.parents or path in other.parents:
                problems.append(
                    f"tiers[{i}].path: {str(path)!r} and tiers[{j}].path {str(other)!r} "
                    "nest; give each tier a directory of its own"
                )
        seen.append((i, path))
    return problems


# -- environment expansion ---------------------------------------------------------
_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _closing_brace(text: str, start: int) -> int:
    """Index of the `}` closing a `${` whose body starts at `start` (nested `${...}`
    counted), or -1."""
    depth = 0
    i = start
    while i < len(text):
        if text.startswith("${", i):
            depth += 1
            i += 2
            continue
        if text[i] == "}":
            if depth == 0:
                return i
            depth -= 1
        i += 1
    return -1


def _expand_text(
    text: str, loc: tuple[Any, ...], env: Mapping[str, str], problems: list[str]
) -> str:
    """`${VAR}`, `${VAR:-default}` (the default expanded in turn) and `$$`."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
            continue
        if text.startswith("${", i) and (m := _VAR_NAME.match(text, i + 2)):
            name, after = m.group(0), m.end()
            if text.startswith("}", after):
                if name in env:
                    out.append(env[name])
                else:
                    problems.append(
                        f"{_path(loc)}: environment variable {name} is not set "
                        f"(set it, or write ${{{name}:-default}})"
                    )
                    out.append(text[i : after + 1])
                i = after + 1
                continue
            if text.startswith(":-", after) and (end := _closing_brace(text, after + 2)) >= 0:
                default = text[after + 2 : end]
                out.append(env[name] if name in env else _expand_text(default, loc, env, problems))
                i = end + 1
                continue
        out.append(text[i])
        i += 1
    return "".join(out)


def _expand(value: Any, loc: tuple[Any, ...], env: Mapping[str, str], problems: list[str]) -> Any:
    if isinstance(value, str):
        return _expand_text(value, loc, env, problems)
    if isinstance(value, dict):
        return {k: _expand(v, (*loc, k), env, problems) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v, (*loc, i), env, problems) for i, v in enumerate(value)]
    return value


# -- error formatting --------------------------------------------------------------
def _model_at(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
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
        current = _inner_model(field.annotation)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _inner_model(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType, list, tuple, typing.Annotated) or origin is not None:
        for arg in typing.get_args(annotation):
            found = _inner_model(arg)
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
            owner = _model_at(model, tuple(out))
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
    path = _path((*prefix, *loc))
    value = err.get("input")
    kind = err["type"]
    if kind == "missing":
        return f"{path}: is required"
    if kind == "extra_forbidden":
        owner = _model_at(model, loc[:-1])
        allowed = sorted(owner.model_fields) if owner else []
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        listed = f" (allowed: {', '.join(allowed)})" if allowed else ""
        return f"{path}: unknown field{hint}{listed}"
    if kind == "string_pattern_mismatch" and loc and loc[-1] == "name":
        return (
            f"{path}: {_shown(loc, value)} is not a tier name (letters, digits, _ . -; "
            "at most 63, starting with a letter or digit)"
        )
    if kind in ("byte_size", "byte_size_unit"):
        return f"{path}: {_shown(loc, value)} is not a size (use e.g. 8GiB, 512MiB, 4096)"
    message = str(err["msg"])
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"{path}: expected a mapping, got {_shown(loc, value)}"
    message = _scrub(message, value)
    if kind == "union":
        message = message.replace(_SHOULD_BE, "should be ", 1)
    if isinstance(value, Mapping):  # a check over a whole section: its values may be secrets
        return f"{path}: {message}"
    return f"{path}: {_shown(loc, value)}: {message}"


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


def _briefly(value: Any) -> str:
    """A value an error may quote: a short plain word as written, anything else (a
    mapping, a string that may hold a password) by its kind only."""
    if isinstance(value, str) and _PLAIN_WORD.match(value):
        return repr(value)
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, str):
        return "a string"
    return f"a {type(value).__name__}"


def _shown(loc: tuple[Any, ...], value: Any) -> str:
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


# -- loading -----------------------------------------------------------------------
class StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a mapping may not repeat a key (PyYAML keeps
    the last one silently; a config where `capacity` is written twice is a mistake)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                earlier = seen.get(key)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if earlier is not None:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} (first at line {earlier.start_mark.line + 1})",
                    key_node.start_mark,
                )
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


def _duplicate_keys(node: yaml.Node | None, loc: tuple[Any, ...]) -> list[str]:
    """Every repeated key in the document, by YAML path."""
    problems: list[str] = []
    if isinstance(node, yaml.MappingNode):
        first: dict[tuple[str, str], int] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                continue
            ident = (key_node.tag, key_node.value)
            line = key_node.start_mark.line + 1
            if ident in first:
                problems.append(
                    f"{_path((*loc, key_node.value))}: duplicate key (line {line}; first at "
                    f"line {first[ident]}); write each key once"
                )
            else:
                first[ident] = line
            problems += _duplicate_keys(value_node, (*loc, key_node.value))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            problems += _duplicate_keys(item, (*loc, i))
    return problems


def _read_yaml(text: str, source: str | None) -> Any:
    loader = StrictLoader(text)
    try:
        node = loader.get_single_node()
        duplicates = _duplicate_keys(node, ())
        if duplicates:
            raise ConfigError(duplicates, source=source)
        return None if node is None else loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"malformed YAML: {where}{problem}", source=source) from None
    finally:
        loader.dispose()


def parse_config(
    data: str | Mapping[str, Any],
    *,
    source: str | None = None,
    env: Mapping[str, str] | None = None,
) -> CacheConfig:
    """Validate a config given as YAML text or as an already-parsed mapping."""
    raw = _read_yaml(data, source) if isinstance(data, str) else data
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"(top level): expected a mapping with namespace, layout, primary, tiers; "
            f"got {type(raw).__name__}",
            source=source,
        )
    problems: list[str] = []
    expanded = _expand(dict(raw), (), os.environ if env is None else env, problems)
    raw_tiers = expanded.pop("tiers", None) or []
    error_class: type[ConfigError] = ConfigError

    core: CacheConfig | None = None
    try:
        core = CacheConfig.model_validate(expanded)
    except ValidationError as exc:
        problems.extend(format_validation_error(exc, CacheConfig))

    tiers: list[tuple[int, TierConfig]] = []
    if not isinstance(raw_tiers, list):
        problems.append(
            f"tiers: expected a list of tier sections (`- {{type: ...}}` items), got "
            f"{_briefly(raw_tiers)}"
        )
        raw_tiers = []
    for i, item in enumerate(raw_tiers):
        where = f"tiers[{i}]"
        if not isinstance(item, Mapping):
            problems.append(
                f"{where}: expected a mapping with a `type` (e.g. {{type: nvme, ...}}), got "
                f"{_briefly(item)}"
            )
            continue
        type_name = item.get("type")
        if not isinstance(type_name, str) or not type_name:
            problems.append(f"{where}.type: is required (the tier type, e.g. memory, nvme)")
            continue
        try:
            cls = get_tier_class(type_name)
        except UnknownTierType as exc:
            problems.append(f"{where}.type: {exc.problems[0]}")
            error_class = UnknownTierType
            continue
        except PluginImportError as exc:
            problems.append(f"{where}.type: {exc.problems[0]}")
            if error_class is ConfigError:
                error_class = PluginImportError
            continue
        try:
            tiers.append((i, cls.Config.model_validate(dict(item))))
        except ValidationError as exc:
            problems.extend(format_validation_error(exc, cls.Config, ("tiers", i)))
    problems += _name_problems(tiers) + _path_problems(tiers)

    if core is not None and core.primary_blocks < 1:
        problems.append(
            f"primary.capacity: {format_size(int(core.primary.capacity))} holds no block of "
            f"{format_size(int(core.layout.block_bytes))}; raise it to at least one block"
        )
    if problems or core is None:
        # a value whose variable was unset also fails validation: say it once
        unset = {
            p.split(": environment variable", 1)[0]
            for p in problems
            if ": environment variable " in p
        }
        problems = [
            p for p in problems if ": environment variable " in p or p.split(":", 1)[0] not in unset
        ]
        raise error_class([redact_text(p) for p in problems], source=source)
    return core.model_copy(update={"tiers": [t for _, t in tiers]})


def load_config(
    path: str | os.PathLike[str], *, env: Mapping[str, str] | None = None
) -> CacheConfig:
    """Read and validate the YAML file at `path`."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config file: {exc.strerror}", source=str(p)) from None
    return parse_config(decode_utf8(data, str(p)), source=str(p), env=env)


def decode_utf8(data: bytes, source: str | None = None) -> str:
    """The text of a config file, or a ConfigError naming the first byte that is not
    UTF-8 by line and column."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        before = data[: exc.start]
        line = before.count(b"\n") + 1
        column = exc.start - (before.rfind(b"\n") + 1) + 1
        raise ConfigError(
            f"line {line}, column {column}: byte 0x{data[exc.start]:02x} is not UTF-8; "
            "save the file as UTF-8",
            source=source,
        ) from None
