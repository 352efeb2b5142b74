"""The conversation-shaped trace generator (tierkv.trace.conversations)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tierkv.trace.conversations import (
    FLOODER_RATE,
    ConversationSpec,
    Turn,
    generate,
    main,
    write_trace,
)
from tierkv.trace.format import read_trace

SMALL = ConversationSpec(sessions=30, turns=(2, 6), concurrent=5, first_tokens=(600, 3000))
FLOODED = replace(SMALL, flooder_rate=10.0, flooder_blocks=(3, 9))


def test_each_turn_extends_the_previous_turn_of_its_session() -> None:
    last: dict[int, Turn] = {}
    for turn in generate(SMALL, seed=1):
        r = turn.request
        assert len(r.hash_ids) == r.input_length // SMALL.block_tokens  # whole blocks only
        before = last.get(turn.session)
        if before is None:
            assert turn.turn == 0
            assert r.hash_ids[:2] == (0, 1)  # the shared system prompt: 1024 tokens
        else:
            assert turn.turn == before.turn + 1
            old = before.request
            assert r.hash_ids[: len(old.hash_ids)] == old.hash_ids
            # the previous prompt, its reply and a new message
            grown = r.input_length - old.input_length - old.output_length
            assert SMALL.turn_tokens[0] <= grown <= SMALL.turn_tokens[1]
        last[turn.session] = turn
    assert len(last) == SMALL.sessions
    assert all(SMALL.turns[0] <= t.turn + 1 <= SMALL.turns[1] for t in last.values())


def test_sessions_share_only_the_system_prompt() -> None:
    first_ids: dict[int, set[int]] = {}
    for turn in generate(SMALL, seed=2):
        first_ids.setdefault(turn.session, set()).update(turn.request.hash_ids[2:])
    sets = list(first_ids.values())
    assert sum(len(s) for s in sets) == len(set().union(*sets))


def test_concurrent_bounds_how_many_sessions_interleave() -> None:
    open_: set[int] = set()
    turns = list(generate(SMALL, seed=3))
    ends = {t.session: i for i, t in enumerate(turns)}
    for i, turn in enumerate(turns):
        open_.add(turn.session)
        open_ = {s for s in open_ if ends[s] >= i}
        assert len(open_) <= SMALL.concurrent
    one = ConversationSpec(sessions=5, turns=(3, 3), concurrent=1)
    sessions = [t.session for t in generate(one)]
    assert sessions == sorted(sessions)  # one open session: back to back


def test_the_same_seed_gives_the_same_file_and_another_seed_another(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    write_trace(generate(SMALL, seed=7), a)
    write_trace(generate(SMALL, seed=7), b)
    write_trace(generate(SMALL, seed=8), c)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


def test_the_file_is_mooncake_jsonl_the_trace_reader_takes(tmp_path: Path) -> None:
    path = tmp_path / "conv.jsonl"
    turns = list(generate(SMALL, seed=4))
    assert write_trace(iter(turns), path) == len(turns)
    for line in path.read_text().splitlines():
        assert set(json.loads(line)) == {"timestamp", "input_length", "output_length", "hash_ids"}
    requests = read_trace(path)
    assert [r.hash_ids for r in requests] == [t.request.hash_ids for t in turns]
    stamps = [r.timestamp_ms for r in requests]
    assert stamps == sorted(stamps)


def test_main_writes_the_trace_with_the_given_parameters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "conv.jsonl"
    assert main([str(path), "--sessions", "4", "--turns", "3", "--seed", "5"]) == 0
    assert len(read_trace(path)) == 12
    assert '"sessions": 4' in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--turns", "0-3"], "turns must be a range"),
        (["--first-tokens", "9-2"], "first_tokens must be a range"),
        (["--concurrent", "0"], "concurrent must be >= 1"),
        (["--turns", "many"], "'many' is not N or LO-HI"),
        (["--flooder-rate", "-1"], "flooder_rate must be >= 0"),
        (["--flooder", "--flooder-blocks", "0-4"], "flooder_blocks must be a range"),
    ],
)
def test_bad_parameters_exit_2_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path / "x.jsonl"), *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_the_flooder_never_reuses_an_id_and_never_takes_one_of_the_conversations() -> None:
    turns = list(generate(FLOODED, seed=6))
    conversations = [t for t in turns if t.request.tenant == "A"]
    flood = [t for t in turns if t.request.tenant == "B"]
    assert len(conversations) + len(flood) == len(turns) and flood
    ids_a = {i for t in conversations for i in t.request.hash_ids}
    ids_b = [i for t in flood for i in t.request.hash_ids]
    assert len(ids_b) == len(set(ids_b))  # no B id twice, in one prompt or across
    assert min(ids_b) > max(ids_a)  # fresh: past every id of A's
    for t in flood:
        r = t.request
        assert FLOODED.flooder_blocks[0] <= len(r.hash_ids) <= FLOODED.flooder_blocks[1]
        assert r.input_length == len(r.hash_ids) * FLOODED.block_tokens
        assert t.turn == 0 and t.session >= FLOODED.sessions  # one-off: a session of one
    assert len({t.session for t in flood}) == len(flood)
    stamps = [t.request.timestamp_ms for t in turns]
    assert stamps == sorted(stamps)


def test_the_conversations_are_the_same_with_or_without_the_flooder() -> None:
    alone = [t.request for t in generate(SMALL, seed=6)]
    mixed = [t.request for t in generate(FLOODED, seed=6) if t.request.tenant == "A"]
    assert mixed == [replace(r, tenant="A") for r in alone]
    assert all(r.tenant is None for r in alone)


@pytest.mark.parametrize("k", [2.0, 10.0])
def test_the_flooder_arrives_at_k_times_the_conversations_rate(k: float) -> None:
    """Poisson at k x rate over A's span: the count is k x rate x span, within four
    standard deviations (sqrt of the mean), and about k per A request."""
    spec = replace(FLOODED, sessions=120, concurrent=20, flooder_rate=k)
    turns = list(generate(spec, seed=1))
    a = [t.request for t in turns if t.request.tenant == "A"]
    b = [t.request for t in turns if t.request.tenant == "B"]
    expected = k * spec.rate * (a[-1].timestamp_ms - a[0].timestamp_ms) / 1000
    assert abs(len(b) - expected) < 4 * expected**0.5
    assert 0.8 * k < len(b) / len(a) < 1.2 * k
    assert b[-1].timestamp_ms <= a[-1].timestamp_ms  # the flood stops with A


def test_the_file_names_each_requests_tenant_with_a_flooder(tmp_path: Path) -> None:
    path = tmp_path / "mix.jsonl"
    turns = list(generate(FLOODED, seed=4))
    write_trace(iter(turns), path)
    assert {json.loads(line)["tenant"] for line in path.read_text().splitlines()} == {"A", "B"}
    assert read_trace(path) == [t.request for t in turns]


def test_main_flooder_takes_the_default_rate_unless_one_is_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "mix.jsonl"
    base = [str(path), "--sessions", "6", "--concurrent", "3", "--seed", "2"]
    assert main([*base, "--flooder", "--flooder-blocks", "4-8"]) == 0
    out = capsys.readouterr().out
    assert f'"flooder_rate": {FLOODER_RATE}' in out and '"flooder_blocks": [4, 8]' in out
    requests = read_trace(path)
    a = sum(r.tenant == "A" for r in requests)
    assert f"(tenant A: {a}, tenant B: {len(requests) - a})" in out
    assert main([*base, "--flooder", "--flooder-rate", "3"]) == 0
    assert '"flooder_rate": 3.0' in capsys.readouterr().out
    assert main([*base, "--flooder-rate", "3"]) == 0  # a rate alone is a flooder too
    assert {r.tenant for r in read_trace(path)} == {"A", "B"}
    assert main(base) == 0
    assert {r.tenant for r in read_trace(path)} == {None}
