"""The README's embedding snippet runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import anyio
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def snippet(heading: str) -> str:
    text = README.read_text()
    section = text[text.index(heading) :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, f"no python block under {heading!r}"
    return match.group(1)


def test_embedding_snippet_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiers.yaml").write_text(
        "namespace: readme\nlayout: {block_bytes: 4KiB, groups: [{block_size: 16}]}\n"
        "primary: {capacity: 1MiB, pin_memory: auto}\ntiers: [{type: memory}]\n"
    )
    scope: dict[str, object] = {}
    exec(compile(snippet("## Embed it in a server"), "README.md", "exec"), scope)
    serve = scope["serve"]
    anyio.run(serve, list(range(64)))  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert out.startswith("0 {}")  # a cold cache: nothing to load
    assert "'blocks_stored': 4" in out
