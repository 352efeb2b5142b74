"""A tier striped over several directories (nvme's `paths: [...]`) in the core's tools
that know where tiers keep files: the machine check gives each directory its share of
the capacity (`tierkv.config.machine`), the chain check compares every directory of
every tier (`tierkv.config.checks`), and the demo and the round trip move every
directory into their scratch directory (`tierkv.demo.scratch`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tierkv.cli import main
from tierkv.config import CacheConfig, parse_config
from tierkv.contract.errors import ConfigError
from tierkv.tier import TierConfig

TB = 10**12
TiB = 2**40


def chain(*tiers: dict[str, object]) -> CacheConfig:
    return parse_config(
        {
            "namespace": "t",
            "layout": {"block_bytes": "4KiB", "groups": [{"block_size": 16}]},
            "primary": {"capacity": "1MiB", "pin_memory": False},
            "tiers": list(tiers),
        }
    )


def fit(config: CacheConfig) -> list[str]:
    from tierkv.config.machine import fit_problems

    return fit_problems(None, list(enumerate(config.tiers)), memory=2**50)


@pytest.fixture
def drives(monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple[int, int]]:
    """Filesystems by mount point (`/mnt/a`: (bytes, device id)), filled in by the
    test; `filesystem_size` answers from them."""
    from tierkv.config import machine

    mounts: dict[str, tuple[int, int]] = {}

    def size(path: Path) -> tuple[int, int] | None:
        for mount, found in mounts.items():
            if path == Path(mount) or Path(mount) in path.parents:
                return found
        return None

    monkeypatch.setattr(machine, "filesystem_size", size)
    return mounts


# -- the machine check: each directory's share against its filesystem ---------------------
def test_a_striped_tier_fits_when_each_drive_holds_its_share(
    drives: dict[str, tuple[int, int]],
) -> None:
    """4 drives of 3.84 TB hold 12 TiB (3 TiB each): no problem, though the whole
    capacity is more than any one drive (the check that read only `path` said so)."""
    for k in range(4):
        drives[f"/mnt/nvme{k}"] = (int(3.84 * TB), k)
    paths = [f"/mnt/nvme{k}/tierkv" for k in range(4)]
    assert fit(chain({"type": "nvme", "paths": paths, "capacity": "12TiB"})) == []
    # 16 TiB is 4 TiB on each: every drive is named
    found = fit(chain({"type": "nvme", "paths": paths, "capacity": "16TiB"}))
    assert len(found) == 4
    assert found[1].startswith(
        "tiers[0].capacity: 16TiB over 4 paths puts 4TiB in tiers[0].paths[1] (its share), "
        "more than the filesystem under"
    )
    assert found[1].endswith("holds (3.5TiB in all)")


def test_every_drive_is_checked_not_only_the_first(drives: dict[str, tuple[int, int]]) -> None:
    drives["/mnt/big"] = (100 * TiB, 0)
    drives["/mnt/small"] = (1 * TiB, 1)
    config = chain({"type": "nvme", "paths": ["/mnt/big/kv", "/mnt/small/kv"], "capacity": "4TiB"})
    [problem] = fit(config)
    assert problem.startswith("tiers[0].capacity: 4TiB over 2 paths puts 2TiB in tiers[0].paths[1]")


def test_directories_on_one_filesystem_share_it(drives: dict[str, tuple[int, int]]) -> None:
    """Two of the four directories on one drive: their two shares add up."""
    drives["/mnt/a"] = (int(3.84 * TB), 0)
    drives["/mnt/b"] = (int(3.84 * TB), 1)
    drives["/mnt/c"] = (int(3.84 * TB), 2)
    paths = ["/mnt/a/kv", "/mnt/b/kv", "/mnt/c/kv", "/mnt/a/kv2"]
    [problem] = fit(chain({"type": "nvme", "paths": paths, "capacity": "12TiB"}))
    assert problem.startswith(
        "tiers[0].capacity: 12TiB over 4 paths puts 6TiB in tiers[0].paths[0] + "
        "tiers[0].paths[3] (their 2 shares), more than the filesystem under"
    )
    assert fit(chain({"type": "nvme", "paths": paths, "capacity": "6TiB"})) == []


def test_tiers_sharing_a_drive_count_a_striped_tiers_share_of_it(
    drives: dict[str, tuple[int, int]],
) -> None:
    drives["/mnt/a"] = (4 * TiB, 0)
    drives["/mnt/b"] = (4 * TiB, 1)
    config = chain(
        {"type": "nvme", "path": "/mnt/a/one", "capacity": "2TiB"},
        {"type": "nvme", "paths": ["/mnt/a/two", "/mnt/b/two"], "capacity": "6TiB"},
    )
    assert fit(config) == [
        "tiers[0].capacity + 1/2 of tiers[1].capacity: 5.0TiB together is more than their "
        "shared filesystem holds (4.0TiB)"
    ]
    config = chain(
        {"type": "nvme", "path": "/mnt/a/one", "capacity": "2TiB"},
        {"type": "nvme", "paths": ["/mnt/a/two", "/mnt/b/two"], "capacity": "4TiB"},
    )
    assert fit(config) == []


def test_a_striped_tier_too_large_for_its_real_filesystem(tmp_path: Path) -> None:
    """Through `parse_config(check_machine=True)`, on the real filesystem under
    `tmp_path`: both directories are on it, so both shares count."""
    text = (
        "namespace: t\nlayout: {block_bytes: 4KiB, groups: [{block_size: 16}]}\n"
        "primary: {capacity: 1MiB, pin_memory: false}\n"
        f"tiers:\n  - {{type: nvme, paths: [{tmp_path}/a, {tmp_path}/b], capacity: 500TiB}}\n"
    )
    with pytest.raises(ConfigError) as err:
        parse_config(text, check_machine=True)
    [problem] = err.value.problems
    assert problem.startswith(
        "tiers[0].capacity: 500TiB over 2 paths puts 500TiB in tiers[0].paths[0] + "
        f"tiers[0].paths[1] (their 2 shares), more than the filesystem under '{tmp_path}'"
    )


# -- the chain check: no directory of one tier in another's -------------------------------
def test_every_directory_of_every_tier_is_compared(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    with pytest.raises(ConfigError) as err:
        chain(
            {"type": "nvme", "paths": [str(a), str(b)], "capacity": "1MiB"},
            {"type": "nvme", "name": "inner", "path": str(b / "inner"), "capacity": "1MiB"},
            {"type": "nvme", "name": "again", "paths": [str(c), f"{a}/"], "capacity": "1MiB"},
        )
    assert err.value.problems == [
        f"tiers[1].path: '{b}/inner' and tiers[0].paths[1] '{b}' nest; give each tier a "
        "directory of its own",
        f"tiers[2].paths[1]: '{a}' is also tiers[0].paths[0]",
    ]


def test_a_striped_tier_beside_separate_directories_is_accepted(tmp_path: Path) -> None:
    config = chain(
        {"type": "nvme", "paths": [str(tmp_path / "a"), str(tmp_path / "b")], "capacity": "1MiB"},
        {"type": "nvme", "name": "other", "path": str(tmp_path / "c"), "capacity": "1MiB"},
    )
    assert len(config.tiers) == 2


def test_a_plugins_list_of_paths_counts_too(tmp_path: Path) -> None:
    """Generic: any tier config with a list field `paths`, not only nvme's."""
    from tierkv.config.checks import path_problems

    class Spread(TierConfig):
        paths: list[str]

    first = Spread(type="spread", paths=[str(tmp_path / "x"), str(tmp_path / "y")])
    second = Spread(type="spread", paths=[str(tmp_path / "y" / "z")])
    assert path_problems([(0, first), (1, second)]) == [
        f"tiers[1].paths[0]: '{tmp_path}/y/z' and tiers[0].paths[1] '{tmp_path}/y' nest; "
        "give each tier a directory of its own"
    ]


