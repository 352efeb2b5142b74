"""`BenchOptions` and the CLI's sizes: a bad one is a usage error that names it."""

from __future__ import annotations

import pytest

from tierkv.cli import main


def test_a_total_under_one_block_or_a_bad_size_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "--total", "1KiB", "--block-size", "4KiB"]) == 2
    assert "less than one block" in capsys.readouterr().err
    assert main(["bench", "--block-size", "lots"]) == 2
    assert "'lots' is not a size" in capsys.readouterr().err
