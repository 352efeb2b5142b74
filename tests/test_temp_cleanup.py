"""The test suite cleans up after itself: a passing run leaves nothing in the system
temp directory (pyproject's `tmp_path_retention_policy = "failed"`: a passing test's
`tmp_path` is deleted when it ends, a passing session's base directory at its end)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bytes_under(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_a_passing_run_leaves_nothing_in_the_temp_directory(tmp_path: Path) -> None:
    temp, work = tmp_path / "tmp", tmp_path / "work"
    temp.mkdir()
    work.mkdir()
    (work / "test_writes.py").write_text(
        "import pytest\n\n"
        "@pytest.fixture(scope='module')\n"
        "def shared(tmp_path_factory):\n"
        "    path = tmp_path_factory.mktemp('server')\n"
        "    (path / 'log').write_bytes(bytes(1 << 20))\n"
        "    return path\n\n"
        "def test_writes(tmp_path, shared):\n"
        "    (tmp_path / 'blob').write_bytes(bytes(4 << 20))\n"
    )
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-c",
            str(ROOT / "pyproject.toml"),
            "--rootdir",
            str(work),
            str(work / "test_writes.py"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "TMPDIR": str(temp)},
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert _bytes_under(temp) == 0, sorted(str(p) for p in temp.rglob("*"))
