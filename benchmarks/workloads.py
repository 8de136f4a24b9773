"""Synthetic request traces with other reuse structures than chat, in the Mooncake JSONL format.

    python -m benchmarks.workloads --kind docqa --out benchmarks/results/trace_docqa.jsonl
    python -m benchmarks.workloads --kind agent --out benchmarks/results/trace_agent.jsonl

Each line is `{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [...], "shared_tokens": tokens}` with one id per 512-token block (the last one
partial unless the prompt is a multiple of 512 tokens), as in the conversation trace: two
prompts that share their first k ids share their first 512*k tokens. A context that grows keeps
the ids of its full blocks; the block that was partial gets a new id once more tokens fill it,
as its content changed.
`shared_tokens` (not in the Mooncake format; readers ignore it) is how much of the prompt's
start other conversations share: the system prompt and the document (`docqa`), the system
prompt and tool descriptions (`agent`). A client ending a conversation names it
(`end_session(tokens, shared_tokens)`), and `benchmarks.simulate --end-sessions` does too.

- `docqa`: document Q&A. A library of long documents (8k-64k tokens) whose popularity is Zipf
  and drifts (new documents arrive, old ones fade); each request is a short system prompt, one
  document and a short question (30-300 tokens); a third of the questions are follow-ups in a
  thread (the previous question and its answer stay in the prompt). Reuse is a few long
  shared prefixes and short, mostly unique tails.
- `agent`: agent loops. Sessions start with a shared system prompt and tool descriptions (4k
  tokens) and a task (500-3k), then loop: call the model, run a tool (1-20 s), append its
  output (100-4k tokens) and the model's reply, call again, 5-80 times, up to 120k tokens.
  Reuse is near certain and quick while a session lives, and never after it ends.

Both are seeded: the same arguments write the same bytes.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK = 512  # tokens per block, as in the conversation trace


@dataclass
class Context:
    """A prompt under construction: its length and the ids of its blocks (last may be partial)."""

    ids: list[int] = field(default_factory=list)
    tokens: int = 0
    shared: int = 0  # its first tokens other conversations share (system prompt, document)

    def extend(self, tokens: int, new_id: Iterator[int]) -> None:
        """Append `tokens` tokens: full blocks keep their ids, the partial one is replaced."""
        if tokens <= 0:
            return
        if self.tokens % BLOCK:
            self.ids.pop()  # its content changes
        self.tokens += tokens
        while len(self.ids) < -(-self.tokens // BLOCK):
            self.ids.append(next(new_id))

    def copy(self) -> Context:
        return Context(list(self.ids), self.tokens, self.shared)


def _ids() -> Iterator[int]:
    n = 0
    while True:
        yield n
        n += 1


def _line(t_s: float, ctx: Context, output: int) -> dict[str, Any]:
    return {"timestamp": int(t_s * 1000), "input_length": ctx.tokens, "output_length": output,
            "hash_ids": list(ctx.ids), "shared_tokens": ctx.shared}


def docqa(seed: int = 0, requests: int = 6_000, rate_per_s: float = 3.3,
          documents: int = 400, zipf: float = 1.1) -> list[dict[str, Any]]:
    """Document Q&A: see the module docstring."""
    rng = random.Random(seed)
    new_id = _ids()
    system = Context()
    system.extend(900, new_id)
    def new_doc() -> Context:
        d = system.copy()
        d.extend(int(math.exp(rng.uniform(math.log(8_000), math.log(64_000)))), new_id)
        d.shared = d.tokens
        return d

    docs = [new_doc() for _ in range(documents)]
    rng.shuffle(docs)
    weights = list(itertools.accumulate(1.0 / (r + 1) ** zipf for r in range(documents)))
    threads: list[Context] = []  # open Q&A threads: each one's prompt so far
    out: list[dict[str, Any]] = []
    t = 0.0
    for _ in range(requests):
        t += rng.expovariate(rate_per_s)
        if rng.random() < 0.002:  # drift: a new document becomes the most popular
            docs.insert(0, new_doc())
            docs.pop()
        if threads and rng.random() < 0.33:  # a follow-up in a recent thread
            i = rng.randrange(len(threads))
        else:  # a new question on a document
            threads.append(docs[bisect.bisect(weights, rng.random() * weights[-1])])
            if len(threads) > 200:
                threads.pop(0)
            i = len(threads) - 1
        ctx = threads[i].copy()
        ctx.extend(rng.randint(30, 300), new_id)
        output = rng.randint(50, 600)
        out.append(_line(t, ctx, output))
        ctx.extend(output, new_id)
        threads[i] = ctx
    return out


def agent(seed: int = 0, requests: int = 6_000, sessions_per_s: float = 0.12,
          system_tokens: int = 4_000, max_tokens: int = 120_000) -> list[dict[str, Any]]:
    """Agent loops: see the module docstring."""
    rng = random.Random(seed)
    new_id = _ids()
    system = Context()
    system.extend(system_tokens, new_id)
    system.shared = system.tokens
    events: list[tuple[float, int, Context, int]] = []  # (time, tie, context, steps left)
    tie = 0
    t = 0.0
    while len(events) < requests:  # session starts, enough for the requests asked
        t += rng.expovariate(sessions_per_s)
        ctx = system.copy()
        ctx.extend(rng.randint(500, 3_000), new_id)
        heapq.heappush(events, (t, tie, ctx, rng.randint(5, 80)))
        tie += 1
    out: list[dict[str, Any]] = []
    while events and len(out) < requests:
        t, _, ctx, left = heapq.heappop(events)
        output = rng.randint(30, 400)
        out.append(_line(t, ctx, output))
        if left <= 1:
            continue
        ctx = ctx.copy()
        ctx.extend(output + int(math.exp(rng.uniform(math.log(100), math.log(4_000)))), new_id)
        if ctx.tokens > max_tokens:
            continue
        gap = output / 50.0 + rng.uniform(1.0, 20.0)  # decode at 50 tok/s, then the tool
        heapq.heappush(events, (t + gap, tie, ctx, left - 1))
        tie += 1
    out.sort(key=lambda d: int(d["timestamp"]))
    return out


KINDS = {"docqa": docqa, "agent": agent}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.workloads", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", choices=sorted(KINDS), required=True)
    p.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--requests", type=int, default=6_000)
    args = p.parse_args(argv)
    lines = KINDS[args.kind](seed=args.seed, requests=args.requests)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        for d in lines:
            f.write(json.dumps(d) + "\n")
    blocks = sum(len(d["hash_ids"]) for d in lines)
    span = (lines[-1]["timestamp"] - lines[0]["timestamp"]) / 1e3
    print(f"wrote {args.out}: {len(lines)} requests, {blocks} block references, "
          f"{span:.0f} s")


if __name__ == "__main__":
    main()
