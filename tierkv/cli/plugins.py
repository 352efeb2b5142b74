"""`tierkv plugins`: the installed tier types, the package and version of each, its
class and its config fields with defaults."""

from __future__ import annotations

import argparse
from enum import Enum
from typing import TYPE_CHECKING, Any

from tierkv.cli.common import print_json

if TYPE_CHECKING:  # imported when the command runs: `tierkv --help` stays quick
    from pydantic.fields import FieldInfo

    from tierkv.contract.tier import TierConfig


def add_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    pl = sub.add_parser(
        "plugins",
        parents=parents,
        help="installed tier types and their config fields",
        description="List the tier types installed (entry points of the tierkv.tiers group "
        "and registered classes): the package and version that provides each, its class, "
        "its own config fields with defaults, and the fields every tier takes. Exit 1 "
        "if a plugin fails to import.",
    )
    pl.add_argument(
        "--json", action="store_true", help="print as JSON (defaults typed: bytes, seconds)"
    )
    pl.set_defaults(func=run)


def _default_text(info: FieldInfo) -> str:
    """A field's default as it would be written in YAML."""
    from pydantic import ByteSize

    from tierkv.contract.units import format_size, parse_duration

    if info.is_required():
        return "(required)"
    value = info.get_default(call_default_factory=True)
    duration = any(getattr(m, "func", None) is parse_duration for m in info.metadata)
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, ByteSize) or (_unit(info) == "bytes" and isinstance(value, int)):
        return format_size(int(value))  # a plugin may write `default=1 << 20` for a Size
    if isinstance(value, (int, float)):
        text = f"{value:g}"
        return f"{text}s" if duration else text
    if isinstance(value, Enum):
        return str(value.value)
    return str(value)


def _default_value(info: FieldInfo) -> Any:
    """A field's default as JSON: numbers and booleans typed, sizes in bytes, durations
    in seconds, None for none or required."""
    if info.is_required():
        return None
    value = info.get_default(call_default_factory=True)
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, int) and not isinstance(value, bool) and _unit(info) == "bytes":
        return int(value)  # a ByteSize, or a plugin's `default=1 << 20`
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _unit(info: FieldInfo) -> str | None:
    from pydantic import ByteSize

    from tierkv.contract.units import parse_duration

    if any(getattr(m, "func", None) is parse_duration for m in info.metadata):
        return "seconds"
    annotation = info.annotation
    args = getattr(annotation, "__args__", ())
    if annotation is ByteSize or ByteSize in args:
        return "bytes"
    return None


def _fields(model: type[TierConfig], skip: set[str]) -> dict[str, dict[str, Any]]:
    return {
        name: {
            "default": _default_value(info),
            "default_text": _default_text(info),
            "unit": _unit(info),
            "required": info.is_required(),
            "description": info.description or "",
        }
        for name, info in model.model_fields.items()
        if name not in skip
    }


def run(args: argparse.Namespace) -> int:
    from tierkv.demo.report import render

    report, broken = _plugins_report()
    if args.json:
        print_json(report)
    else:
        render(_text_blocks(report))
    return 1 if broken else 0


def _plugins_report() -> tuple[dict[str, Any], list[str]]:
    """The fields every tier takes, and per installed type its package, class and own
    fields (or the error its import raised); and the names of the broken types."""
    from tierkv.contract.errors import ConfigError
    from tierkv.contract.tier import TierConfig
    from tierkv.registry import get_tier_class, installed_tiers

    common = set(TierConfig.model_fields)
    report: dict[str, Any] = {
        "common_fields": _fields(TierConfig, {"type"}),
        "types": {},
    }
    broken = []
    for name, info in installed_tiers().items():
        entry: dict[str, Any] = {
            "distribution": info.distribution,
            "version": info.version,
            "target": info.target,
        }
        try:
            cls = get_tier_class(name)
            entry["fields"] = _fields(cls.Config, common)
            entry["installation"] = cls.installation()
        except ConfigError as exc:
            entry["error"] = exc.problems[0]
            broken.append(name)
        report["types"][name] = entry
    return report, broken


def _text_blocks(report: dict[str, Any]) -> list[Any]:
    """The report for a person: the installed types, the known ones not installed
    (with what to install), each type's own fields, then the common fields."""
    from tierkv.demo.report import TextTable
    from tierkv.registry import KNOWN_TIER_PACKAGES, install_hint

    rows = []
    for name, entry in report["types"].items():
        origin = (
            f"{entry['distribution']} {entry['version']}" if entry["distribution"] else "registered"
        )
        rows.append([name, origin, entry["target"]])
    blocks: list[Any] = [
        TextTable(["type", "package", "class"], rows, title="installed tier types", align="lll")
    ]
    missing = [t for t in KNOWN_TIER_PACKAGES if t not in report["types"]]
    if missing:
        blocks.append("not installed: " + ", ".join(f"{t} ({install_hint(t)})" for t in missing))
    for name, entry in report["types"].items():
        blocks.append("")
        if "error" in entry:
            blocks.append(f"{name}: BROKEN: {entry['error']}")
        elif not entry["fields"]:
            blocks.append(f"{name}: no fields of its own")
        else:
            blocks.append(_fields_table(entry["fields"], f"{name}: its own fields"))
        for fact, value in entry.get("installation", {}).items():
            blocks.append(f"{name}: {fact}: {value}")
    blocks.append("")
    blocks.append(_fields_table(report["common_fields"], "every tier also takes"))
    return blocks


def _fields_table(fields: dict[str, dict[str, Any]], title: str) -> Any:
    """Config fields with their defaults and descriptions, as a table."""
    from tierkv.demo.report import TextTable

    return TextTable(
        ["field", "default", "description"],
        [[f, d["default_text"], d["description"]] for f, d in fields.items()],
        title=title,
        align="lll",
    )
