"""A multi-turn chat workload: users share a system prompt, each turn appends a user
message to the conversation, and the model's reply joins the history, so every turn
reuses the whole conversation before it. Turns go round-robin over the users, so a
user's prefix has been pushed down the tiers by the others by the time they return.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class WorkloadConfig:
    users: int = 4
    turns: int = 4
    system_tokens: int = 512
    message_tokens: int = 96
    reply_tokens: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("users", "turns", "message_tokens", "reply_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.system_tokens < 0:
            raise ValueError(f"system_tokens must be >= 0, got {self.system_tokens}")

    @property
    def longest_prompt(self) -> int:
        return (
            self.system_tokens
            + self.turns * self.message_tokens
            + (self.turns - 1) * self.reply_tokens
        )


@dataclass(frozen=True)
class Turn:
    user: int
    index: int  # 0 for a user's first turn
    prompt: list[int]


@dataclass
class ChatWorkload:
    """Token ids from a seeded generator; `reply` feeds a turn's answer back."""

    config: WorkloadConfig
    vocab: int
    _history: list[list[int]] = field(default_factory=list)
    _rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.config.seed)
        system = self._tokens(self.config.system_tokens)
        self._history = [list(system) for _ in range(self.config.users)]

    def _tokens(self, count: int) -> list[int]:
        return [self._rng.randrange(self.vocab) for _ in range(count)]

    @property
    def num_turns(self) -> int:
        return self.config.users * self.config.turns

    def turns(self) -> Iterator[Turn]:
        """Every turn in order; call `reply` for each before asking for the next."""
        for index in range(self.config.turns):
            for user in range(self.config.users):
                self._history[user] += self._tokens(self.config.message_tokens)
                yield Turn(user, index, list(self._history[user]))

    def reply(self, turn: Turn, tokens: list[int]) -> None:
        self._history[turn.user] += tokens
