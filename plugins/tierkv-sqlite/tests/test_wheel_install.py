"""The plugin works the way a third party ships one: as a wheel, pip-installed into a
fresh virtual environment next to tierkv, found by tierkv's registry through its
entry point alone, and missed (with a message that says so) once uninstalled.

A fresh environment with torch would take ~40 s to install, so the new venv gets its
dependencies from the running environment instead: a `.pth` file adds a directory of
symlinks to every entry of this interpreter's site-packages, except the files of any
tierkv-sqlite already installed here (the editable dev install), which must not be
what the new venv finds. Only the wheel under test is installed into the venv, by pip,
offline; pip still checks that the wheel's dependencies are met.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

PLUGIN_SOURCE = Path(__file__).resolve().parents[1]
DISTRIBUTION = "tierkv-cache-sqlite"


def _site_dirs() -> list[Path]:
    """This interpreter's site-packages directories, in import order."""
    paths = sysconfig.get_paths()
    candidates = [paths["purelib"], paths["platlib"], *site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        candidates.append(site.getusersitepackages())
    return [Path(p) for p in dict.fromkeys(candidates) if Path(p).is_dir()]


def _files_of_installed_plugin() -> set[str]:
    """Top-level site-packages entries that belong to an installed tierkv-sqlite."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return set()
    names = {Path(str(f)).parts[0] for f in dist.files or []}
    return {n for n in names if n not in ("__pycache__", "..")}


def _dependency_view(where: Path) -> Path:
    """A directory of symlinks to this environment's packages, minus the plugin."""
    where.mkdir()
    skip = _files_of_installed_plugin()
    for site_dir in _site_dirs():
        for entry in site_dir.iterdir():
            link = where / entry.name
            if entry.name in skip or link.exists() or link.is_symlink():
                continue
            link.symlink_to(entry)
    return where


def _run(
    *args: str | Path, check: bool = True, offline: bool = False, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a command; `offline` also hides pip's configured indexes and mirrors, so an
    install can only use what is already installed. Run the venv's python away from
    the checkout (`cwd`), so `python -m` cannot import the source tree by accident."""
    env = dict(os.environ)
    if offline:
        env = {k: v for k, v in env.items() if not k.startswith("PIP_")}
        env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1")
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    done = subprocess.run(
        [str(a) for a in args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        check=False,
        timeout=180,
    )
    if check and done.returncode != 0:
        pytest.fail(f"{' '.join(map(str, args))} exited {done.returncode}:\n{done.stderr}")
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from a copy of the plugin's source (the tree stays clean)."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "src"
    shutil.copytree(
        PLUGIN_SOURCE,
        source,
        ignore=shutil.ignore_patterns("tests", "build", "dist", "*.egg-info", "__pycache__"),
    )
    build: list[str | Path] = [sys.executable, "-m", "pip", "wheel", "--no-deps"]
    if importlib.util.find_spec("setuptools"):  # build with the one here: fast, offline
        build += ["--no-build-isolation", "--no-index"]
    # else pip fetches setuptools for an isolated build, from the configured index
    _run(*build, "-w", work / "dist", source)
    [built] = (work / "dist").glob("tierkv_cache_sqlite-*.whl")
    return built


def test_wheel_installs_into_a_fresh_venv_is_discovered_and_missed_once_removed(
    wheel: Path, tmp_path: Path
) -> None:
    run = functools.partial(_run, cwd=tmp_path)

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    purelib = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    deps = _dependency_view(tmp_path / "deps")
    (Path(purelib.stdout.strip()) / "_tierkv_test_deps.pth").write_text(
        f"import site; site.addsitedir({str(deps)!r})\n"
    )
    before = run(python, "-m", "tierkv.cli", "plugins")
    # the plugin's own row (its class), not the word: field descriptions may name sqlite
    assert "tierkv_sqlite:SqliteTier" not in before.stdout, "the venv must not see it yet"
    assert "tierkv-cache-sqlite" not in before.stdout

    installed = run(python, "-m", "pip", "install", wheel, offline=True)
    assert "Successfully installed tierkv-cache-sqlite-0.1.0" in installed.stdout
    where = run(python, "-c", "import tierkv_sqlite; print(tierkv_sqlite.__file__)")
    assert where.stdout.startswith(str(venv)), "the plugin must come from the new venv"

    chain = tmp_path / "chain.yaml"
    chain.write_text(
        f"""\
namespace: wheel-test
layout: {{block_bytes: 64KiB, groups: [{{kind: full, block_size: 16}}]}}
primary: {{capacity: 512KiB, eviction: lru, pin_memory: false}}
tiers:
  - {{type: sqlite, path: {tmp_path / "kv.db"}, capacity: 16MiB}}
"""
    )
    plugins = run(python, "-m", "tierkv.cli", "plugins")
    assert "tierkv_sqlite:SqliteTier" in plugins.stdout
    assert "tierkv-cache-sqlite 0.1.0" in plugins.stdout
    validated = run(python, "-m", "tierkv.cli", "validate", chain)
    assert "ok" in validated.stdout and "tiers: sqlite" in validated.stdout
    roundtrip = run(python, "-m", "tierkv.cli", "roundtrip", "--config", chain, "--blocks", "24")
    assert "tier sqlite: holds 24 of 24 blocks" in roundtrip.stdout
    assert "every block read back byte-identical" in roundtrip.stdout

    run(python, "-m", "pip", "uninstall", "--yes", DISTRIBUTION, offline=True)
    missing = run(python, "-m", "tierkv.cli", "validate", chain, check=False)
    assert missing.returncode == 2
    assert "tiers[0].type: unknown tier type 'sqlite'; installed tier types: " in missing.stderr
    installed_line = missing.stderr.split("installed tier types: ", 1)[1].split(".", 1)[0]
    assert "memory" in installed_line.split(", ")
    assert "sqlite" not in installed_line
