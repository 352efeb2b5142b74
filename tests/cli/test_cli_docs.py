"""docs/cli.md against the parser (tierkv.cli.app.build_parser), so the page cannot
lag the commands: every command and subcommand has its section and a row in the
summary table; every option (each of its spellings), positional argument and choice
of a command is named in its section; every option a section's table lists exists;
the options every command takes are in "Every command"."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierkv.cli import build_parser

DOC = Path(__file__).parents[2] / "docs" / "cli.md"
SHARED = "Every command"
"""The section of the options every command takes (`--verbose`, `--help`)."""


def commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every parser under `parser` (itself first), with its path of subcommands."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))


def runnable() -> list[tuple[str, argparse.ArgumentParser]]:
    """The commands that run something (`tierkv bench`, `tierkv vllm check`), not the
    groups that only hold a subcommand (`tierkv vllm`)."""
    return [
        (" ".join(("tierkv", *path)), parser)
        for path, parser in commands(build_parser())
        if path and parser.get_default("func") is not None
    ]


def own_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The command's own arguments: not --help, not the options every command takes,
    not a subcommand."""
    return [
        a
        for a in parser._actions
        if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
        and "--verbose" not in a.option_strings
    ]


def sections() -> dict[str, str]:
    """Each `##` or `###` heading of the page (its text, backticks kept) and the text
    under it, up to the next heading; "" for the text before the first."""
    parts = re.split(r"^#{2,3} (.*)$", DOC.read_text(encoding="utf-8"), flags=re.M)
    found = {"": parts[0]}
    found.update(zip(parts[1::2], parts[2::2]))
    return found


def code_spans(text: str) -> list[str]:
    """The `code` spans of `text`, fenced blocks left out."""
    return re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S))


def named(text: str, word: str) -> bool:
    """`word` written in code in `text`: `--config`, `--config FILE`, `-v`,..."""
    return re.search(rf"`{re.escape(word)}(?=[`\s,=|\\])", text) is not None


def undocumented(command: str, parser: argparse.ArgumentParser) -> list[str]:
    """What of `command`'s arguments its section of the page does not name (or that
    the command has no section, or no row in the summary table)."""
    found = sections()
    section = found.get(f"`{command}`")
    if section is None:
        return [f"the section `## `{command}``"]
    missing = []
    if f"(#{command.replace(' ', '-')})" not in found[""]:
        missing.append("its row in the table at the top")
    for action in own_actions(parser):
        if action.option_strings:
            missing += [o for o in action.option_strings if not named(section, o)]
        elif not (named(section, action.dest) or named(section, action.dest.upper())):
            missing.append(action.dest)
        words = {w for span in code_spans(section) for w in re.split(r"[\s|\\,=]+", span)}
        missing += [f"{action.dest} {c}" for c in action.choices or () if str(c) not in words]
    return missing


@pytest.mark.parametrize(("command", "parser"), runnable(), ids=[c for c, _ in runnable()])
def test_every_command_has_a_section_naming_each_of_its_arguments(
    command: str, parser: argparse.ArgumentParser
) -> None:
    missing = undocumented(command, parser)
    assert not missing, f"docs/cli.md, `{command}`: not documented: {', '.join(missing)}"


@pytest.mark.parametrize(("command", "parser"), runnable(), ids=[c for c, _ in runnable()])
def test_every_option_a_section_lists_exists(command: str, parser: argparse.ArgumentParser) -> None:
    listed = re.findall(r"^\| `(-[-\w]+)", sections()[f"`{command}`"], flags=re.M)
    known = {o for a in own_actions(parser) for o in a.option_strings}
    assert listed and not set(listed) - known, f"{command}: {sorted(set(listed) - known)}"


def test_the_options_every_command_takes_are_in_their_section() -> None:
    shared = sections()[SHARED]
    root = build_parser()
    options = {o for a in root._actions for o in a.option_strings}
    for _, parser in runnable():
        options |= {o for a in parser._actions if "--verbose" in a.option_strings
                    for o in a.option_strings}  # fmt: skip
    assert {"--help", "--verbose", "--version"} <= options
    assert not [o for o in sorted(options) if not named(shared, o)]


def test_the_check_catches_what_the_page_lacks() -> None:
    """An option, a choice or a command the page does not name is reported."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--frobnicate", "-f", action="store_true")
    parser.add_argument("--colour", choices=["red", "octarine"])
    assert undocumented("tierkv roundtrip", parser) == [
        "--frobnicate", "-f", "--colour", "colour red", "colour octarine"
    ]  # fmt: skip
    assert undocumented("tierkv teleport", parser) == ["the section `## `tierkv teleport``"]
