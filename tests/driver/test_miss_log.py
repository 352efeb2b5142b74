"""`MissLog`: the first failure of each kind is a warning, the rest debug lines."""

from __future__ import annotations

import logging

import pytest

from tierkv.driver.miss_log import MissLog


def test_one_warning_per_call_and_exception_type(caplog: pytest.LogCaptureFixture) -> None:
    log = MissLog(logging.getLogger("tierkv.test.misses"))
    with caplog.at_level(logging.DEBUG, logger="tierkv.test.misses"):
        log.failed("load", OSError("disk gone"))
        log.failed("load", OSError("still gone"))
        log.failed("load", TimeoutError("slow"))
        log.failed("store", OSError("disk gone"))
    levels = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [lvl for lvl, _ in levels] == ["WARNING", "DEBUG", "WARNING", "WARNING"]
    assert levels[0][1] == "tierkv load failed (OSError: disk gone); answered a miss"
