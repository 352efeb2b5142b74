"""`tierkv validate` (and `parse_config(check_machine=True)`) reports a tier directory
other users can write, by YAML path, with the same message and fix as the tier's
`open` (tierkv.config.checks.privacy_problems; the rule is tierkv.contract.private)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tierkv.cli import main
from tierkv.config import parse_config
from tierkv.contract.errors import ConfigError

OTHER_UID = 65534


def chain(*tiers: str) -> str:
    return (
        "namespace: t\nlayout: {block_bytes: 4KiB, groups: [{block_size: 16}]}\n"
        "primary: {capacity: 1MiB, pin_memory: false}\ntiers:\n"
        + "".join(f"  - {tier}\n" for tier in tiers)
    )


def problems(text: str) -> list[str]:
    try:
        parse_config(text, check_machine=True)
    except ConfigError as exc:
        return list(exc.problems)
    return []


def directory(path: Path, bits: int) -> Path:
    path.mkdir()
    path.chmod(bits)
    return path


@pytest.mark.parametrize(
    ("bits", "who"), [(0o777, "every user"), (0o1777, "every user"), (0o775, "its group")]
)
def test_a_path_others_can_write_is_an_error_naming_its_yaml_path_and_the_fix(
    tmp_path: Path, bits: int, who: str
) -> None:
    shared = directory(tmp_path / "shared", bits)
    [problem] = problems(chain(f"{{type: nvme, path: {shared}, capacity: 1MiB}}"))
    assert problem.startswith(f"tiers[0].path: {shared} can be written by {who} ")
    assert f"(mode {bits:04o})" in problem
    assert f"run `chmod go-w {shared}`, or point the tier at a directory of your own" in problem


def test_each_directory_of_a_striped_tier_is_judged_by_its_entry(tmp_path: Path) -> None:
    good = directory(tmp_path / "good", 0o700)
    bad = directory(tmp_path / "bad", 0o770)
    text = chain(
        f"{{type: nvme, name: one, path: {good}, capacity: 1MiB}}",
        f"{{type: nvme, name: two, paths: [{tmp_path / 'new'}, {bad}], capacity: 1MiB}}",
    )
    [problem] = problems(text)
    assert problem.startswith(f"tiers[1].paths[1]: {bad} can be written by its group ")


def test_private_missing_and_file_paths_pass(tmp_path: Path) -> None:
    """A private directory (0700, or 0755: only its owner writes it), one not made yet
    (the tier makes it 0700) and a path that names a file (sqlite's database: not a
    directory to judge) are fine."""
    scratch = directory(tmp_path / "tmp", 0o1777)  # a /tmp-like parent does not matter
    text = chain(
        f"{{type: nvme, name: a, path: {directory(scratch / 'mine', 0o700)}, capacity: 1MiB}}",
        f"{{type: nvme, name: b, path: {directory(tmp_path / 'open', 0o755)}, capacity: 1MiB}}",
        f"{{type: nvme, name: c, path: {scratch / 'not' / 'yet'}, capacity: 1MiB}}",
    )
    assert problems(text) == []
    (tmp_path / "file").write_text("")
    assert problems(chain(f"{{type: nvme, path: {tmp_path / 'file'}, capacity: 1MiB}}")) == []


def test_a_path_owned_by_another_user_is_an_error(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    theirs = directory(tmp_path / "theirs", 0o755)
    os.chown(theirs, OTHER_UID, -1)
    [problem] = problems(chain(f"{{type: nvme, path: {theirs}, capacity: 1MiB}}"))
    assert problem.startswith(f"tiers[0].path: {theirs} belongs to another user, ")
    assert f"(uid {OTHER_UID})" in problem and f"`chown root {theirs}`" in problem


def test_only_the_machine_check_looks_at_the_disk(tmp_path: Path) -> None:
    """Loading a chain without `check_machine` (as the cache does) leaves the judgement
    to the tier's `open`, where `required: false` can still serve without it."""
    shared = directory(tmp_path / "shared", 0o777)
    parse_config(chain(f"{{type: nvme, path: {shared}, capacity: 1MiB}}"))


def test_tierkv_validate_reports_it_offline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], chain_file: Callable[..., str]
) -> None:
    shared = directory(tmp_path / "shared", 0o777)
    config = chain_file(f"[{{type: nvme, path: {shared}, capacity: 1MiB}}]")
    assert main(["validate", config]) == 2
    err = capsys.readouterr().err
    assert f"tiers[0].path: {shared} can be written by every user (mode 0777)" in err
    assert f"chmod go-w {shared}" in err
    assert list(shared.iterdir()) == []  # nothing opened, nothing made
