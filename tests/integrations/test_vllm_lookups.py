"""`LookupBook`: per-key answers for vLLM's one-key-at-a-time, never-waiting lookups
(no vLLM needed)."""

from __future__ import annotations

from tierkv.integrations.vllm.lookups import LookupBook

K1, K2 = b"k1" + bytes(4), b"k2" + bytes(4)


def ask_all(book: LookupBook, found: dict[bytes, bool]) -> None:
    """What the adapter's loop does with a batch: the tier answers every key."""
    for pairs in book.take_batch().values():
        book.deliver((key, token, found[key]) for key, token in pairs)


def test_unknown_until_the_tier_answers_then_the_answer() -> None:
    book = LookupBook()
    assert book.answer(K1, "r1") is None
    assert book.answer(K1, "r1") is None  # asked once, not twice
    batch = book.take_batch()
    assert [k for k, _ in batch["r1"]] == [K1]
    assert book.take_batch() == {}
    book.deliver((k, token, True) for k, token in batch["r1"])
    assert book.answer(K1, "r1") is True


def test_keys_of_several_requests_are_batched_per_request() -> None:
    book = LookupBook()
    book.answer(K1, "r1")
    book.answer(K2, "r2")
    book.answer(K1, "r2")  # already asked for r1: not asked again
    batch = book.take_batch()
    assert {r: [k for k, _ in pairs] for r, pairs in batch.items()} == {"r1": [K1], "r2": [K2]}


def test_a_failed_load_turns_the_answer_into_a_miss_that_stays() -> None:
    book = LookupBook()
    book.answer(K1, "r1")
    ask_all(book, {K1: True})
    assert book.answer(K1, "r1") is True
    book.load_failed([K1])
    assert book.answer(K1, "r1") is False
    assert book.answer(K1, "r2") is False  # a request joining the answer shares it
    ask_all(book, {K1: True})  # and no lookup undoes it while the entry lives
    assert book.answer(K1, "r1") is False


def test_a_failed_load_leaves_a_newer_probe_of_the_key_its_own_answer() -> None:
    """Request A's promotion fails after A's answer was dropped and request B asked
    the tier again: the failure belongs to A's probe, B's answer stands (vLLM ties
    failures to probes the same way)."""
    book = LookupBook()
    book.answer(K1, "a")
    ask_all(book, {K1: True})
    assert book.answer(K1, "a") is True  # A promotes K1
    book.release("a")
    assert book.answer(K1, "b") is None  # B's own probe, being asked
    batch = book.take_batch()
    book.load_failed([K1])  # A's load fails now
    assert book.answer(K1, "b") is None
    book.deliver((k, token, True) for k, token in batch["b"])
    assert book.answer(K1, "b") is True


def test_a_late_answer_cannot_undo_a_known_miss() -> None:
    book = LookupBook()
    book.answer(K1, "r1")
    batch = book.take_batch()
    book.forget([K1])  # e.g. the tier reported the block removed meanwhile
    book.deliver((k, token, True) for k, token in batch["r1"])
    assert book.answer(K1, "r1") is False


def test_a_store_makes_the_answer_a_hit() -> None:
    book = LookupBook()
    book.answer(K1, "r1")
    ask_all(book, {K1: False})
    assert book.answer(K1, "r1") is False
    book.learn_stored([K1])
    assert book.answer(K1, "r1") is True


def test_answers_live_as_long_as_a_request_holds_them() -> None:
    book = LookupBook()
    book.answer(K1, "r1")
    ask_all(book, {K1: True})
    book.release("r1")
    assert len(book) == 0
    assert book.answer(K1, "r2") is None  # a new request asks the tier again


def test_an_answer_for_a_released_entry_is_dropped() -> None:
    book = LookupBook()
    book.answer(K1, "r1")
    batch = book.take_batch()
    book.release("r1")  # still in flight: kept until its answer comes back
    assert len(book) == 1
    book.deliver((k, token, True) for k, token in batch["r1"])
    book.apply_inbox()
    assert len(book) == 0
    assert book.answer(K1, "r2") is None
