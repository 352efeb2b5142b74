"""The snippets of the README and the manual (docs/) run as written, and what they
promise is there: the embedding snippet, the Configure YAML, the diagram, the sizing
guide, the plugin skeleton, the worked deployment's chain."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
EMBED = ("docs/embedding.md", "# Embed it in a server")


@pytest.mark.parametrize(
    "where", [EMBED, ("README.md", "### 4. Embed it in a server")], ids=["docs", "readme"]
)
def test_embedding_snippet_runs(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    doc_block: Callable[..., str],
    where: tuple[str, str],
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiers.yaml").write_text(
        "namespace: readme\nlayout: {block_bytes: 4KiB, groups: [{block_size: 16}]}\n"
        "primary: {capacity: 1MiB, pin_memory: auto}\ntiers: [{type: memory}]\n"
    )
    scope: dict[str, object] = {}
    exec(compile(doc_block(*where), where[0], "exec"), scope)
    serve = scope["serve"]
    anyio.run(serve, list(range(64)))  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert out.startswith("0 {}")  # a cold cache: nothing to load
    assert "'blocks_stored': 4" in out


def test_configure_yaml_and_embed_snippet_run_together(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    doc_block: Callable[..., str],
) -> None:
    """Copy the Configure YAML to tiers.yaml and run the Embed snippet on it, as a reader
    would: two KV-cache groups, so the snippet must build one key list per group."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TIERKV_PRIMARY", "64MiB")  # the YAML's default is 8GiB
    (tmp_path / "tiers.yaml").write_text(doc_block("docs/configure.md", "# Configure", "yaml"))
    scope: dict[str, object] = {}
    exec(compile(doc_block(*EMBED), EMBED[0], "exec"), scope)
    anyio.run(scope["serve"], list(range(64)))  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert out.startswith("0 {}")
    assert "'blocks_stored': 8" in out  # 4 blocks in each of the two groups
    assert "'hot'" in out  # the tier's `name:` names it in the stats


def test_configure_yaml_validates_from_the_shell(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], doc_block: Callable[..., str]
) -> None:
    from tierkv.cli import main

    path = tmp_path / "tiers.yaml"
    path.write_text(
        doc_block("docs/configure.md", "# Configure", "yaml").replace(
            "${TIERKV_PRIMARY:-8GiB}", "64MiB"
        )
    )
    assert main(["validate", str(path)]) == 0
    assert "tiers: hot" in capsys.readouterr().out


@pytest.mark.parametrize("page", ["README.md", "docs/install.md"])
def test_the_docs_install_from_the_checkout_only(page: str) -> None:
    text = (ROOT / page).read_text()
    # names on the index that belong to other projects are never installed
    assert not re.search(r"pip install '?tierkv(-core)?(\[|'|\s|$)", text)
    assert "pip install -e '.[metrics,demo,plot]'" in text
    for dist in ("tierkv-cache-nvme", "tierkv-cache-redis", "tierkv-cache-s3"):
        assert dist in text


def test_the_manual_has_the_diagram_and_the_sizing_guide(doc_block: Callable[..., str]) -> None:
    diagram = doc_block("docs/concepts.md", "## How a block moves", "mermaid")
    for word in ("store", "cascade", "lookup", "promote"):
        assert word in diagram
    guide = (ROOT / "docs/sizing.md").read_text()
    for knob in ("block_bytes", "primary.capacity", "promotion_reserve", "max_inflight_bytes"):
        assert knob in guide


def test_the_plugin_skeleton_imports_what_it_uses(doc_block: Callable[..., str]) -> None:
    scope: dict[str, object] = {}
    page = "docs/plugins.md"
    exec(compile(doc_block(page, "# Write a tier plugin"), page, "exec"), scope)
    tier = scope["FloppyTier"]
    assert tier.get_tier_type() == "floppy"  # type: ignore[attr-defined]


