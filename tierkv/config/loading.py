"""Reading a chain: YAML text or a mapping in, a `CacheConfig` or one `ConfigError`
listing every problem out."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from tierkv.config.checks import name_problems, path_problems, privacy_problems
from tierkv.config.environment import expand
from tierkv.config.machine import fit_problems
from tierkv.config.messages import briefly, format_validation_error
from tierkv.config.model import CacheConfig, tier_names
from tierkv.config.reading import decode_utf8, read_yaml
from tierkv.config.sizes import unit_problems
from tierkv.contract.errors import ConfigError, PluginImportError, UnknownTierType
from tierkv.contract.redact import redact_text
from tierkv.contract.tier import TierConfig
from tierkv.contract.units import format_size
from tierkv.primary import PrimaryConfig
from tierkv.quotas.config import PRIMARY_KEY, quota_problems
from tierkv.registry import get_tier_class

logger = logging.getLogger(__name__)


class _Problems:
    """What a config got wrong so far, and the error class that says it best."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.warnings: list[str] = []
        self.error_class: type[ConfigError] = ConfigError

    def add_units(self, errors: list[str], warnings: list[str]) -> None:
        """Unit problems, except at a path that already has an error (a `0MB` block
        is first of all not positive)."""
        failed = {e.split(": ", 1)[0] for e in self.errors}
        self.errors += [e for e in errors if e.split(": ", 1)[0] not in failed]
        self.warnings += warnings


def parse_config(
    data: str | Mapping[str, Any],
    *,
    source: str | None = None,
    env: Mapping[str, str] | None = None,
    check_machine: bool = False,
) -> CacheConfig:
    """Validate a config given as YAML text or as an already-parsed mapping.

    Every problem is reported at once, by YAML path, in one `ConfigError`; warnings
    (a decimal size: `tierkv.config.sizes`) go to this module's logger, one record
    each. With `check_machine`, sizes are also checked against this machine
    (`tierkv.config.machine`: the primary against its memory, disk tiers against their
    filesystems; no tier directory other users can write: `checks.privacy_problems`)
    beside the structural checks: on every field that parsed, so a
    capacity that is itself invalid is checked once it is fixed."""
    raw = read_yaml(data, source) if isinstance(data, str) else data
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"(top level): expected a mapping with namespace, layout, primary, tiers; "
            f"got {type(raw).__name__}",
            source=source,
        )
    found = _Problems()
    expanded = expand(dict(raw), (), os.environ if env is None else env, found.errors)
    raw_tiers = expanded.pop("tiers", None) or []

    core: CacheConfig | None = None
    try:
        core = CacheConfig.model_validate(expanded)
    except ValidationError as exc:
        found.errors.extend(format_validation_error(exc, CacheConfig))
    found.add_units(*unit_problems(CacheConfig, expanded))

    tiers = _parse_tiers(raw_tiers, found)
    found.errors += name_problems(tiers) + path_problems(tiers)
    if core is not None and core.tenants.quotas and len(tiers) == len(raw_tiers):
        found.errors += _quota_problems(core, [t for _, t in tiers])
    if core is not None and core.primary_blocks < 1:
        found.errors.append(
            f"primary.capacity: {format_size(int(core.primary.capacity))} holds no block of "
            f"{format_size(int(core.layout.block_bytes))}; raise it to at least one block"
        )
    if check_machine:
        found.errors += fit_problems(_primary_capacity(core, expanded), tiers)
        found.errors += privacy_problems(tiers)

    for warning in found.warnings:
        logger.warning("%s%s", f"{source}: " if source else "", redact_text(warning))
    if found.errors or core is None:
        raise found.error_class([redact_text(p) for p in _unset_once(found.errors)], source=source)
    return core.model_copy(update={"tiers": [t for _, t in tiers]})


def _quota_problems(core: CacheConfig, tiers: list[TierConfig]) -> list[str]:
    """`tenants.quotas` against the chain (`tierkv.quotas.config.quota_problems`)."""
    names = tier_names(tiers)
    if PRIMARY_KEY in names:
        return [
            f"tenants.quotas: {PRIMARY_KEY!r} means the primary tier, and a tier is named "
            f"{PRIMARY_KEY!r} too: rename that tier (its `name:`)"
        ]
    capacities: dict[str, int | None] = {PRIMARY_KEY: int(core.primary.capacity)}
    for name, tier in zip(names, tiers):
        capacity = getattr(tier, "capacity", None)
        capacities[name] = int(capacity) if isinstance(capacity, int) else None
    return quota_problems(core.tenants.quotas, capacities, int(core.layout.block_bytes))


def _parse_tiers(raw_tiers: Any, found: _Problems) -> list[tuple[int, TierConfig]]:
    """The tier sections that validated, each with its index in the YAML list; the
    others' problems go to `found`."""
    tiers: list[tuple[int, TierConfig]] = []
    if not isinstance(raw_tiers, list):
        found.errors.append(
            f"tiers: expected a list of tier sections (`- {{type: ...}}` items), got "
            f"{briefly(raw_tiers)}"
        )
        return tiers
    for i, item in enumerate(raw_tiers):
        where = f"tiers[{i}]"
        if not isinstance(item, Mapping):
            found.errors.append(
                f"{where}: expected a mapping with a `type` (e.g. {{type: nvme, ...}}), got "
                f"{briefly(item)}"
            )
            continue
        type_name = item.get("type")
        if not isinstance(type_name, str) or not type_name:
            found.errors.append(f"{where}.type: is required (the tier type, e.g. memory, nvme)")
            continue
        try:
            cls = get_tier_class(type_name)
        except UnknownTierType as exc:
            found.errors.append(f"{where}.type: {exc.problems[0]}")
            found.error_class = UnknownTierType
            continue
        except PluginImportError as exc:
            found.errors.append(f"{where}.type: {exc.problems[0]}")
            if found.error_class is ConfigError:
                found.error_class = PluginImportError
            continue
        try:
            tiers.append((i, cls.Config.model_validate(dict(item))))
        except ValidationError as exc:
            found.errors.extend(format_validation_error(exc, cls.Config, ("tiers", i)))
        found.add_units(*unit_problems(cls.Config, item, ("tiers", i)))
    return tiers


def _primary_capacity(core: CacheConfig | None, expanded: Mapping[str, Any]) -> int | None:
    """The primary's capacity when the primary section is valid, even where another
    section is not; None when it is not."""
    if core is not None:
        return int(core.primary.capacity)
    try:
        return int(PrimaryConfig.model_validate(expanded.get("primary")).capacity)
    except ValidationError:
        return None


def _unset_once(problems: list[str]) -> list[str]:
    """A value whose environment variable was unset also fails validation: say it once."""
    unset_mark = ": environment variable "
    unset = {p.split(unset_mark, 1)[0] for p in problems if unset_mark in p}
    return [p for p in problems if unset_mark in p or p.split(":", 1)[0] not in unset]


def load_config(
    path: str | os.PathLike[str],
    *,
    env: Mapping[str, str] | None = None,
    check_machine: bool = False,
) -> CacheConfig:
    """Read and validate the YAML file at `path` (see `parse_config`)."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config file: {exc.strerror}", source=str(p)) from None
    return parse_config(
        decode_utf8(data, str(p)), source=str(p), env=env, check_machine=check_machine
    )
