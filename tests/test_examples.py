"""Every example runs: the chain files validate (and connect to real servers), the
demo runs on the embedded chain, the custom tier and the async server work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tierkv.cli import main
from tierkv.config import load_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
CHAINS = EXAMPLES / "chains"
TINY_DEMO = [
    "--users", "2", "--turns", "2", "--system-tokens", "64", "--message-tokens", "32",
    "--reply-tokens", "2", "--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "256",
]  # fmt: skip


@pytest.fixture
def s3_endpoint(moto_server: Any) -> str:
    moto_server.create_bucket("archive")
    return str(moto_server.endpoint_url)


# -- chains/*.yaml ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "tiers"),
    [
        ("embedded", [("nvme", "write_through")]),
        ("shared", [("nvme", "write_through"), ("redis", "write_through_selective")]),
        ("archive", [("redis", "write_through"), ("s3", "write_back")]),
    ],
)
def test_chain_files_validate_with_their_defaults(
    name: str, tiers: list[tuple[str, str]], capsys: pytest.CaptureFixture[str]
) -> None:
    # every ${VAR:-default} unset; the nvme path defaults under $HOME
    config = load_config(CHAINS / f"{name}.yaml", env={"HOME": "/home/someone"})
    assert [(t.type, t.write_policy) for t in config.tiers] == tiers
    for tier in config.tiers:
        if tier.type == "nvme":
            assert str(tier.path) == "/home/someone/.cache/tierkv/nvme"  # type: ignore[attr-defined]
    assert main(["validate", str(CHAINS / f"{name}.yaml")]) == 0
    assert "ok (namespace 'llama3-8b-bf16-tp1', 4096 primary blocks" in capsys.readouterr().out


def test_chain_files_take_their_settings_from_the_environment() -> None:
    env = {"TIERKV_PRIMARY": "1GiB", "REDIS_URL": "redis://kv:6380/2", "S3_URL": "s3://kvb/p"}
    config = load_config(CHAINS / "archive.yaml", env=env)
    redis, s3 = config.tiers
    assert config.primary_blocks == 512
    assert redis.model_dump()["url"] == "redis://kv:6380/2"
    assert s3.model_dump()["url"] == "s3://kvb/p"


def test_demo_runs_on_the_embedded_chain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TIERKV_NVME_PATH", str(tmp_path / "kv"))
    chain = str(CHAINS / "embedded.yaml")
    args = ["demo", *TINY_DEMO, "--config", chain, "--primary", "64KiB", "--keep"]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and [t["name"] for t in report["chain"]["tiers"]] == ["nvme"]
    assert report["tiers"]["nvme"]["bytes_in"] > 0
    assert any((tmp_path / "kv").rglob("*")), "the nvme tier wrote under TIERKV_NVME_PATH"


def test_shared_chain_connects_to_its_tiers(
    tmp_path: Path,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("TIERKV_NVME_PATH", str(tmp_path / "kv"))
    monkeypatch.setenv("REDIS_URL", redis_url)
    assert main(["validate", "--connect", "--create", str(CHAINS / "shared.yaml")]) == 0
    out = capsys.readouterr().out
    assert "  nvme: ok (open " in out and "  redis: ok (open " in out


def test_archive_chain_connects_to_its_tiers(
    redis_url: str,
    s3_endpoint: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("S3_URL", "s3://archive/kv")
    monkeypatch.setenv("S3_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    assert main(["validate", "--connect", str(CHAINS / "archive.yaml")]) == 0
    out = capsys.readouterr().out
    assert "  redis: ok (open " in out and "  s3: ok (open " in out


# -- custom_tier.py ------------------------------------------------------------------------
def test_custom_tier_example_round_trips_through_its_tier() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "custom_tier.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "loaded 32 blocks back byte-identical; served by {'dict': 32}" in done.stdout


# -- async_server.py -----------------------------------------------------------------------
def _call(base: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(base + path, data=data, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            raw = response.read()
            status = response.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw.decode()


def test_async_server_serves_concurrent_completions_sharing_a_prefix(tmp_path: Path) -> None:
    cmd = [
        sys.executable, str(EXAMPLES / "async_server.py"), "--port", "0",
        "--layers", "1", "--hidden", "32", "--heads", "2", "--gpu-blocks", "64",
    ]  # fmt: skip
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("listening on http://"), line + proc.stderr.read()
        base = line.split()[-1]
        system = list(range(1, 97))  # 96 shared tokens: 3 offloaded blocks of 32
        first = _call(base, "/v1/completions", {"prompt": [*system, 5], "max_tokens": 3})
        assert first[0] == 200 and first[1]["reused_tokens"] == 0
        with ThreadPoolExecutor(4) as pool:
            answers = list(
                pool.map(
                    lambda i: _call(
                        base, "/v1/completions", {"prompt": [*system, i, i], "max_tokens": 3}
                    ),
                    range(10, 14),
                )
            )
        for status, body in answers:
            assert status == 200 and len(body["tokens"]) == 3
            assert body["reused_tokens"] == 96 and sum(body["sources"].values()) == 3
        status, text = _call(base, "/v1/completions", {"prompt": "hello", "max_tokens": 2})
        assert status == 200 and text["prompt_tokens"] == 5
        assert _call(base, "/v1/completions", {"prompt": [], "max_tokens": 2})[0] == 400
        assert _call(base, "/v1/completions", {"prompt": [1], "max_tokens": 0})[0] == 400
        assert _call(base, "/nowhere")[0] == 404
        status, stats = _call(base, "/stats")
        assert status == 200 and stats["primary"]["hits"] >= 12
        status, metrics = _call(base, "/metrics")
        assert status == 200 and 'tierkv_lookups_total{namespace="tierkv-demo-' in metrics
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "shutting down" in out


def test_async_server_on_the_embedded_chain_writes_under_the_users_home(tmp_path: Path) -> None:
    """No /var/cache: the chain's default nvme path is per user, and the server says so."""
    cmd = [
        sys.executable, str(EXAMPLES / "async_server.py"), "--port", "0",
        "--config", str(CHAINS / "embedded.yaml"),
        "--layers", "1", "--hidden", "32", "--heads", "2", "--gpu-blocks", "64",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TIERKV_", "XDG_"))}
    env.update(HOME=str(tmp_path), TIERKV_PRIMARY="16MiB")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        assert line.startswith("listening on http://"), line + proc.stderr.read()
        status, body = _call(line.split()[-1], "/v1/completions", {"prompt": list(range(70))})
        assert status == 200 and len(body["tokens"]) == 16
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    where = tmp_path / ".cache" / "tierkv" / "nvme"
    assert f"tier nvme keeps its blocks under {where}" in err
    assert any(where.rglob("*")), "the nvme tier wrote under ~/.cache/tierkv/nvme"


# -- hybrid_conversation.py ----------------------------------------------------------------------
def test_the_hybrid_conversation_moves_only_the_window_and_the_states() -> None:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "hybrid_conversation.py"), "--json", "--turns", "4",
         "--turn-tokens", "256", "--window", "64", "--checkpoint-every", "256",
         "--block-bytes", "1024"],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    results = json.loads(out.stdout)
    # 16 blocks a turn: the full group stores them all and loads every earlier turn's
    for name in results:
        assert results[name][0] == {"stored": 64, "skipped": 0, "loaded": 16 * (1 + 2 + 3)}
    # the window before each turn's end: 4 blocks stored a turn, 4 loaded
    assert results["full+sliding_window"][1] == {"stored": 16, "skipped": 48, "loaded": 12}
    # one state a turn, one loaded
    assert results["full+state"][1] == {"stored": 4, "skipped": 60, "loaded": 3}
