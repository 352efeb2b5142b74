"""A conversation-shaped request trace in the Mooncake JSONL format, to judge caching
policies on a workload whose reuse is all "the next turn re-sends the conversation".

Why it exists: the shared synthetic trace is mostly documents and one-shot prompts; on
a real conversation trace `admission: reuse` lost up to 43 % of write-all's hits where
the tier was large (issue 36), which that trace hid. This one is generated, so anyone
can replay it, and its knobs say what it is made of:

- `sessions` conversations, each of `turns` turns (drawn uniformly from the range);
- every session starts with a system prompt of `system_tokens` shared by all
  sessions, then a first message of `first_tokens`;
- each later turn's prompt is the whole previous conversation (the previous prompt and
  its reply, `output_tokens`) plus a new message of `turn_tokens`;
- `concurrent` sessions are open at once: each request is the next turn of one of them
  drawn at random, and a session that ends is replaced by the next one (1: sessions one
  after another; `sessions`: all interleaved from the start). More open sessions put
  more other requests between two turns of one conversation.
- arrivals are Poisson at `rate` requests per second.

`hash_ids` name the prompt's whole blocks of `block_tokens` tokens (a trailing partial
block gets no id: a prefix cache keeps whole blocks only), so a turn's ids extend the
previous turn's of its session exactly. Ids count up from 0 (the system prompt's
first). Deterministic: the same spec and seed give the same file.

The defaults (600 sessions of 2-8 turns, 256 open at once: about 3,000 requests and
15,000 distinct blocks) spread each conversation's turns far enough apart that a plain
LRU's hit rate keeps rising from 5 % to 50 % of the distinct blocks, as on Mooncake's
conversation trace, so a capacity sweep over those sizes tells policies apart; with 32
open sessions a tier of 12 % already holds every live conversation.

A tenant mix, to show what one tenant's flood costs another (and what a quota gives
back): with `flooder_rate` K above 0 (`--flooder`: 10), the conversations are tenant
`A` and a second stream is tenant `B`, a flooder: one-off prompts of `flooder_blocks`
whole blocks (drawn uniformly), their ids fresh and never used again, counting up
from past A's last id, so B never shares a block with A or with itself. B's arrivals
are Poisson at K times `rate`, from the start to A's last request, merged with A's by
time (A first on a tie): about K of B's requests per A request. A's requests are
exactly those of the same spec and seed without the flooder (B draws from its own
random stream), plus their tenant. Each request then carries its `tenant` (the
trace format's optional field); without a flooder no line has one, as before.
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from tierkv.trace.format import TRACE_BLOCK_TOKENS, TraceRequest

Range = tuple[int, int]

CONVERSATION_TENANT = "A"
"""The conversations' tenant in a trace with a flooder."""
FLOODER_TENANT = "B"
"""The flooder's tenant."""
FLOODER_RATE = 10.0
"""`--flooder`: the flooder's requests per conversation request."""


