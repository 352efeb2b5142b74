"""`${VAR}`, `${VAR:-default}` (the default expanded in turn) and `$$` in every string
of a config, from the environment; an unset variable without a default is a problem
named by its YAML path."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from tierkv.config.messages import yaml_path

_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


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
                        f"{yaml_path(loc)}: environment variable {name} is not set "
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


def expand(value: Any, loc: tuple[Any, ...], env: Mapping[str, str], problems: list[str]) -> Any:
    if isinstance(value, str):
        return _expand_text(value, loc, env, problems)
    if isinstance(value, dict):
        return {k: expand(v, (*loc, k), env, problems) for k, v in value.items()}
    if isinstance(value, list):
        return [expand(v, (*loc, i), env, problems) for i, v in enumerate(value)]
    return value
