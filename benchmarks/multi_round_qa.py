"""Multi-round QA: users x rounds over a shared system prompt with growing histories, as
LMCache's multi-round-qa benchmark, with and without kvstore, through transformers.

Every user's prompt in round r is: system prompt + (question, answer) of rounds < r + the new
question. Requests are served round-robin across users (their histories interleave, as a
server's would). Reports TTFT p50/p99 and the hit rate (prompt tokens loaded from kvstore).

    python -m benchmarks.multi_round_qa [--users 4] [--rounds 3] [--system 1024]
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from benchmarks.common import RESULTS, figure, llama_8b_kv_shaped, save, table, write_results
from kvstore.client import KVClient
from kvstore.client.integrations.hf import CachedPrefill, layout_for_model, run_model
from kvstore.server.process import DaemonProcess


def workload(users: int, rounds: int, system: int, question: int, answer: int,
             vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sys_prompt = torch.randint(0, vocab, (system,), generator=g)
    history = [sys_prompt.clone() for _ in range(users)]
    prompts = []
    for _ in range(rounds):
        for u in range(users):
            q = torch.randint(0, vocab, (question,), generator=g)
            prompts.append(torch.cat([history[u], q]).unsqueeze(0))
            a = torch.randint(0, vocab, (answer,), generator=g)  # the model's reply
            history[u] = torch.cat([history[u], q, a])
    return prompts


def run(engine: CachedPrefill | None, model: torch.nn.Module, prompts: list[torch.Tensor],
        bar: tqdm) -> tuple[list[float], int, int]:
    ttfts, cached, total = [], 0, 0
    for p in prompts:
        if engine is None:
            with torch.inference_mode():
                t = time.perf_counter()
                run_model(model, p, last_logits_only=True)  # as `generate` prefills
                ttfts.append(time.perf_counter() - t)
        else:
            r = engine.prefill(p)
            ttfts.append(r.ttft_s)
            cached += r.cached_tokens
        total += p.shape[1]
        bar.update()
    return ttfts, cached, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--system", type=int, default=1024, help="shared system prompt tokens")
    ap.add_argument("--question", type=int, default=96)
    ap.add_argument("--answer", type=int, default=160)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--data-dir", default=".data/bench-mrqa")
    args = ap.parse_args()
    model = llama_8b_kv_shaped(args.layers, dtype=torch.float32)
    layout = layout_for_model(model)
    prompts = workload(args.users, args.rounds, args.system, args.question, args.answer,
                       model.config.vocab_size)
    data = Path(args.data_dir)
    shutil.rmtree(data, ignore_errors=True)
    daemon = DaemonProcess(data / "kvstore", "--host-bytes", "4GiB", "--disk-bytes", "8GiB")
    bar = tqdm(total=2 * len(prompts), desc="multi-round QA", unit="request")
    daemon.start()
    try:
        base = run(None, model, prompts, bar)
        with KVClient(daemon.target, layout, deadline_s=60) as c:
            kv = run(CachedPrefill(model, c), model, prompts, bar)
    finally:
        daemon.stop(keep_arena=False)
        bar.close()
    rows = []
    for name, (t, cached, total) in (("recompute", base), ("kvstore", kv)):
        rows.append({"mode": name, "requests": len(t), "TTFT p50 s": float(np.median(t)),
                     "TTFT p99 s": float(np.percentile(t, 99)), "mean s": float(np.mean(t)),
                     "hit rate": cached / total})
    print(f"\n{args.users} users x {args.rounds} rounds, system prompt {args.system} tokens, "
          f"+{args.question} question / +{args.answer} answer tokens per round\n")
    print(table(rows, list(rows[0])))
    print(f"\nspeed-up of mean TTFT: {rows[0]['mean s'] / rows[1]['mean s']:.2f}x")
    path = write_results("multi_round_qa", {"args": vars(args), "rows": rows,
                                            "ttft_recompute": base[0], "ttft_kvstore": kv[0]})
    _plot(base[0], kv[0], RESULTS / "multi_round_qa.png")
    print(f"results: {path}")


def _plot(base: list[float], kv: list[float], path: Path) -> None:
    fig, ax = figure()
    ax.plot(base, marker=".", color="#999", label="recompute")
    ax.plot(kv, marker=".", color="#27a", label="kvstore")
    ax.set_xlabel("request (round-robin over users, rounds in order)")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("multi-round QA: TTFT per request")
    ax.legend()
    save(fig, path)


if __name__ == "__main__":
    main()
