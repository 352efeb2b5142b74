"""Private by default (issue 52): the nvme tier keeps its blocks where no other user
can read them or put their own.

Files 0600 and directories 0700 whatever the umask, on one directory and striped over
several; a `path` other users can write (its group or everyone, sticky or not, or
owned by another user) is refused at `open`, and so is a namespace directory that is
not the server user's alone, each with a message naming the fix; a private `path`
under a sticky world-writable directory (`/tmp`) serves. "Another user" is uid 65534
(`nobody`): the tests that make a directory someone else's need root, as CI runs them.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tierkv_nvme import NvmeTier, NvmeTierConfig
from tierkv_nvme.layout import namespace_dir

from tierkv.tier import ReqContext, TierUnavailable

pytestmark = pytest.mark.anyio

OTHER_UID = 65534
CTX = ReqContext(request_id="test-private")


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path, follow_symlinks=False).st_mode)


@pytest.fixture
def permissive_umask() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def as_root() -> None:
    """Making a directory another user's takes root (CI and the dev container run as
    root)."""
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")


def plain(rig: Any, path: Path) -> NvmeTier:
    config = NvmeTierConfig(
        type="nvme",
        layout="files",
        path=path,
        capacity=64 * rig.footprint(),
        io_engine=rig.io_engine,
    )
    return NvmeTier(config, rig.view)


def ns_dir(rig: Any, path: Path) -> Path:
    return namespace_dir(path, rig.view.namespace)


async def stores_and_serves(rig: Any, tier: NvmeTier) -> None:
    keys = rig.keys(3)
    stored, data = await rig.store(tier, keys)
    assert stored.ok, stored.error
    loaded, got = await rig.load(tier, keys)
    assert loaded.ok, loaded.error
    assert got == data


# -- modes under a permissive umask -------------------------------------------------
async def test_a_striped_tier_under_umask_0000_keeps_every_file_and_directory_private(
    rig, tmp_path: Path, permissive_umask: None
) -> None:
    """Every directory the tier made (each of `paths` and the missing ones above it,
    namespace and fan-out directories) is 0700, every file it made (blocks, lock,
    namespace note) 0600."""
    paths = [tmp_path / "drives" / f"d{i}" / "tierkv" for i in range(3)]
    tier = NvmeTier(
        NvmeTierConfig(
            type="nvme",
            layout="files",
            paths=paths,
            capacity=300 * rig.footprint(),
            io_engine=rig.io_engine,
        ),
        rig.view,
    )
    await tier.open()
    try:
        keys = rig.keys(24)
        for at in range(0, len(keys), 8):
            stored, _ = await rig.store(tier, keys[at : at + 8])
            assert stored.ok, stored.error
    finally:
        await tier.close()
    made = [tmp_path / "drives", *(p.parent for p in paths), *paths]
    files: list[Path] = []
    for path in paths:
        for folder, subdirs, names in os.walk(path):
            made += [Path(folder) / d for d in subdirs]
            files += [Path(folder) / n for n in names]
    assert {p: oct(mode(p)) for p in made} == {p: "0o700" for p in made}
    assert len([f for f in files if f.suffix == ".blk"]) == len(keys)
    assert {f: oct(mode(f)) for f in files} == {f: "0o600" for f in files}


# -- a `path` other users can write ---------------------------------------------------
@pytest.mark.parametrize(
    ("bits", "who"),
    [(0o777, "every user"), (0o1777, "every user"), (0o775, "its group"), (0o770, "its group")],
)
async def test_a_path_others_can_write_is_refused_at_open_with_the_fix(
    rig, tmp_path: Path, bits: int, who: str
) -> None:
    """World- or group-writable, sticky or not: refused before anything is made in it,
    and the message says what to run (or where else to go)."""
    path = tmp_path / "shared"
    path.mkdir()
    path.chmod(bits)
    with pytest.raises(TierUnavailable) as refused:
        await plain(rig, path).open()
    message = str(refused.value)
    assert message.startswith("nvme tier will not keep blocks where other users can write: ")
    assert f"{path} can be written by {who}" in message
    assert f"(mode {bits:04o})" in message
    assert f"run `chmod go-w {path}`" in message
    assert "a directory of your own" in message
    assert list(path.iterdir()) == []  # no namespace directory made in it
    path.chmod(0o700)  # the fix
    tier = plain(rig, path)
    await tier.open()
    await stores_and_serves(rig, tier)
    await tier.close()


async def test_a_striped_tier_refuses_the_one_directory_others_can_write(
    rig, tmp_path: Path
) -> None:
    paths = [tmp_path / f"d{i}" for i in range(3)]
    for path in paths:
        path.mkdir(mode=0o700)
    paths[1].chmod(0o777)
    tier = NvmeTier(
        NvmeTierConfig(
            type="nvme", layout="files", paths=paths, capacity="1MiB", io_engine=rig.io_engine
        ),
        rig.view,
    )
    with pytest.raises(TierUnavailable, match=r"cannot open 1 of them: .*") as refused:
        await tier.open()
    assert f"{paths[1]} can be written by every user" in str(refused.value)
    assert f"chmod go-w {paths[1]}" in str(refused.value)
    assert str(paths[0]) not in str(refused.value)


async def test_a_path_owned_by_another_user_is_refused(rig, tmp_path: Path, as_root: None) -> None:
    """Its owner could rename and replace what the tier keeps there whatever the mode:
    refused even at 0755, the message naming the owner and the fix."""
    path = tmp_path / "theirs"
    path.mkdir(mode=0o755)
    os.chown(path, OTHER_UID, -1)
    with pytest.raises(TierUnavailable) as refused:
        await plain(rig, path).open()
    message = str(refused.value)
    assert f"{path} belongs to another user" in message
    assert f"uid {OTHER_UID}" in message
    assert f"`chown root {path}`" in message
    assert "a directory of your own" in message


async def test_a_path_owned_by_root_serves(rig, tmp_path: Path) -> None:
    """A directory an administrator made (root's, 0755) is fine for any server user:
    only root and its owner can write it."""
    path = tmp_path / "admin"
    path.mkdir(mode=0o755)
    if os.geteuid() == 0:
        os.chown(path, 0, -1)
    tier = plain(rig, path)
    await tier.open()
    await stores_and_serves(rig, tier)
    await tier.close()
    assert mode(path) == 0o755  # the tier leaves a `path` it did not make as it is
    assert mode(ns_dir(rig, path)) == 0o700


# -- the namespace directory ----------------------------------------------------------
async def test_a_namespace_directory_of_another_user_is_refused(
    rig, tmp_path: Path, as_root: None
) -> None:
    """Someone made the tier's (deterministic) namespace directory first: whatever it
    holds is theirs, so the tier refuses it and says to remove it."""
    path = tmp_path / "nvme"
    path.mkdir(mode=0o700)
    ns = ns_dir(rig, path)
    ns.mkdir(mode=0o700)
    os.chown(ns, OTHER_UID, -1)
    with pytest.raises(TierUnavailable) as refused:
        await plain(rig, path).open()
    message = str(refused.value)
    assert message.startswith("nvme tier will not keep blocks where other users can write: ")
    assert f"{ns} belongs to another user" in message and f"uid {OTHER_UID}" in message
    assert f"`rm -r {ns}`" in message
    assert not (ns / "lock").exists()


async def test_a_namespace_directory_others_can_write_is_refused(rig, tmp_path: Path) -> None:
    """Others may have put blocks in it: refused, with the fix (remove it; the tier
    makes it anew), not tightened and served."""
    path = tmp_path / "nvme"
    path.mkdir(mode=0o700)
    ns = ns_dir(rig, path)
    ns.mkdir()
    ns.chmod(0o775)
    with pytest.raises(TierUnavailable) as refused:
        await plain(rig, path).open()
    assert f"{ns} can be written by its group" in str(refused.value)
    assert f"`rm -r {ns}`; the tier makes it anew" in str(refused.value)
    ns.rmdir()  # the fix
    tier = plain(rig, path)
    await tier.open()
    await tier.close()
    assert mode(ns) == 0o700


async def test_a_namespace_directory_others_could_only_read_is_tightened(
    rig, tmp_path: Path
) -> None:
    """Tiers before 0700 made it 0755: no one else could write it, so its blocks are
    served; it is made 0700, which hides everything in it."""
    path = tmp_path / "nvme"
    tier = plain(rig, path)
    await tier.open()
    keys = rig.keys(3)
    stored, data = await rig.store(tier, keys)
    assert stored.ok
    await tier.close()
    ns = ns_dir(rig, path)
    ns.chmod(0o755)
    again = plain(rig, path)
    await again.open()
    assert mode(ns) == 0o700
    loaded, got = await rig.load(again, keys)
    assert loaded.ok and got == data
    await again.close()


async def test_a_namespace_directory_that_is_a_symlink_is_refused(rig, tmp_path: Path) -> None:
    path = tmp_path / "nvme"
    path.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    ns_dir(rig, path).symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(TierUnavailable, match=r"is a symlink .*point `path` at the real"):
        await plain(rig, path).open()
    assert list(elsewhere.iterdir()) == []


async def test_a_namespace_directory_replaced_by_another_users_is_refused_on_retake(
    rig, tmp_path: Path, as_root: None
) -> None:
    """Removed under a serving tier and made again by someone else: the tier's retake
    judges it as `open` does, and the tier reports itself unavailable."""
    path = tmp_path / "nvme"
    tier = plain(rig, path)
    await tier.open()
    ns = tier.directory
    for entry in sorted(ns.rglob("*"), reverse=True):
        entry.rmdir() if entry.is_dir() else entry.unlink()
    ns.rmdir()
    ns.mkdir(mode=0o700)
    os.chown(ns, OTHER_UID, -1)
    with pytest.raises(TierUnavailable, match="belongs to another user"):
        await tier.lookup(rig.keys(1), CTX)
    await tier.close()


# -- where a private `path` lives -------------------------------------------------------
async def test_a_private_path_under_a_sticky_world_writable_parent_serves(
    rig, tmp_path: Path, permissive_umask: None
) -> None:
    """A `/tmp`-like parent (1777): the tier makes a missing `path` 0700 in it and
    serves; an existing private one serves as well."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    scratch.chmod(0o1777)
    made = scratch / "tierkv" / "nvme"
    tier = plain(rig, made)
    await tier.open()
    await stores_and_serves(rig, tier)
    await tier.close()
    assert mode(made.parent) == 0o700 and mode(made) == 0o700
    existing = scratch / "mine"
    existing.mkdir(mode=0o700)
    tier = plain(rig, existing)
    await tier.open()
    await stores_and_serves(rig, tier)
    await tier.close()


async def test_a_path_that_is_a_symlink_to_a_private_directory_serves(rig, tmp_path: Path) -> None:
    """`path` may be a link (a mount point's alias): the directory it reaches is
    judged, not the link."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    alias = tmp_path / "alias"
    alias.symlink_to(real, target_is_directory=True)
    tier = plain(rig, alias)
    await tier.open()
    await stores_and_serves(rig, tier)
    await tier.close()
    assert ns_dir(rig, real).is_dir()
    real.chmod(0o777)
    with pytest.raises(TierUnavailable) as refused:
        await plain(rig, alias).open()
    assert f"{alias} can be written by every user" in str(refused.value)
