"""Write a synthetic request trace in the Mooncake JSONL format, to check that a
caching policy does no harm on workloads unlike the Mooncake trace.

    .venv/bin/python scripts/synthetic_trace.py chat /tmp/chat.jsonl
    .venv/bin/python scripts/synthetic_trace.py oneshot /tmp/oneshot.jsonl
    .venv/bin/python scripts/synthetic_trace.py conversations /tmp/conv.jsonl [--sessions N ...]
    .venv/bin/tierkv bench trace /tmp/chat.jsonl

kinds:
  chat           conversations with a shared system prompt; every turn re-sends the
                 whole conversation plus a new message (each turn's blocks are read
                 exactly once more, by the next turn), users interleaved at random
                 (--users, --turns)
  oneshot        70 % prompts never seen again, 30 % one of a few shared documents
                 plus a question (--requests)
  conversations  sessions of several turns with documented, tested parameters
                 (tierkv.trace.conversations): `synthetic_trace.py conversations -h`
                 lists its own options (--sessions, --turns, --concurrent, ...)

Arrivals are Poisson (--rate per second); the same --seed writes the same file.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from tierkv.trace import conversations


def chat(rng: random.Random, users: int, turns: int) -> list[list[int]]:
    system = list(range(8))  # 8 blocks of 512 tokens shared by everyone
    conversations = {u: list(system) for u in range(users)}
    fresh = 10**6
    prompts = []
    order = [u for _ in range(turns) for u in rng.sample(range(users), users)]
    for user in order:
        conv = conversations[user]
        grow = rng.randint(1, 4)  # the user's message and the last reply
        conv.extend(range(fresh, fresh + grow))
        fresh += grow
        prompts.append(list(conv))
    return prompts


def oneshot(rng: random.Random, requests: int) -> list[list[int]]:
    docs = [[10**5 * (d + 1) + i for i in range(rng.randint(4, 40))] for d in range(20)]
    fresh = 10**7
    prompts = []
    for _ in range(requests):
        if rng.random() < 0.3:
            prompts.append([*rng.choice(docs), fresh])
            fresh += 1
        else:
            n = rng.randint(4, 60)
            prompts.append(list(range(fresh, fresh + n)))
            fresh += n
    return prompts


def main() -> None:
    if sys.argv[1:2] == ["conversations"]:
        sys.exit(conversations.main(sys.argv[2:], prog="synthetic_trace.py conversations"))
    parser = argparse.ArgumentParser(
        prog="synthetic_trace.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "kind",
        choices=["chat", "oneshot", "conversations"],
        help="the workload (above); conversations takes its own options",
    )
    parser.add_argument("output", type=Path, help="the JSONL file to write")
    parser.add_argument("--users", type=int, default=200, help="chat: users (200)")
    parser.add_argument("--turns", type=int, default=8, help="chat: turns per user (8)")
    parser.add_argument("--requests", type=int, default=3000, help="oneshot: requests (3000)")
    parser.add_argument("--rate", type=float, default=4.0, help="arrivals per second (4.0)")
    parser.add_argument("--seed", type=int, default=0, help="the same seed, the same file (0)")
    args = parser.parse_args()
    if args.kind == "conversations":  # reached only with options before the kind
        parser.error("conversations comes first: synthetic_trace.py conversations OUT [options]")
    rng = random.Random(args.seed)
    prompts = (
        chat(rng, args.users, args.turns) if args.kind == "chat" else oneshot(rng, args.requests)
    )
    now = 0.0
    with args.output.open("w") as f:
        for ids in prompts:
            now += rng.expovariate(args.rate)
            line = {
                "timestamp": round(now * 1000),
                "input_length": 512 * len(ids) - rng.randint(0, 511),
                "output_length": rng.randint(16, 256),
                "hash_ids": ids,
            }
            f.write(json.dumps(line) + "\n")
    print(f"{len(prompts)} requests -> {args.output}")


if __name__ == "__main__":
    main()
