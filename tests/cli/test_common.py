"""What the commands share (tierkv.cli.common): sizes on the command line are read by
the YAML's parser (`tierkv.contract.units.parse_size`), with the same messages."""

from __future__ import annotations

import argparse

import pytest

from tierkv.cli import main
from tierkv.cli.common import block_size, size


def test_a_decimal_block_size_is_refused_as_in_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--block-size", "2MB", "--tiers", "cpu", "--keys", "0"]) == 2
    err = capsys.readouterr().err
    assert "did you mean '2MiB'?" in err and "block sizes are binary" in err


def test_a_size_in_bits_is_refused() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="in bits"):
        size("4Gb")


def test_a_decimal_capacity_is_read_with_a_warning(capsys: pytest.CaptureFixture[str]) -> None:
    assert size("2MB") == 2_000_000
    assert "did you mean '2MiB' (2,097,152 bytes)? Write 2000000" in capsys.readouterr().err


def test_binary_sizes_and_plain_numbers_pass_quietly(capsys: pytest.CaptureFixture[str]) -> None:
    assert block_size("2MiB") == 2 << 20 and size("4096") == 4096
    assert capsys.readouterr().err == ""


def test_a_negative_size_must_be_positive() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="must be positive"):
        size("-1GiB")
