"""Seeded synthetic request traces shaped like real offload workloads.

A trace is a list of requests; each request is a list of token ids (its prompt). Three shapes,
each mixing shared prefixes and private suffixes the way serving traffic does:

- `chat`: multi-turn chat sessions under a few shared system prompts; each turn re-sends the
  whole conversation so far plus a new user message.
- `agentic`: tool loops that re-send a long, growing context (system prompt + tool schemas +
  every previous call and result) many times.
- `docqa`: long documents, each asked many questions (document prefix shared, question private).

Sizes: `smoke` (a few requests), `small`, `medium`, `large` (hundreds of thousands of blocks).
Everything is deterministic for a given (shape, size, seed).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass

SHAPES = ("chat", "agentic", "docqa")
SIZES = {
    # name: (conversations/loops/documents, turns/iterations/questions)
    "smoke": (2, 3),
    "small": (12, 6),
    "medium": (60, 10),
    "large": (400, 16),
}
VOCAB = 50_000


@dataclass(slots=True, frozen=True)
class Request:
    """One prompt of a trace; `session` groups the requests of one conversation/loop/document."""

    session: int
    tokens: tuple[int, ...]


def _text(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _interleave(rng: random.Random, streams: list[list[Request]]) -> list[Request]:
    """Merge per-session request lists in a random order that keeps each session's order."""
    out: list[Request] = []
    cursors = [0] * len(streams)
    live = [i for i, s in enumerate(streams) if s]
    while live:
        i = rng.choice(live)
        out.append(streams[i][cursors[i]])
        cursors[i] += 1
        if cursors[i] == len(streams[i]):
            live.remove(i)
    return out


def chat(size: str, seed: int = 0) -> list[Request]:
    rng = random.Random(f"chat-{size}-{seed}")
    sessions, turns = SIZES[size]
    systems = [_text(rng, rng.randint(200, 800)) for _ in range(3)]
    streams = []
    for s in range(sessions):
        ctx = list(rng.choice(systems))
        reqs = []
        for _ in range(rng.randint(max(1, turns // 2), turns)):
            ctx += _text(rng, rng.randint(20, 200))           # user message
            reqs.append(Request(s, tuple(ctx)))
            ctx += _text(rng, rng.randint(50, 400))           # assistant answer
        streams.append(reqs)
    return _interleave(rng, streams)


def agentic(size: str, seed: int = 0) -> list[Request]:
    rng = random.Random(f"agentic-{size}-{seed}")
    loops, iters = SIZES[size]
    system = _text(rng, 1500)                                 # system prompt + tool schemas
    streams = []
    for s in range(loops):
        ctx = system + _text(rng, rng.randint(100, 400))      # the task
        reqs = []
        for _ in range(iters):
            reqs.append(Request(s, tuple(ctx)))
            ctx += _text(rng, rng.randint(30, 120))           # the model's tool call
            ctx += _text(rng, rng.randint(100, 1200))         # the tool's result
        streams.append(reqs)
    return _interleave(rng, streams)


def docqa(size: str, seed: int = 0) -> list[Request]:
    rng = random.Random(f"docqa-{size}-{seed}")
    docs, questions = SIZES[size]
    streams = []
    for s in range(docs):
        doc = _text(rng, rng.randint(2000, 8000))
        streams.append([Request(s, tuple(doc + _text(rng, rng.randint(15, 60))))
                        for _ in range(questions)])
    return _interleave(rng, streams)


GENERATORS = {"chat": chat, "agentic": agentic, "docqa": docqa}


def generate(shape: str, size: str, seed: int = 0) -> list[Request]:
    if shape not in GENERATORS:
        raise ValueError(f"unknown trace shape {shape!r}; choose from {', '.join(SHAPES)}")
    if size not in SIZES:
        raise ValueError(f"unknown trace size {size!r}; choose from {', '.join(SIZES)}")
    return GENERATORS[shape](size, seed)


def block_keys(tokens: tuple[int, ...], block_tokens: int) -> Iterator[bytes]:
    """Prefix-chained keys of the full blocks of a prompt (like vLLM's block hashes)."""
    import hashlib

    parent = b"\0" * 16
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(repr(tokens[start:start + block_tokens]).encode())
        parent = h.digest()
        yield parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print a trace summary (or the trace as JSON).")
    parser.add_argument("shape", choices=SHAPES)
    parser.add_argument("--size", choices=list(SIZES), default="small")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--json", action="store_true", help="dump the requests")
    args = parser.parse_args(argv)
    trace = generate(args.shape, args.size, args.seed)
    if args.json:
        json.dump([{"session": r.session, "tokens": r.tokens} for r in trace], sys.stdout)
        return 0
    blocks = sum(len(r.tokens) // args.block_tokens for r in trace)
    unique = len({k for r in trace for k in block_keys(r.tokens, args.block_tokens)})
    print(f"{args.shape}/{args.size}: {len(trace)} requests, {blocks} block lookups, "
          f"{unique} distinct blocks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
