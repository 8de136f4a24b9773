"""Save (gather out of vLLM's CPU pages) against load (scatter into them), side by side.

    .venv/bin/python -m tests.unit.bench_paged_copy [--threads 1] [--repeats 5]

A Llama-8B-shaped block set (32 layers, 8 KV heads, head_dim 128) in bf16 and float32, prompts
of 2,048 and 8,192 tokens in 128-token pages (shuffled, as a request's pages are) and kvstore
blocks of 128 tokens (separate views, as `fetch_with`/`publish_with` hand them out), copied by
the C routine and by the torch fallback (`KVSTORE_NATIVE_COPY=0`). Each load and save is timed
alternately; the best of `--repeats` in ms and save/load are printed, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch

from kvstore.client.integrations import paged
from kvstore.client.integrations.paged import PagedCache

LAYERS, HEADS, DIM, PAGE = 32, 8, 128, 128


def measure(dtype: torch.dtype, tokens: int, native: bool, repeats: int) -> dict[str, float]:
    os.environ[paged.NATIVE_ENV] = "1" if native else "0"
    n = tokens // PAGE
    num_pages = n + 8
    # Filled, not empty: every page touched before the timed copies.
    layers = [torch.ones(num_pages, HEADS, PAGE, 2 * DIM, dtype=dtype) for _ in range(LAYERS)]
    cache = PagedCache.vllm_cpu(layers, "vec")
    blocks = torch.ones(n, LAYERS, 2, PAGE, HEADS, DIM, dtype=dtype)
    pages = random.Random(0).sample(range(num_pages), n)
    views = [(blocks[b], 0, [pages[b]]) for b in range(n)]
    times: dict[str, list[float]] = {"load": [], "save": []}
    for _ in range(repeats):
        for op, copy in (("load", cache.scatter_views), ("save", cache.gather_views)):
            began = time.perf_counter()
            copy(views)
            times[op].append(time.perf_counter() - began)
    load, save = min(times["load"]) * 1e3, min(times["save"]) * 1e3
    return {"load_ms": round(load, 1), "save_ms": round(save, 1),
            "save_per_load": round(save / load, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the "
                        "copies use up to 4 of them)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", default="2048,8192")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    has_c = paged.native_copy() is not None
    if not has_c:
        print("no C compiler (or KVSTORE_NATIVE_COPY=0): the C routine's rows are skipped")
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for tokens in map(int, args.tokens.split(",")):
            for native in (True, False) if has_c else (False,):
                row = {"dtype": str(dtype).removeprefix("torch."), "tokens": tokens,
                       "copy": "C" if native else "torch",
                       **measure(dtype, tokens, native, args.repeats)}
                print(f"{row['dtype']:8} {tokens:5} {row['copy']:5} load {row['load_ms']:7.1f} "
                      f"ms  save {row['save_ms']:7.1f} ms  save/load {row['save_per_load']:.2f}",
                      flush=True)
                rows.append(row)
    print(json.dumps({"threads": args.threads, "rows": rows}))


if __name__ == "__main__":
    main()
