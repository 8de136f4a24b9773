"""Lookup latency for a 128k-token prompt, and fetch scaling with concurrent clients.

- Lookup: a 131,072-token prompt (512 blocks of 256 tokens) fully cached, one RPC per
  `lookup`. p50 and p99 (goal: p50 <= 2 ms) of the same prompt looked up again (an engine
  looks a prompt up, then fetches and publishes it: the client hashes it once), of a prompt
  the client has not hashed (its 512 chained SHA-256 keys computed in the call), and of the
  latter given as a Python list (as vLLM passes prompts) instead of a tensor.
- Scaling: 1, 2, 4, 8 client processes fetching the same host-tier prompt (Llama-8B shape,
  bf16, 8 blocks = 256 MiB) as fast as they can; aggregate GB/s and p99 latency.

    python -m benchmarks.lookup_scaling [--lookups 300] [--clients 1,2,4,8]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from benchmarks.common import RESULTS, figure, require, save, table, write_results
from kvstore import KVLayout, chain_keys
from kvstore.client import KVClient
from kvstore.server.process import DaemonProcess

BIG = KVLayout(model="llama-8b-shaped", num_layers=32, num_kv_heads=8, head_dim=128,
               dtype=torch.bfloat16, block_tokens=256)
# Lookup needs stored blocks, not realistic bytes: a tiny layout keeps 512 blocks in RAM.
SMALL = KVLayout(model="lookup-probe", num_layers=1, num_kv_heads=1, head_dim=8,
                 dtype=torch.float16, block_tokens=256)


def lookup_latency(target: str, n: int, bar: tqdm) -> dict[str, float]:
    tokens = torch.arange(131_072, dtype=torch.int32)
    as_list = tokens.tolist()
    with KVClient(target, SMALL, deadline_s=10) as c:
        stored = c.publish(tokens, torch.zeros(SMALL.kv_shape(len(tokens)), dtype=SMALL.dtype))
        require(stored == len(tokens), f"publish stored {stored} of {len(tokens)} tokens")
        key_cache = c._aio._key_cache  # emptied: a prompt the client has not hashed

        def timed(prompt: object, new_prompt: bool) -> np.ndarray:
            times = []
            for _ in range(n):
                if new_prompt:
                    key_cache.clear()
                t = time.perf_counter()
                hit = c.lookup(prompt)  # type: ignore[arg-type]
                times.append(time.perf_counter() - t)
                require(hit == len(tokens), f"lookup found {hit} of {len(tokens)} tokens")
                bar.update()
            return np.array(times) * 1e3

        repeat, new, new_list = timed(tokens, False), timed(tokens, True), timed(as_list, True)
        ns, bt = c.namespace.digest(), SMALL.block_tokens
        keys_ms = _mean_ms(lambda: chain_keys(ns, tokens, bt), 20)
        list_keys_ms = _mean_ms(lambda: chain_keys(ns, as_list, bt), 5)
    return {"p50_ms": float(np.percentile(repeat, 50)), "p99_ms": float(np.percentile(repeat, 99)),
            "new_prompt_p50_ms": float(np.percentile(new, 50)),
            "new_prompt_p99_ms": float(np.percentile(new, 99)),
            "new_list_prompt_p50_ms": float(np.percentile(new_list, 50)),
            "new_list_prompt_p99_ms": float(np.percentile(new_list, 99)),
            "keys_ms": keys_ms, "list_keys_ms": list_keys_ms}


def _mean_ms(fn: Callable[[], object], n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e3


def _fetcher(target: str, seconds: float, start: float, q: mp.Queue) -> None:
    torch.set_num_threads(1)
    tokens = list(range(8 * BIG.block_tokens))
    out = torch.empty(BIG.kv_shape(len(tokens)), dtype=BIG.dtype)
    out.zero_()
    lat = []
    with KVClient(target, BIG, deadline_s=30) as c:
        while time.time() < start:
            time.sleep(0.001)
        end = time.time() + seconds
        while time.time() < end:
            t = time.perf_counter()
            n, _ = c.fetch(tokens, into=out)
            lat.append(time.perf_counter() - t)
            if n != len(tokens):
                q.put(("error", f"fetch served {n}"))
                return
    q.put(("ok", lat))


def scaling(target: str, clients: list[int], seconds: float, bar: tqdm) -> list[dict]:
    tokens = list(range(8 * BIG.block_tokens))
    with KVClient(target, BIG, deadline_s=30) as c:
        c.publish(tokens, torch.randn(BIG.kv_shape(len(tokens))).to(BIG.dtype))
    nbytes = len(tokens) * BIG.bytes_per_token
    rows = []
    ctx = mp.get_context("spawn")
    for k in clients:
        q: mp.Queue = ctx.Queue()
        start = time.time() + 3.0  # let every process import and connect first
        procs = [ctx.Process(target=_fetcher, args=(target, seconds, start, q))
                 for _ in range(k)]
        for p in procs:
            p.start()
        results = [q.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
        errors = [r[1] for r in results if r[0] != "ok"]
        if errors:
            raise SystemExit(f"scaling with {k} clients failed: {errors[0]}")
        lats = [x for r in results for x in r[1]]
        rows.append({"clients": k, "fetches": len(lats),
                     "aggregate GB/s": len(lats) * nbytes / seconds / 1e9,
                     "p50 ms": statistics.median(lats) * 1e3,
                     "p99 ms": float(np.percentile(lats, 99)) * 1e3})
        bar.update()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--lookups", type=int, default=300)
    p.add_argument("--clients", default="1,2,4,8")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--data-dir", default=".data/bench-lookup")
    args = p.parse_args()
    clients = [int(x) for x in args.clients.split(",")]
    data = Path(args.data_dir)
    shutil.rmtree(data, ignore_errors=True)
    daemon = DaemonProcess(data / "kvstore", "--host-bytes", "1GiB", "--disk-bytes", "0",
                           "--max-blocks-per-call", "1024")
    bar = tqdm(total=3 * args.lookups + len(clients), desc="lookup + scaling", unit="step")
    daemon.start()
    try:
        lookup = lookup_latency(daemon.target, args.lookups, bar)
        rows = scaling(daemon.target, clients, args.seconds, bar)
    finally:
        daemon.stop(keep_arena=False)
        bar.close()
    print("\nlookup of a 131,072-token prompt (512 blocks), goal p50 <= 2 ms:\n"
          f"  looked up again:       p50 {lookup['p50_ms']:.2f} ms, p99 {lookup['p99_ms']:.2f} ms\n"
          f"  new prompt (tensor):   p50 {lookup['new_prompt_p50_ms']:.2f} ms, "
          f"p99 {lookup['new_prompt_p99_ms']:.2f} ms (key hashing {lookup['keys_ms']:.2f} ms)\n"
          f"  new prompt (list):     p50 {lookup['new_list_prompt_p50_ms']:.2f} ms, "
          f"p99 {lookup['new_list_prompt_p99_ms']:.2f} ms "
          f"(keys from a list {lookup['list_keys_ms']:.2f} ms)\n")
    print(table(rows, list(rows[0])))
    path = write_results("lookup_scaling", {"lookup": lookup, "scaling": rows})
    _plot(rows, RESULTS / "lookup_scaling.png")
    print(f"\nresults: {path}")


def _plot(rows: list[dict], path: Path) -> None:
    fig, ax = figure()
    xs = [r["clients"] for r in rows]
    ax.plot(xs, [r["aggregate GB/s"] for r in rows], marker="o", color="#27a")
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("aggregate fetch GB/s", color="#27a")
    ax2 = ax.twinx()
    ax2.plot(xs, [r["p99 ms"] for r in rows], marker="s", color="#c52")
    ax2.set_ylabel("p99 fetch latency (ms)", color="#c52")
    ax.set_xscale("log", base=2)
    ax.set_title("host-tier fetch scaling (256 MiB prompt)")
    save(fig, path)


if __name__ == "__main__":
    main()