# -- the scratch directory: every entry moves, `path` follows the first -------------------
def test_path_fields_names_every_directory_of_a_striped_tier() -> None:
    from tierkv.demo.scratch import path_fields

    config = chain({"type": "nvme", "paths": ["/srv/a/kv", "/srv/b/kv"], "capacity": "1MiB"})
    assert path_fields(config.tiers[0]) == {
        "paths[0]": Path("/srv/a/kv"),
        "paths[1]": Path("/srv/b/kv"),
    }  # `path`, the first of `paths`, is not named twice
    plain = chain({"type": "nvme", "path": "/srv/kv", "capacity": "1MiB"})
    assert path_fields(plain.tiers[0]) == {"path": Path("/srv/kv")}


def test_in_scratch_moves_each_directory_to_its_own_and_path_follows(tmp_path: Path) -> None:
    from tierkv.demo.scratch import in_scratch, tier_paths

    paths = ["/srv/a/kv", "/srv/b/kv", "/srv/c/kv"]
    config = chain(
        {"type": "nvme", "paths": paths, "capacity": "1MiB"},
        {"type": "nvme", "name": "one", "paths": ["/srv/d/kv"], "capacity": "1MiB"},
    )
    moved = in_scratch(config, tmp_path)
    tier = moved.tiers[0]
    expected = [tmp_path / "nvme" / f"paths-{k}" / "kv" for k in range(3)]
    assert tier.paths == expected  # type: ignore[attr-defined]
    assert tier.path == expected[0]  # type: ignore[attr-defined]
    assert tier_paths(moved) == {
        "nvme": [str(p) for p in expected],
        "one": [str(tmp_path / "one" / "kv")],
    }
    assert moved.tiers[1].path == tmp_path / "one" / "kv"  # type: ignore[attr-defined]
    # it still dumps as the YAML would be written, and validates again
    assert "path" not in tier.model_dump() and type(tier).model_validate(tier.model_dump())
    assert tier_paths(config)["nvme"] == paths  # the original is unchanged


