"""A config file's text: UTF-8 (a bad byte named by line and column), YAML read safely,
a key written twice an error by YAML path rather than the last one winning."""

from __future__ import annotations

from typing import Any

import yaml

from tierkv.config.messages import yaml_path
from tierkv.contract.errors import ConfigError


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
                    f"{yaml_path((*loc, key_node.value))}: duplicate key (line {line}; first at "
                    f"line {first[ident]}); write each key once"
                )
            else:
                first[ident] = line
            problems += _duplicate_keys(value_node, (*loc, key_node.value))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            problems += _duplicate_keys(item, (*loc, i))
    return problems


def read_yaml(text: str, source: str | None) -> Any:
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
