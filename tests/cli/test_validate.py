"""`tierkv validate` (tierkv.cli.validate): ok and errors by YAML path, sizes against
this machine, no secret shown, and `--connect` opening each tier."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tierkv.cli import main


def test_validate_reports_ok_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(
        "namespace: t\nlayout: {block_bytes: 4KiB, groups: [{block_size: 16}]}\n"
        "primary: {capacity: 1MiB}\ntiers: [{type: memory}]\n"
    )
    assert main(["validate", str(good)]) == 0
    assert "ok (namespace 't', 256 primary blocks, tiers: memory)" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text(good.read_text().replace("memory", "floppy"))
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "tiers[0].type: unknown tier type 'floppy'" in err


def test_validate_connect_opens_each_tier_and_times_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], chain_file: Callable[..., str]
) -> None:
    config = chain_file(f"[{{type: memory}}, {{type: nvme, path: {tmp_path}/kv, capacity: 1MiB}}]")
    assert main(["validate", "--connect", "--create", config]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("tiers: memory, nvme); checking each tier:")
    assert lines[1].startswith("  memory: ok (open ") and "ms, lookup " in lines[1]
    assert lines[2].startswith("  nvme: ok (open ") and f"created {tmp_path}/kv" in lines[2]
    assert lines[3].endswith(": ok (every tier usable)")


def test_validate_connect_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], chain_file: Callable[..., str]
) -> None:
    """A tier that keeps files is not opened (opening creates its directory); its path
    is checked instead, and the output says so."""
    where = tmp_path / "deep" / "dir" / "kv"
    config = chain_file(f"[{{type: nvme, path: {where}, capacity: 1MiB}}]")
    assert main(["validate", "--connect", config]) == 0
    out = capsys.readouterr().out
    assert not (tmp_path / "deep").exists()
    assert "nvme: ok, not opened (it keeps files; --create opens it)" in out
    assert f"{where} does not exist (the tier creates it under {tmp_path})" in out


def test_validate_connect_fails_a_path_that_cannot_be_created(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], chain_file: Callable[..., str]
) -> None:
    (tmp_path / "file").write_text("")
    config = chain_file(f"[{{type: nvme, path: {tmp_path}/file/kv, capacity: 1MiB}}]")
    assert main(["validate", "--connect", config]) == 1
    captured = capsys.readouterr()
    assert f"nvme: FAILED: {tmp_path}/file/kv does not exist and {tmp_path}/file is not a " in (
        captured.out
    )
    assert ": ok" not in captured.out


def test_validate_create_needs_connect(
    capsys: pytest.CaptureFixture[str], chain_file: Callable[..., str]
) -> None:
    assert main(["validate", "--create", chain_file("[{type: memory}]")]) == 2
    assert "--create needs --connect" in capsys.readouterr().err


def test_validate_connect_reports_a_tier_it_cannot_reach(
    tmp_path: Path,
    broken_tier: str,
    capsys: pytest.CaptureFixture[str],
    chain_file: Callable[..., str],
) -> None:
    config = chain_file("[{type: memory}, {type: broken}]")
    assert main(["validate", config]) == 0  # the file itself is fine
    capsys.readouterr()
    assert main(["validate", "--connect", config]) == 1
    captured = capsys.readouterr()
    assert "  memory: ok (open " in captured.out
    assert "every tier usable" not in captured.out  # the file's `ok` only when all passed
    assert ": ok (namespace" not in captured.out
    assert (
        "  broken: FAILED: open failed: ConnectionRefusedError: connection refused by "
        "127.0.0.1:1" in captured.out
    )
    assert captured.err.strip() == "tierkv: error: cannot use tier broken"


def test_validate_connect_skips_an_optional_tier_it_cannot_reach(
    tmp_path: Path,
    broken_tier: str,
    capsys: pytest.CaptureFixture[str],
    chain_file: Callable[..., str],
) -> None:
    """An optional tier (required: false) that cannot be used is not fatal: the cache
    would run without it, so validate says so and exits 0 (issue 53)."""
    config = chain_file(
        f"[{{type: memory}}, {{type: broken, required: false}}, "
        f"{{type: nvme, name: disk, required: false, path: {tmp_path}/file/kv, capacity: 1MiB}}]"
    )
    (tmp_path / "file").write_text("")
    assert main(["validate", "--connect", config]) == 0
    captured = capsys.readouterr()
    assert "  memory: ok (open " in captured.out
    assert (
        "  broken: skipped (optional, required: false): open failed: ConnectionRefusedError: "
        "connection refused by 127.0.0.1:1; the cache would run without it" in captured.out
    )
    assert "  disk: skipped (optional, required: false): " in captured.out
    assert "FAILED" not in captured.out and captured.err == ""
    assert captured.out.rstrip().endswith(
        ": ok without the optional tier broken, disk (every required tier usable; the "
        "cache would run without it)"
    )


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            "primary: {capacity: 99999TiB}\ntiers: []\n",
            "primary.capacity: 99999TiB is more than this machine's memory",
        ),
        (
            "primary: {capacity: 1MiB}\ntiers: [{type: nvme, path: PATH/kv, capacity: 500TiB}]\n",
            "tiers[0].capacity: 500TiB is more than the filesystem under 'PATH' holds",
        ),
        (
            "primary: {capacity: 1MiB}\n"
            "tiers: [{type: nvme, path: PATH/kv, capacity: 1MiB}, "
            "{type: nvme, path: PATH/kv, capacity: 1MiB}]\n",
            "tiers[1].path: 'PATH/kv' is also the path of tiers[0]",
        ),
        ("primary: {capacity: 1MiB}\nprimary: {capacity: 2MiB}\n", "primary: duplicate key"),
        (
            "primary: {capacity: 1MiB}\ntiers: [{type: memory, name: cpu}]\n",
            "tiers[0].name: 'cpu' is the primary's name",
        ),
    ],
)
def test_validate_exits_2_naming_the_path(
    body: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "chain.yaml"
    path.write_text(
        "namespace: t\nlayout: {block_bytes: 4KiB, groups: [{block_size: 16}]}\n"
        + body.replace("PATH", str(tmp_path))
    )
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"invalid tierkv config in {path}:" in err
    assert message.replace("PATH", str(tmp_path)) in err, err


def test_validate_a_file_that_is_not_utf8_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "chain.yaml"
    path.write_bytes(b"namespace: caf\xe9\n")
    assert main(["validate", str(path)]) == 2
    assert "line 1, column 15: byte 0xe9 is not UTF-8" in capsys.readouterr().err


def test_validate_never_prints_a_secret(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "chain.yaml"
    path.write_text(
        "namespace: t\nlayout: {block_bytes: 4KiB, groups: [{block_size: 16}]}\n"
        "primary: {capacity: 1MiB}\n"
        "tiers:\n  - 'redis://:hunter2@10.0.0.5:6379/0'\n"
        "  - {type: s3, url: 's3://AKIA:hunter2@bucket/p'}\n"
    )
    assert main(["validate", str(path)]) == 2
    captured = capsys.readouterr()
    assert "hunter2" not in captured.err + captured.out
    assert "tiers[0]: expected a mapping" in captured.err


def test_validate_reports_structural_and_machine_problems_in_one_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A user fixes a file once: problems of its structure, its units and what could
    never fit this machine come in one message, not one after another."""
    path = tmp_path / "chain.yaml"
    path.write_text(
        "namespace: t\nlayout: {block_bytes: 4KiB, groups: [{block_size: 16}]}\n"
        "primary: {capacity: 99999TiB}\n"
        f"tiers:\n  - {{type: nvme, path: {tmp_path}/kv, capacity: 500TiB}}\n"
        "  - {type: floppy}\n"
        "  - {type: memory, job_timeout: '30 seconds'}\n"
        "  - {type: memory, capacity: 4Gb}\n"
    )
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    expected = [
        "primary.capacity: 99999TiB is more than this machine's memory",
        f"tiers[0].capacity: 500TiB is more than the filesystem under '{tmp_path}' holds",
        "tiers[1].type: unknown tier type 'floppy'",
        "tiers[2].job_timeout:",
        "tiers[3].capacity:",
    ]
    for message in expected:
        assert message in err, (message, err)


