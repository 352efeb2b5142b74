"""The bench's targets: the figures of a report that have a bound to stay within
(`TARGETS`), and whether a report meets each (`check_targets`, the report's
`targets` section, which the summary flags from)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Target:
    """One figure of a report's `section` (its `key`, through `convert` when given)
    that should be at least (`at_least`) or at most `bound`."""

    name: str
    section: str
    key: str
    bound: float
    at_least: bool
    label: str
    unit: str
    convert: Callable[[float], float] | None = None

    @property
    def text(self) -> str:
        """`>= 0.8`, `<= 5`: the bound as the summary prints it."""
        return f"{'>=' if self.at_least else '<='} {self.bound:g}"

    def value(self, report: dict[str, Any]) -> float | None:
        """The figure in `report`, or None when the report has no such measurement."""
        section = report.get(self.section)
        if not section or self.key not in section:
            return None
        value = float(section[self.key])
        return self.convert(value) if self.convert else value

    def met(self, value: float) -> bool:
        return value >= self.bound if self.at_least else value <= self.bound


TARGETS: tuple[Target, ...] = (
    Target("streaming_store_ratio", "streaming", "store_ratio", 0.8, at_least=True,
           label="streaming store, tierkv/raw", unit="x"),
    Target("streaming_load_ratio", "streaming", "load_ratio", 0.8, at_least=True,
           label="streaming load, tierkv/raw", unit="x"),
    Target("promotion_vs_slower_stage", "streaming", "promotion_vs_slower_stage", 1.25,
           at_least=False, label="promotion / its slower stage", unit="x"),
    Target("load_1024_us_per_block", "orchestrator", "load_1024_us_per_block", 5,
           at_least=False, label="1,024-block loads", unit=" us/block"),
    Target("lookup_us_per_key", "orchestrator", "lookup_hit_keys_per_s", 1, at_least=False,
           label="lookup of resident keys", unit=" us/key",
           convert=lambda keys_per_s: 1e6 / keys_per_s),
    Target("host_store_us_per_key_beyond_copy", "orchestrator",
           "host_store_us_per_key_beyond_copy", 2, at_least=False,
           label="host tensor store beyond the copy", unit=" us/key"),
    Target("host_load_us_per_key_beyond_copy", "orchestrator",
           "host_load_us_per_key_beyond_copy", 2, at_least=False,
           label="host tensor load beyond the copy", unit=" us/key"),
)  # fmt: skip
"""Every target, in the order a report's `targets` lists them (`TARGET`: by name)."""

TARGET = {t.name: t for t in TARGETS}


def check_targets(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per target whose figure `report` has: the figure, its bound (`min` or `max`)
    and whether it was met; in `TARGETS` order. A target whose phase did not run is
    left out."""
    checked: dict[str, dict[str, Any]] = {}
    for target in TARGETS:
        value = target.value(report)
        if value is None:
            continue
        checked[target.name] = {
            "value": value,
            "min" if target.at_least else "max": target.bound,
            "met": target.met(value),
        }
    return checked


def missed_targets(checked: dict[str, dict[str, Any]]) -> list[str]:
    """One phrase per target missed in `checked` (from `check_targets`):
    `streaming load, tierkv/raw 0.71x (target >= 0.8)`."""
    return [
        f"{TARGET[name].label} {entry['value']:.2f}{TARGET[name].unit} (target {TARGET[name].text})"
        for name, entry in checked.items()
        if not entry["met"]
    ]
