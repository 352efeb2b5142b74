"""What every command shares: the usage error, argument types, the chain a command
runs on, JSON output and one-line messages."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections.abc import Callable, Iterator
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierkv.contract.errors import ConfigError

if TYPE_CHECKING:  # the config imports torch: `tierkv --help` must not wait for it
    from tierkv.config import CacheConfig

DEFAULT_SECONDARY: dict[str, Any] = {"type": "nvme", "capacity": "4GiB", "fsync": "never"}
"""The tier of the default chain, under a temporary directory (`path` is added).
fsync is off: the directory is deleted when the command ends."""
FALLBACK_SECONDARY: dict[str, Any] = {"type": "memory", "capacity": "4GiB"}
"""Used instead when tierkv-cache-nvme is not installed."""


class UsageError(Exception):
    """Bad options (exit code 2)."""


# -- argument types -----------------------------------------------------------------------
def _sized(text: str, *, binary_only: bool) -> int:
    from tierkv.contract.units import parse_size

    try:
        num_bytes, warning = parse_size(text, binary_only=binary_only)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if warning:
        print(f"tierkv: warning: {warning}", file=sys.stderr)
    return num_bytes


def size(text: str) -> int:
    """`1MiB`, `256MiB`, `4096`: bytes, read as a YAML size is (`parse_size`): a size in
    bits is refused, a decimal one (`2MB`) warned about with its binary spelling."""
    return _sized(text, binary_only=False)


def block_size(text: str) -> int:
    """A block size: as `size`, and a decimal unit is refused as in the YAML's
    `block_bytes` (`2MB`: did you mean '2MiB'?)."""
    return _sized(text, binary_only=True)


def at_least(minimum: int) -> Callable[[str], int]:
    """An integer no smaller than `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text} must be at least {minimum}")
        return value

    return parse


positive = at_least(1)
non_negative = at_least(0)


def port(text: str) -> int:
    value = non_negative(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a TCP port (0-65535)")
    return value


# -- the chain a command runs on ------------------------------------------------------------
def default_chain(directory: Path, *, primary: str = "8MiB") -> CacheConfig:
    """The primary plus an nvme tier under `directory` (the memory tier when
    tierkv-cache-nvme is not installed). Layout and namespace are placeholders: the demo
    and the bench set their own."""
    from tierkv.config import parse_config
    from tierkv.contract.errors import PluginImportError, UnknownTierType
    from tierkv.registry import get_tier_class

    secondary = dict(DEFAULT_SECONDARY, path=str(directory / "nvme"))
    try:
        get_tier_class(DEFAULT_SECONDARY["type"])
    except (UnknownTierType, PluginImportError) as exc:
        print(
            f"tierkv: note: {exc.problems[0]}; the default chain uses the memory tier",
            file=sys.stderr,
        )
        secondary = dict(FALLBACK_SECONDARY)
    return parse_config(
        {
            "namespace": "tierkv-default",
            "layout": {"block_bytes": "256KiB", "groups": [{"kind": "full", "block_size": 16}]},
            "primary": {"capacity": primary, "eviction": "lru", "pin_memory": "auto"},
            "tiers": [secondary],
        },
        source="the default chain",
    )


def check_machine(config: CacheConfig, source: str) -> None:
    """A ConfigError (exit 2) for what in `config` could never fit this machine's
    memory and disks."""
    from tierkv.config.machine import machine_problems

    problems = machine_problems(config)
    if problems:
        raise ConfigError(problems, source=source)


def load_checked(path: str) -> CacheConfig:
    """The chain in `path`, validated and checked against this machine's memory and
    disks: structural problems and what could never fit are reported together, in one
    ConfigError (exit 2)."""
    from tierkv.config import load_config

    return load_config(path, check_machine=True)


@contextlib.contextmanager
def chain(path: str | None, primary: str = "8MiB") -> Iterator[CacheConfig]:
    """The chain in `path`, or the default chain in a temporary directory."""
    if path:
        yield load_checked(path)
        return
    with tempfile.TemporaryDirectory(prefix="tierkv-") as tmp:
        yield default_chain(Path(tmp), primary=primary)


# -- output ---------------------------------------------------------------------------------
def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=json_value))


def json_value(value: Any) -> Any:
    """Numbers stay numbers (a ByteSize is an int), enums their value, the rest text."""
    if isinstance(value, Enum):
        return value.value
    return str(value)


def one_line(text: str) -> str:
    return " ".join(text.split())
