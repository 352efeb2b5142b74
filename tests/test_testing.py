"""Helpers in tierkv.testing that tier packages rely on."""

from __future__ import annotations

import pytest

from tierkv.testing import missing_server


def test_missing_server_fails_under_ci_and_skips_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true: a missing server is a failure"):
        missing_server("a real redis-server", FileNotFoundError("redis-server"))
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="needs a real redis-server"):
        missing_server("a real redis-server", FileNotFoundError("redis-server"))
