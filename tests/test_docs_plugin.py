"""The manual's "Write a tier plugin" page (docs/plugins.md), copied as an author would copy it: the
tier into `tierkv_floppy/__init__.py`, the test class into `tests/`, and pytest run on
them in a fresh process. The whole conformance suite passes, nothing is skipped, and
nothing is left outside pytest's `tmp_path`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from tierkv.testing import TierConformanceSuite

PAGE = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"


def section_blocks(language: str) -> list[str]:
    """The fenced `language` blocks of the page, in order."""
    return re.findall(rf"```{language}\n(.*?)```", PAGE.read_text(), re.S)


def copy_plugin(root: Path) -> Path:
    """The plugin as an author lays it out from the page: pyproject.toml, the package,
    its tests."""
    tier, suite = section_blocks("python")[:2]
    (root / "tierkv_floppy").mkdir(parents=True)
    (root / "tierkv_floppy" / "__init__.py").write_text(tier)
    (root / "tests").mkdir()
    (root / "tests" / "test_floppy_tier.py").write_text(suite)
    (root / "pyproject.toml").write_text(section_blocks("toml")[0])
    return root


def test_the_copied_plugin_passes_the_conformance_suite(tmp_path: Path) -> None:
    root = copy_plugin(tmp_path / "tierkv-floppy")
    scratch = tmp_path / "tmp"  # the process's TMPDIR: must stay empty
    scratch.mkdir()
    env = {**os.environ, "PYTHONPATH": str(root), "TMPDIR": str(scratch)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", f"--basetemp={tmp_path / 'pytest'}", "tests"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    tests = [name for name in dir(TierConformanceSuite) if name.startswith("test_")]
    summary = out.strip().splitlines()[-1]
    assert re.match(rf"{len(tests)} passed in ", summary), out  # none skipped, none failed
    assert list(scratch.iterdir()) == []


def test_the_entry_point_names_the_class_the_skeleton_defines() -> None:
    [toml] = section_blocks("toml")
    assert 'dependencies = ["tierkv-cache"]' in toml  # the core's distribution name
    table = toml.split('[project.entry-points."tierkv.tiers"]\n', 1)[1]
    match = re.match(r'(\w+) = "(\w+):(\w+)"', table)
    assert match, table
    name, module, attribute = match.groups()
    assert module == "tierkv_floppy"
    assert _exec_skeleton()[attribute].get_tier_type() == name  # type: ignore[attr-defined]


def _exec_skeleton() -> dict[str, object]:
    scope: dict[str, object] = {"__name__": "tierkv_floppy"}
    code = compile(section_blocks("python")[0], "plugins.md", "exec", dont_inherit=True)
    exec(code, scope)
    return scope


def test_the_skeleton_imports_only_the_contract(tmp_path: Path) -> None:
    """In a fresh interpreter, importing the tier loads no torch and nothing of the cache."""
    root = copy_plugin(tmp_path / "tierkv-floppy")
    probe = "import json, sys, tierkv_floppy; print(json.dumps(sorted(sys.modules)))"
    run = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    modules = json.loads(run.stdout)
    assert "torch" not in modules
    assert not [m for m in modules if m.startswith(("tierkv.cache", "tierkv.gpu"))]


def test_tierkv_plugins_shows_the_skeleton_field_descriptions(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from tierkv.cli import main
    from tierkv.registry import register_tier, unregister_tier

    tier_class = _exec_skeleton()["FloppyTier"]
    register_tier(tier_class)  # type: ignore[arg-type]
    try:
        assert main(["plugins", "--json"]) == 0
    finally:
        unregister_tier("floppy")
    fields = json.loads(capsys.readouterr().out)["types"]["floppy"]["fields"]
    assert set(fields) == {"path", "capacity"}
    assert fields["path"]["required"] and "directory" in fields["path"]["description"]
    assert fields["capacity"]["default"] == 1 << 20 and fields["capacity"]["description"]


def test_a_tier_from_the_skeleton_stores_into_its_own_directory(tmp_path: Path) -> None:
    from tierkv.contract.jobs import JobMetadata
    from tierkv.contract.keys import make_offload_key
    from tierkv.contract.slab import PrimaryView

    scope = _exec_skeleton()
    config = scope["FloppyConfig"](type="floppy", path=tmp_path / "floppy")  # type: ignore[operator]
    tier = scope["FloppyTier"](config, PrimaryView(bytearray(64), 16, "ns"))  # type: ignore[operator]
    job = JobMetadata(1, (make_offload_key(b"k" * 16, 0),), (0,))

    async def round_trip() -> None:
        await tier.open()
        try:
            assert (await tier.store(job)).ok_keys == job.keys
        finally:
            await tier.close()

    anyio.run(round_trip)
    assert [f.name for f in (tmp_path / "floppy").iterdir()] == [job.keys[0].hex()]