def test_moved_values_keep_each_fields_kind_and_leave_a_yaml_section_as_written() -> None:
    from tierkv.demo.scratch import moved_values, with_paths

    class Dirs(TierConfig):
        data_dirs: tuple[str, ...]
        path: str

    tier = Dirs(type="dirs", data_dirs=("/d0", "/d1"), path="/d0")
    moved = with_paths(tier, {"data_dirs[1]": Path("/new/d1")})
    assert moved.data_dirs == ("/d0", "/new/d1") and moved.path == "/d0"
    # a YAML section with `paths` has no `path`: none is added (it would be an error)
    section = {"type": "nvme", "paths": ["/a", "/b"], "capacity": "1GiB"}
    assert moved_values(section, {"paths[0]": Path("/s/0"), "paths[1]": Path("/s/1")}) == {
        "paths": ["/s/0", "/s/1"]
    }
    with pytest.raises(KeyError):
        moved_values(section, {"paths[2]": Path("/s/2")})


# -- end to end: the demo and the round trip on a striped chain ---------------------------
@pytest.fixture
def temp_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The system's temporary directory for this test (where the scratch directory goes)."""
    import tempfile

    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


DEMO = [
    "--users", "3", "--turns", "3", "--system-tokens", "64", "--message-tokens", "32",
    "--reply-tokens", "2", "--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "256",
    "--device", "cpu", "--primary", "32KiB",
]  # fmt: skip


def test_demo_and_roundtrip_on_a_striped_chain_leave_its_directories_alone(
    tmp_path: Path,
    temp_root: Path,
    capsys: pytest.CaptureFixture[str],
    chain_file: Callable[..., str],
) -> None:
    drives = [tmp_path / f"drive{k}" / "kv" for k in range(3)]
    drives[0].parent.mkdir()  # one drive's directory exists (empty), the others do not
    config = chain_file(
        f"[{{type: nvme, paths: [{', '.join(map(str, drives))}], capacity: 64MiB, fsync: never}}]"
    )
    assert main(["demo", *DEMO, "--config", config, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tiers"]["nvme"]["blocks_served"] > 0  # the striped tier really served
    used = [Path(p) for p in report["tier_files"]["paths"]["nvme"]]
    assert len(used) == 3 and len(set(used)) == 3
    assert all(p.is_relative_to(temp_root) and p.name == "kv" for p in used)

    assert main(["roundtrip", "--config", config, "--blocks", "24", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["mismatched"] == 0 and report["missing"] == 0
    assert report["tier_blocks"] == {"nvme": 24}
    assert len(report["paths"]["nvme"]) == 3

    assert not any(d.exists() for d in drives), "the chain's own directories are left alone"
    assert list(drives[0].parent.iterdir()) == []
    assert list(temp_root.iterdir()) == [], "the scratch directories are removed at exit"


def test_bench_on_a_striped_chain_measures_in_scratch_directories_on_each_drive(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], chain_file: Callable[..., str]
) -> None:
    """`tierkv bench --config` moves every directory of a striped tier into its own
    `.tierkv-bench-*` directory on that drive and removes them after (it used to fail
    on a `paths[i]` field)."""
    drives = [tmp_path / f"drive{k}" for k in range(2)]
    for drive in drives:
        drive.mkdir()
    config = chain_file(
        f"[{{type: nvme, paths: [{', '.join(map(str, drives))}], capacity: 64MiB, fsync: never}}]"
    )
    args = ["bench", "--config", config, "--tiers", "nvme", "--keys", "0", "--repeat", "1"]
    assert main([*args, "--total", "4MiB", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [m["medium"] for m in report["media"]] == ["nvme"]
    assert all(list(drive.iterdir()) == [] for drive in drives)
