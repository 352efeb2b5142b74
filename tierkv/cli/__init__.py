"""The `tierkv` command.

    tierkv demo [--config FILE]        a small transformer's chat workload with and
                                       without tierkv: TTFT, hit rate per tier, checks
    tierkv bench [--config FILE]       each tier's MB/s as a ratio to its raw medium,
                                       and the orchestrator's own cost
    tierkv bench trace FILE            a request trace replayed through real tiers
    tierkv validate FILE [--connect]   check a YAML chain (and its sizes against this
                                       machine); --connect checks each tier
    tierkv plugins                     installed tier types and their config fields
    tierkv roundtrip [--config FILE]   store -> lookup -> load of random blocks through
                                       a TieredCache of the chain
    tierkv vllm check CONFIG           a --kv-transfer-config read as vLLM will
    tierkv sglang check CONFIG         a HiCache storage extra config read as SGLang will
    tierkv lmcache check CONFIG        an --l2-adapter JSON read as LMCache's server will

Every command and option is in docs/cli.md (tests/cli/test_cli_docs.py keeps the two
in step). Without --config, demo, bench and roundtrip run a default chain whose files
are in a temporary directory, removed afterwards. With --config, the demo and the
round trip move the tiers' files into a temporary directory too (unless --keep), and
the bench measures each disk tier in a temporary directory made in its path.

Exit codes: 0 ok, 2 bad usage or config, 1 runtime failure (a tier that cannot be
reached, a failed check). Errors go to stderr as one line (a config error lists its
problems one per line); --verbose adds the traceback and debug logs. When stderr is
not a terminal, demo and bench write plain progress lines there (one per phase, or
every few seconds) instead of a progress bar. JSON output (--json) keeps numbers and
booleans typed.

One module per command (`add_parser` and the function it runs), `common` for what
they share, `app` for the parser and `main`.
"""

from __future__ import annotations

from tierkv.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
