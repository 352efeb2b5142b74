"""Per-key answers of one tier, as vLLM's scheduler asks for them: one key at a time,
never waiting.

The first `answer(key)` of a key records the question and returns None ("ask again");
`take_batch` (once per scheduler step) hands the unanswered keys, grouped by request,
to the tier as one batched lookup per request; the answers come back through
`deliver` (any thread) and are applied on the next scheduler-side call. An answer is
kept while a request that asked for it is alive, so a request sees one consistent
verdict; a later request asks the tier again.

Facts learnt from jobs override answers: a stored key is present; a key the tier
reported removed is absent and stays absent for as long as its entry lives, even when
an older lookup still in flight says otherwise. A failed load turns the answer it was
promoted on into a miss that stays (a failed load must not be promoted again and
again: vLLM issue #49176), and nothing else: a newer probe of the key, still being
asked when the failure arrives, keeps its own answer, as vLLM's own tiers tie a
failure to the probe it belongs to (`AsyncLookupManager.mark_miss`).
"""

from __future__ import annotations

import queue
from collections.abc import Iterable
from dataclasses import dataclass, field

from tierkv.contract.keys import OffloadKey


@dataclass(eq=False, slots=True)
class _Entry:
    """One key's answer. Identity matters: a late answer for a dropped entry is
    recognised (its entry is no longer the current one) and ignored."""

    answer: bool | None = None
    asked: bool = False  # handed to the tier, answer not back yet
    known_absent: bool = False  # a failed load or a removal: no lookup may undo it
    requests: set[str] = field(default_factory=set)


class LookupBook:
    """Scheduler-side answers plus a thread-safe inbox of tier answers and facts.

    Every method except `deliver`, `forget`, `load_failed` and `learn_stored` (which
    only enqueue)
    runs under vLLM's manager lock."""

    def __init__(self) -> None:
        self._entries: dict[OffloadKey, _Entry] = {}
        self._by_request: dict[str, set[OffloadKey]] = {}
        self._unasked: dict[str, list[tuple[OffloadKey, _Entry]]] = {}
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()

    def __len__(self) -> int:
        return len(self._entries)

    # -- scheduler thread ----------------------------------------------------------
    def answer(self, key: OffloadKey, request_id: str) -> bool | None:
        """True/False once the tier has answered (or a job taught us), else None."""
        if not self._inbox.empty():
            self.apply_inbox()
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry()
            self._unasked.setdefault(request_id, []).append((key, entry))
        requests = entry.requests
        if request_id not in requests:
            requests.add(request_id)
            self._by_request.setdefault(request_id, set()).add(key)
        return entry.answer

    def take_batch(self) -> dict[str, list[tuple[OffloadKey, object]]]:
        """The keys to ask the tier about now, per request, each with its token for
        `deliver`. Empty when nothing new was asked since the last call."""
        self.apply_inbox()
        batch: dict[str, list[tuple[OffloadKey, object]]] = {}
        for request_id, pairs in self._unasked.items():
            for key, entry in pairs:
                if self._entries.get(key) is entry and entry.answer is None:
                    entry.asked = True
                    batch.setdefault(request_id, []).append((key, entry))
        self._unasked.clear()
        return batch

    def release(self, request_id: str) -> None:
        """A request finished: drop the answers nobody else holds."""
        self.apply_inbox()
        self._unasked.pop(request_id, None)
        for key in self._by_request.pop(request_id, ()):
            entry = self._entries.get(key)
            if entry is None:
                continue
            entry.requests.discard(request_id)
            if not entry.requests and not entry.asked:
                del self._entries[key]

    def apply_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "answers":
                assert isinstance(payload, list)
                for key, token, found in payload:
                    self._apply_answer(key, token, found)
            elif kind == "failed":
                assert isinstance(payload, tuple)
                for key in payload:
                    self._apply_failed_load(key)
            else:
                assert isinstance(payload, tuple)
                for key in payload:
                    self._apply_fact(key, present=kind == "stored")

    def _apply_answer(self, key: OffloadKey, token: object, found: bool) -> None:
        entry = self._entries.get(key)
        if entry is not token or entry is None:
            return  # the entry was dropped (and maybe recreated) meanwhile
        entry.asked = False
        if not entry.requests:
            del self._entries[key]
        elif entry.answer is None and not entry.known_absent:
            entry.answer = found

    def _apply_failed_load(self, key: OffloadKey) -> None:
        entry = self._entries.get(key)
        if entry is None or entry.answer is None:
            return  # no answer, or a newer probe still being asked: its answer stands
        entry.known_absent = True
        entry.answer = False

    def _apply_fact(self, key: OffloadKey, *, present: bool) -> None:
        entry = self._entries.get(key)
        if entry is None:
            return
        if present:
            entry.known_absent = False
            entry.answer = True
        else:
            entry.known_absent = True
            entry.answer = False

    # -- any thread ----------------------------------------------------------------
    def deliver(self, answers: Iterable[tuple[OffloadKey, object, bool]]) -> None:
        """The tier's answers for keys handed out by `take_batch`."""
        self._inbox.put(("answers", list(answers)))

    def forget(self, keys: Iterable[OffloadKey]) -> None:
        """These keys are not in the tier (the tier removed them)."""
        self._inbox.put(("absent", tuple(keys)))

    def load_failed(self, keys: Iterable[OffloadKey]) -> None:
        """Loads of these keys failed: the answers they were promoted on become
        misses; a probe still being asked keeps its own answer."""
        self._inbox.put(("failed", tuple(keys)))

    def learn_stored(self, keys: Iterable[OffloadKey]) -> None:
        """These keys were just stored in the tier."""
        self._inbox.put(("stored", tuple(keys)))
