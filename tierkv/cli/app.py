"""The parser of the `tierkv` command and `main`: one module per command
(`tierkv.cli.demo`, `.bench`, `.validate`, `.plugins`, `.roundtrip`, `.vllm`,
`.sglang`, `.lmcache`), each with `add_parser` and the function it runs; errors become exit codes
here."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence

from tierkv import __version__
from tierkv.cli import bench, demo, lmcache, plugins, roundtrip, sglang, validate, vllm
from tierkv.cli.common import UsageError, one_line
from tierkv.contract.errors import ConfigError, TierKVError

COMMANDS = (demo, bench, validate, plugins, roundtrip, vllm, sglang, lmcache)


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--verbose",
        "-v",
        action="store_true",
        default=argparse.SUPPRESS,
        help="tracebacks and debug logs",
    )
    parser = argparse.ArgumentParser(
        prog="tierkv",
        description="Keeps an LLM server's KV cache alive after it leaves the GPU: a chain "
        "of storage tiers (CPU memory, NVMe, Redis, S3, Mooncake, plugins) with cascade "
        "down and staged promotion up. Exit codes: 0 ok, 2 bad usage or config, 1 runtime "
        "failure.",
        parents=[common],
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"tierkv {__version__} (distribution tierkv-cache)",
        help="print the version and exit",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub, [common])
    return parser


class _EngineImportNoise(logging.Filter):
    """vLLM's warning that its compiled ops are missing (`Failed to import from
    vllm._C`): the checks read configs with vLLM's parser and run no kernel, and a
    wheel installed for them (scripts/setup-vllm.sh, CPU torch) has none. Every other
    record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Failed to import from vllm._C")


_ENGINE_NOISE = _EngineImportNoise()


def configure_logging(verbose: bool) -> None:
    """The command's own logging: warnings and errors (everything with --verbose), one
    line each, on stderr. Without --verbose the engines' import chatter is left out:
    LMCache's INFO lines (each of its loggers reads LMCACHE_LOG_LEVEL when it is made,
    so a level the user set stays theirs) and vLLM's missing-kernels warning; their
    real warnings still show."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    interface = logging.getLogger("vllm.platforms.interface")
    if verbose:
        interface.removeFilter(_ENGINE_NOISE)
        return
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    interface.addFilter(_ENGINE_NOISE)


def _first_leaf(exc: BaseException) -> BaseException:
    """The first real error inside an exception group (a task group's failure)."""
    inner = getattr(exc, "exceptions", None)
    while isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
        exc = inner[0]
        inner = getattr(exc, "exceptions", None)
    return exc


def _closed_pipe() -> int:
    """The reader of stdout went away (`tierkv plugins --json | head -1`): stop quietly,
    as a Unix tool killed by SIGPIPE does (exit 141), and point stdout at /dev/null so
    the interpreter's last flush does not complain."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return 141


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help (0) or a usage error (2), already printed
            sys.stdout.flush()  # `tierkv --help | head -1`: a closed pipe shows here
            return exc.code if isinstance(exc.code, int) else 2
    except BrokenPipeError:
        return _closed_pipe()
    verbose = getattr(args, "verbose", False)
    configure_logging(verbose)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        code = func(args)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        return _closed_pipe()
    except KeyboardInterrupt:
        print("tierkv: interrupted", file=sys.stderr)
        return 130
    except Exception as raised:
        if verbose:
            traceback.print_exc()
        error = _first_leaf(raised)
        if isinstance(error, BrokenPipeError):
            return _closed_pipe()
        if isinstance(error, KeyboardInterrupt):
            print("tierkv: interrupted", file=sys.stderr)
            return 130
        if isinstance(error, ConfigError):
            print(f"tierkv: {error}", file=sys.stderr)
            return 2
        if isinstance(error, UsageError):
            print(f"tierkv {args.command}: error: {error}", file=sys.stderr)
            return 2
        kind = "" if isinstance(error, TierKVError) else f"{type(error).__name__}: "
        hint = "" if verbose else " (--verbose for the traceback)"
        print(f"tierkv: error: {kind}{one_line(str(error))}{hint}", file=sys.stderr)
        return 1