@dataclass(frozen=True)
class ConversationSpec:
    """What a generated conversation trace is made of (see the module doc); token
    ranges are inclusive and drawn uniformly."""

    sessions: int = 600
    turns: Range = (2, 8)
    system_tokens: int = 1024
    first_tokens: Range = (2000, 12000)
    turn_tokens: Range = (100, 2000)
    output_tokens: Range = (100, 800)
    block_tokens: int = TRACE_BLOCK_TOKENS
    concurrent: int = 256
    rate: float = 4.0
    flooder_rate: float = 0.0
    flooder_blocks: Range = (8, 32)

    def __post_init__(self) -> None:
        for name in ("sessions", "block_tokens", "concurrent"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.system_tokens < 0:
            raise ValueError(f"system_tokens must be >= 0, got {self.system_tokens}")
        if self.rate <= 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if not self.flooder_rate >= 0:  # NaN too
            raise ValueError(f"flooder_rate must be >= 0 (0: no flooder), got {self.flooder_rate}")
        lo, hi = self.flooder_blocks
        if not 1 <= lo <= hi:
            raise ValueError(
                f"flooder_blocks must be a range LO-HI with 1 <= LO <= HI, got {lo}-{hi}"
            )
        for name in ("turns", "first_tokens", "turn_tokens", "output_tokens"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi or (name == "turns" and lo < 1):
                raise ValueError(f"{name} must be a range LO-HI with 0 <= LO <= HI, got {lo}-{hi}")


@dataclass(frozen=True)
class Turn:
    """One generated request and where it sits: its session and turn (from 0)."""

    session: int
    turn: int
    request: TraceRequest


@dataclass
class _Session:
    number: int
    turns: int
    tokens: int  # the conversation so far: prompt and reply of the last turn
    ids: list[int]
    done: int = 0
    reply: int = 0  # the last turn's output tokens


class _Ids:
    """Block ids in order of first use: a block's id is new when its tokens are."""

    def __init__(self, system_blocks: int) -> None:
        self.next = system_blocks

    def take(self, n: int) -> list[int]:
        ids = list(range(self.next, self.next + n))
        self.next += n
        return ids


def generate(spec: ConversationSpec, seed: int = 0) -> Iterator[Turn]:
    """The trace's requests in arrival order (see the module doc): the conversations,
    and with `flooder_rate` the flooder's one-off prompts merged in by time."""
    if not spec.flooder_rate:
        return _conversations(spec, seed)
    return _with_flooder(spec, seed, list(_conversations(spec, seed)))


def _with_flooder(spec: ConversationSpec, seed: int, turns: list[Turn]) -> Iterator[Turn]:
    """`turns` (the conversations) as tenant A, merged by time with tenant B's one-off
    prompts (`_flood`), A first on a tie."""
    end = turns[-1].request.timestamp_ms if turns else 0.0
    fresh = 1 + max((max(t.request.hash_ids, default=-1) for t in turns), default=-1)
    flood = _flood(spec, seed, end, fresh)
    waiting = next(flood, None)
    for turn in turns:
        while waiting is not None and waiting.request.timestamp_ms < turn.request.timestamp_ms:
            yield waiting
            waiting = next(flood, None)
        yield replace(turn, request=replace(turn.request, tenant=CONVERSATION_TENANT))
    if waiting is not None:
        yield waiting
        yield from flood


def _flood(spec: ConversationSpec, seed: int, end_ms: float, fresh: int) -> Iterator[Turn]:
    """Tenant B's prompts: Poisson arrivals at `flooder_rate` times `rate` up to
    `end_ms`, each a session of one turn (numbered after the conversations) whose ids
    count up from `fresh`, so none is A's or an earlier prompt's. Its own random
    stream: the conversations draw the same with or without it."""
    rng = random.Random(f"{seed}/flooder")
    rate = spec.rate * spec.flooder_rate
    number = spec.sessions
    now = rng.expovariate(rate)
    while round(now * 1000) <= end_ms:
        blocks = rng.randint(*spec.flooder_blocks)
        ids = tuple(range(fresh, fresh + blocks))
        fresh += blocks
        reply = rng.randint(*spec.output_tokens)
        tokens = blocks * spec.block_tokens
        yield Turn(number, 0, TraceRequest(round(now * 1000), tokens, reply, ids, FLOODER_TENANT))
        number += 1
        now += rng.expovariate(rate)


def _conversations(spec: ConversationSpec, seed: int) -> Iterator[Turn]:
    """The conversations' requests in arrival order, no tenant named."""
    rng = random.Random(seed)
    block = spec.block_tokens
    system = list(range(spec.system_tokens // block))
    ids = _Ids(len(system))
    pending = iter(range(spec.sessions))
    open_: list[_Session] = []
    now = 0.0

    def start(number: int) -> _Session:
        tokens = spec.system_tokens + rng.randint(*spec.first_tokens)
        return _Session(number, rng.randint(*spec.turns), tokens, list(system))

    for number in pending:
        open_.append(start(number))
        if len(open_) == spec.concurrent:
            break
    while open_:
        session = open_[rng.randrange(len(open_))]
        if session.done:  # the reply to the last turn and a new message
            session.tokens += session.reply + rng.randint(*spec.turn_tokens)
        whole = session.tokens // block
        session.ids.extend(ids.take(whole - len(session.ids)))
        session.reply = rng.randint(*spec.output_tokens)
        request = TraceRequest(round(now * 1000), session.tokens, session.reply, tuple(session.ids))
        yield Turn(session.number, session.done, request)
        session.done += 1
        now += rng.expovariate(spec.rate)
        if session.done == session.turns:
            open_.remove(session)
            nxt = next(pending, None)
            if nxt is not None:
                open_.append(start(nxt))


def write_trace(turns: Iterator[Turn], path: Path) -> int:
    """Write `turns` as Mooncake JSONL (`timestamp`, `input_length`, `output_length`,
    `hash_ids`, and `tenant` where a request has one: nothing else, so any Mooncake
    reader takes it); returns the count."""
    n = 0
    with path.open("w", encoding="utf-8") as f:
        for turn in turns:
            r = turn.request
            line = {
                "timestamp": int(r.timestamp_ms),
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.hash_ids),
            }
            if r.tenant is not None:
                line["tenant"] = r.tenant
            f.write(json.dumps(line) + "\n")
            n += 1
    return n


def _range(text: str) -> Range:
    """`LO-HI` or `N` (both ends N)."""
    lo, _, hi = text.partition("-")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not N or LO-HI") from None


HELP = {
    "sessions": "conversations in the trace",
    "turns": "turns per conversation, drawn uniformly",
    "system_tokens": "system prompt shared by every conversation",
    "first_tokens": "a conversation's first message",
    "turn_tokens": "each later turn's new message",
    "output_tokens": "each reply (re-sent in the next turn's prompt)",
    "block_tokens": "tokens per hash id (the Mooncake traces: 512)",
    "concurrent": "conversations open at once, their turns interleaved at random",
    "rate": "conversation requests per second (Poisson)",
    "flooder_rate": "tenant B's one-off prompts per conversation request, the "
    f"conversations then tenant A; 0: one stream, no tenants; --flooder: {FLOODER_RATE:g}",
    "flooder_blocks": "blocks of each of B's prompts, ids never used again",
}
"""`main`'s help per `ConversationSpec` field."""


def main(
    argv: Sequence[str] | None = None, prog: str = "python -m tierkv.trace.conversations"
) -> int:
    """`python -m tierkv.trace.conversations OUT [--sessions N ...]` (also
    `scripts/synthetic_trace.py conversations OUT ...`, which passes its own `prog`)."""
    d = ConversationSpec()
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Write a conversation-shaped trace (Mooncake JSONL): each turn's "
        "prompt is the whole previous conversation plus a new message.",
    )
    parser.add_argument("output", type=Path)
    parser.add_argument("--seed", type=int, default=0, help="the same seed, the same file (0)")
    for f in fields(ConversationSpec):
        default = getattr(d, f.name)
        ranged = isinstance(default, tuple)
        shown = "-".join(map(str, default)) if ranged else default
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            type=_range if ranged else type(default),
            # --flooder-rate: None when not given, so that --flooder sets it
            default=None if f.name == "flooder_rate" else default,
            metavar="LO-HI" if ranged else "N",
            help=f"{HELP[f.name]} ({shown})",
        )
    parser.add_argument(
        "--flooder",
        action="store_true",
        help="two tenants: the conversations are A, and B floods the cache with one-off "
        f"prompts at {FLOODER_RATE:g}x A's rate (--flooder-rate {FLOODER_RATE:g}; an "
        "explicit --flooder-rate wins)",
    )
    args = vars(parser.parse_args(argv))
    output, seed, flooder = args.pop("output"), args.pop("seed"), args.pop("flooder")
    if args["flooder_rate"] is None:
        args["flooder_rate"] = FLOODER_RATE if flooder else d.flooder_rate
    try:
        spec = ConversationSpec(**args)
    except ValueError as exc:
        parser.error(str(exc))
    tenants: Counter[str | None] = Counter()

    def counted(turns: Iterator[Turn]) -> Iterator[Turn]:
        for turn in turns:
            tenants[turn.request.tenant] += 1
            yield turn

    n = write_trace(counted(generate(spec, seed)), output)
    mix = ", ".join(f"tenant {t}: {c}" for t, c in sorted(tenants.items()) if t is not None)
    print(
        f"{n} requests{f' ({mix})' if mix else ''} -> {output} "
        f"({json.dumps({**asdict(spec), 'seed': seed})})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
