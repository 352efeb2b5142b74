"""The troubleshooting page (docs/troubleshooting.md) quotes the messages a user meets;
each quote must still be what the code says, or the page sends the user after a
message that no longer exists.

The page's convention, which this test relies on: every message is quoted in bold code,
**`message`** (or **`` message ``** when it holds a backtick), under one of the page's
`## ` sections; `<name>` stands for what varies (a path, a URL, a count, an error's
type; also where two of the code's strings meet), and `...` for text that comes from
elsewhere (a library's own error). What is left, the message's literal pieces, must
each appear in one string literal of the code (an f-string's text between its
`{fields}`, a logging format's text between its `%s`-style fields), or where one
string's field is another string: the end of one literal text, then whole ones, then
the start of another (`f"({code}); {fix}"` with `fix = f"the disk under {path}..."`
holds "); the disk under ").
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "troubleshooting.md"
SECTIONS = ("## Before the server starts", "## While it serves")

QUOTE = re.compile(r"\*\*(`+)(.+?)\1\*\*", re.S)
"""A message: a code span (one or more backticks) in bold."""
PLACEHOLDER = re.compile(r"<[^<>\s][^<>]*>|\.\.\.|…")
PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?[sdirfgexXcab%]")
MIN_PIECE = 4
"""Pieces shorter than this (a colon and a space between two fields) are not checked."""


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def page_messages() -> list[tuple[str, str]]:
    """(section, message) for every message the page quotes."""
    text = PAGE.read_text()
    found = []
    starts = sorted((text.index(heading), heading) for heading in SECTIONS)
    for i, (start, heading) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(text)
        for match in QUOTE.finditer(text, start, end):
            body = match.group(2)
            if len(match.group(1)) > 1:  # `` x ``: padded, or a backtick at an end breaks it
                assert body.startswith(" ") and body.endswith(" "), f"pad {body!r} with spaces"
                body = body[1:-1]
            found.append((heading, _norm(body).strip()))
    return found


def pieces(message: str) -> list[str]:
    """The literal pieces of a quoted message: what is left between its placeholders."""
    return [_norm(p) for p in PLACEHOLDER.split(message) if len(p.strip()) >= MIN_PIECE]


def _sources() -> list[Path]:
    packages = [ROOT / "tierkv"]
    packages += sorted(p for p in (ROOT / "tiers").glob("*/tierkv_*") if p.is_dir())
    packages += sorted(p for p in (ROOT / "plugins").glob("*/tierkv_*") if p.is_dir())
    return [f for package in packages for f in sorted(package.rglob("*.py"))]


def _segments(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return PERCENT_FIELD.split(node.value)
    assert isinstance(node, ast.JoinedStr)
    segments, current = [], ""
    for value in node.values:
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            current += value.value
        else:  # a {field}: the text on each side is a segment of its own
            segments.append(current)
            current = ""
    return [*segments, current]


@cache
def code_segments() -> frozenset[str]:
    """Every literal piece of text of the code's strings, whitespace normalised."""
    found: set[str] = set()
    for path in _sources():
        tree = ast.parse(path.read_text(), str(path))
        inside_fstring = {
            id(value)
            for node in ast.walk(tree)
            if isinstance(node, ast.JoinedStr)
            for value in node.values
        }
        for node in ast.walk(tree):
            is_text = isinstance(node, ast.Constant) and isinstance(node.value, str)
            if isinstance(node, ast.JoinedStr) or (is_text and id(node) not in inside_fstring):
                found.update(_norm(s) for s in _segments(node) if s.strip())
    return frozenset(found)


def in_code(piece: str) -> bool:
    segments = code_segments()
    if any(piece in segment for segment in segments):
        return True
    return any(
        any(segment.endswith(piece[:i]) for segment in segments) and _continues(piece[i:])
        for i in range(1, len(piece))
    )


def _continues(rest: str, depth: int = 2) -> bool:
    """`rest` is the start of a literal text, or a whole one (of at least MIN_PIECE
    characters: not a lone `)`) and then such a rest, at most `depth` whole ones."""
    segments = code_segments()
    if any(segment.startswith(rest) for segment in segments):
        return True
    return depth > 0 and any(
        len(segment.strip()) >= MIN_PIECE
        and len(segment) < len(rest)
        and rest.startswith(segment)
        and _continues(rest[len(segment) :], depth - 1)
        for segment in segments
    )


def test_the_page_quotes_the_messages_by_its_convention() -> None:
    messages = page_messages()
    assert len(messages) >= 15, "the page lost its quoted messages (or their **`...`**)"
    for section in SECTIONS:
        assert any(s == section for s, _ in messages), f"no message under {section!r}"
    for _, message in messages:
        longest = max((len(p.strip()) for p in pieces(message)), default=0)
        assert longest >= 10, f"{message!r} is nearly all placeholders: quote more of it"


@pytest.mark.parametrize(
    "message", [m for _, m in page_messages()], ids=lambda m: m[:40].replace(" ", "_")
)
def test_every_quoted_message_is_still_in_the_code(message: str) -> None:
    missing = [piece for piece in pieces(message) if not in_code(piece)]
    assert not missing, (
        f"docs/troubleshooting.md quotes {message!r}, but no string in the code holds "
        f"{missing}: update the page (or mark what varies there as <name>)"
    )


def test_the_check_finds_a_message_that_is_not_in_the_code() -> None:
    """The check itself: a made-up message fails it, a real one with its fields passes."""
    assert not all(in_code(p) for p in pieces("tier <name> melted into <path>; cool it"))
    assert not in_code("nvme write failed: the disk is on fire")
    assert all(
        in_code(p)
        for p in pieces("tier <name> broke its deadline: a <kind> job of <n> keys gave no answer")
    )