def test_validate_says_what_each_quota_holds_and_where_it_is_enforced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "chain.yaml"
    path.write_text(
        "namespace: t\nlayout: {block_bytes: 4KiB, groups: [{block_size: 16}]}\n"
        "primary: {capacity: 1MiB}\n"
        "tiers: [{type: memory, capacity: 1MiB}, {type: redis, url: 'redis://127.0.0.1:1'}]\n"
        "tenants: {quotas: {primary: {tenants: {acme: 50%}, default: 10%},\n"
        "                   memory: {borrow: false, tenants: {acme: 256KiB}},\n"
        "                   redis: {default: 64KiB}}}\n"
    )
    assert main(["validate", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:] == [
        "  quotas on primary: acme 50% (guaranteed), others 10% each (cap), borrowing free "
        "room; enforced",
        "  quotas on memory: acme 256KiB (guaranteed), no borrowing; enforced",
        "  quotas on redis: others 64KiB each (cap), borrowing free room; counted, not "
        "enforced: a redis tier cannot name its victims",
    ]


def test_validate_refuses_quotas_that_cannot_all_be_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "chain.yaml"
    path.write_text(
        "namespace: t\nlayout: {block_bytes: 4KiB, groups: [{block_size: 16}]}\n"
        "primary: {capacity: 1MiB}\n"
        "tenants: {quotas: {primary: {tenants: {a: 768KiB, b: 50%}}, nvme: {default: 1%}}}\n"
    )
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "tenants.quotas: 'nvme' names no tier of the chain; use one of 'primary'" in err
    assert "tenants.quotas.primary.tenants: the named quotas (a: 768KiB, b: 50%) add up" in err
