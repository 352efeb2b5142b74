"""The YAML configuration of a tier chain, validated with pydantic.

    namespace: llama3-8b-bf16-tp1
    layout: {block_bytes: 2MiB, groups: [{kind: full, block_size: 16}]}
    primary: {capacity: 8GiB, eviction: arc}
    tiers:
      - {type: memory, capacity: 1GiB}

Each item of `tiers` is validated by the `Config` of the plugin its `type` names.
`${VAR}` (or `${VAR:-default}`) in any string expands from the environment; `$$`
writes a literal `$`. Every error names the YAML path and the bad value, all problems
at once: `tiers[1].capacity: '12 parsecs' is not a size (use e.g. 8GiB, 512MiB)`.
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
from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError

from tierkv.errors import ConfigError, PluginImportError, UnknownTierType
from tierkv.layout import KVLayout
from tierkv.primary import PrimaryConfig
from tierkv.redact import redact_url
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
        "hold at once; the rest stays free for stores",
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

    @property
    def primary_blocks(self) -> int:
        return int(self.primary.capacity) // int(self.layout.block_bytes)

    def tier_names(self) -> list[str]:
        """How the cache names each tier, in chain order: its type, or `type-i` (i its
        position) when a type appears more than once."""
        types = [t.type for t in self.tiers]
        return [t if types.count(t) == 1 else f"{t}-{i}" for i, t in enumerate(types)]


# -- environment expansion ---------------------------------------------------------
_ENV = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _expand(value: Any, loc: tuple[Any, ...], env: Mapping[str, str], problems: list[str]) -> Any:
    if isinstance(value, str):

        def sub(m: re.Match[str]) -> str:
            if m.group(0) == "$$":
                return "$"
            name, default = m.group(1), m.group(2)
            if name in env:
                return env[name]
            if default is not None:
                return default
            problems.append(
                f"{_path(loc)}: environment variable {name} is not set "
                f"(set it, or write ${{{name}:-default}})"
            )
            return m.group(0)

        return _ENV.sub(sub, value)
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
    if kind in ("byte_size", "byte_size_unit"):
        return f"{path}: {_shown(loc, value)} is not a size (use e.g. 8GiB, 512MiB, 4096)"
    message = str(err["msg"])
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"{path}: expected a mapping, got {_shown(loc, value)}"
    if isinstance(value, Mapping):  # a check over a whole section: its values may be secrets
        return f"{path}: {message}"
    return f"{path}: {_shown(loc, value)}: {message}"


_SECRET_FIELDS = ("password", "secret", "token", "credential", "passphrase")


def _shown(loc: tuple[Any, ...], value: Any) -> str:
    """`value` as an error message may show it: secrets masked, URLs without passwords."""
    field = str(loc[-1]).lower() if loc else ""
    if any(word in field for word in _SECRET_FIELDS):
        return "'***'"
    if isinstance(value, str) and ("url" in field or "://" in value or "@" in value):
        shown = redact_url(value)
        if shown == value and "@" in value:  # not a URL we could parse: hide the userinfo
            shown = "***@" + value.rsplit("@", 1)[1]
        return repr(shown)
    if isinstance(value, Mapping) or ("url" in field and not isinstance(value, str)):
        return f"a {type(value).__name__}"
    return repr(value)


def format_validation_error(
    exc: ValidationError, model: type[BaseModel], prefix: tuple[Any, ...] = ()
) -> list[str]:
    """One line per pydantic error, each starting with its YAML path."""
    return [_describe(err, model, prefix) for err in exc.errors()]


# -- loading -----------------------------------------------------------------------
def _read_yaml(text: str, source: str | None) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"malformed YAML: {where}{problem}", source=source) from None


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

    tiers: list[TierConfig] = []
    if not isinstance(raw_tiers, list):
        problems.append(f"tiers: expected a list of tier sections, got {raw_tiers!r}")
        raw_tiers = []
    for i, item in enumerate(raw_tiers):
        where = f"tiers[{i}]"
        if not isinstance(item, Mapping):
            problems.append(f"{where}: expected a mapping with a `type`, got {item!r}")
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
            tiers.append(cls.Config.model_validate(dict(item)))
        except ValidationError as exc:
            problems.extend(format_validation_error(exc, cls.Config, ("tiers", i)))

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
        raise error_class(problems, source=source)
    return core.model_copy(update={"tiers": tiers})


def load_config(
    path: str | os.PathLike[str], *, env: Mapping[str, str] | None = None
) -> CacheConfig:
    """Read and validate the YAML file at `path`."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file: {exc.strerror}", source=str(p)) from None
    return parse_config(text, source=str(p), env=env)