def test_the_worked_deployment_chain_is_a_valid_config(
    doc_block: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the sizing guide's example host: the YAML parses and its arithmetic holds
    from tierkv.config import parse_config

    monkeypatch.setenv("TIERKV_MAC_KEY", "k" * 64)
    text = doc_block("docs/sizing.md", "## A worked deployment", "yaml")
    config = parse_config(text, env={"REDIS_PASSWORD": "pw"})
    assert config.layout.block_bytes == 2 * 2**20  # 16 tokens x 128KiB
    assert config.primary.capacity // config.layout.block_bytes == 65_536
    nvme, redis = config.tiers
    assert nvme.max_inflight_bytes <= config.primary.capacity // 4
    assert redis.max_inflight_bytes <= config.primary.capacity // 4


def test_the_readme_chain_is_a_valid_config(doc_block: Callable[..., str]) -> None:
    from tierkv.config import parse_config

    config = parse_config(
        doc_block("README.md", "### 3. Your own chain", "yaml"), env={"REDIS_PASSWORD": "pw"}
    )
    assert config.tier_names() == ["nvme", "redis"]
    assert config.layout.block_bytes == 2 * 2**20


def test_the_readme_is_a_guide_that_fits_a_scroll() -> None:
    """At most ~400 lines: the rest is the manual's (docs/)."""
    assert README.read_text().count("\n") <= 400


@pytest.mark.parametrize("page", ["docs/sglang.md", "docs/lmcache.md"])
def test_the_engine_pages_are_guides_not_logs(page: str) -> None:
    """At most 200 lines each: today's figures and their command; the runs before them
    are in docs/bench-log.md (issue 53)."""
    text = (ROOT / page).read_text()
    assert text.count("\n") <= 200
    assert "Earlier measurements" not in text and "Earlier figures" not in text
    assert "bench-log.md" in text


def test_the_synthetic_trace_help_says_every_kind() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "synthetic_trace.py"), "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for kind in ("chat", "oneshot", "conversations"):
        assert f"  {kind} " in out, f"{kind} is not described in --help"
    assert "{chat,oneshot,conversations}" in out
    description = out.split("\n\n")[1]
    assert description.rstrip().endswith("."), "the description stops mid-sentence"


def test_the_conversations_help_names_the_command_it_came_from() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "synthetic_trace.py"), "conversations", "-h"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.startswith("usage: synthetic_trace.py conversations ")


def test_the_tenants_page_quotas_are_a_valid_config(
    doc_block: Callable[..., str], tmp_path: Path
) -> None:
    """docs/tenants.md's quotas, in a chain with a primary and an nvme tier, parse and
    mean what the page says; its error examples are the config's own words."""
    from tierkv.config import parse_config
    from tierkv.contract.errors import ConfigError

    quotas = doc_block("docs/tenants.md", "## Quotas", "yaml")
    head = (
        "namespace: t\nlayout: {block_bytes: 1MiB, groups: [{block_size: 16}]}\n"
        f"primary: {{capacity: 8GiB}}\ntiers: [{{type: nvme, path: '{tmp_path}', "
        "capacity: 16GiB}]\n"
    )
    config = parse_config(head + quotas)
    primary = config.tenants.quotas["primary"]
    assert str(primary.tenants["acme"]) == "50%" and primary.borrow
    assert str(config.tenants.quotas["nvme"].tenants["acme"]) == "50%"
    bad = head + "tenants: {quotas: {primary: {tenants: {acme: 60%, beta: 50%}}}}\n"
    with pytest.raises(ConfigError) as err:
        parse_config(bad)
    root = Path(__file__).resolve().parents[1]
    page = " ".join((root / "docs/tenants.md").read_text().split())
    said = " ".join(err.value.problems[0].split())
    assert said[: said.index(": lower them")] in page


def _headings(text: str) -> list[tuple[str, str]]:
    """(section, heading) for every `##` and `###` heading outside code fences: a
    `##` heading's section is the page, a `###` heading's its `##`."""
    found: list[tuple[str, str]] = []
    fenced, section = False, ""
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("## "):
            section = line
            found.append(("", line))
        elif not fenced and line.startswith("### "):
            found.append((section, line))
    return found


PAGES = sorted(
    str(p.relative_to(ROOT))
    for p in [README, *ROOT.glob("docs/*.md"), *ROOT.glob("tiers/*/README.md")]
)


@pytest.mark.parametrize("page", PAGES)
def test_no_page_repeats_a_section(page: str) -> None:
    """A heading twice in one page (or one section) is a section pasted twice: an edit
    that went wrong, which the docs build does not catch."""
    seen = _headings((ROOT / page).read_text())
    repeated = sorted({h for h in seen if seen.count(h) > 1})
    assert not repeated, f"{page} repeats {repeated}"


def test_a_repeated_section_is_found() -> None:
    text = "## A\n### x\n## B\n### x\n```\n## A\n```\n## A\n"
    assert _headings(text).count(("", "## A")) == 2
    assert ("## A", "### x") in _headings(text) and ("## B", "### x") in _headings(text)
