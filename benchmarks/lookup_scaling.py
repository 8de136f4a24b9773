"""Lookup latency for a 128k-token prompt, and fetch scaling with concurrent clients.

- Lookup: a 131,072-token prompt (512 blocks of 256 tokens) fully cached; each `lookup`
  computes 512 chained SHA-256 keys and makes one RPC. p50 and p99 (goal: p50 <= 2 ms).
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
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from benchmarks.common import RESULTS, figure, save, table, write_results
from client import KVClient
from kvstore import KVLayout
from server.process import DaemonProcess

BIG = KVLayout(model="llama-8b-shaped", num_layers=32, num_kv_heads=8, head_dim=128,
               dtype=torch.bfloat16, block_tokens=256)
# Lookup needs stored blocks, not realistic bytes: a tiny layout keeps 512 blocks in RAM.
SMALL = KVLayout(model="lookup-probe", num_layers=1, num_kv_heads=1, head_dim=8,
                 dtype=torch.float16, block_tokens=256)


def lookup_latency(target: str, n: int, bar: tqdm) -> dict[str, float]:
    tokens = torch.arange(131_072, dtype=torch.int32)
    with KVClient(target, SMALL, deadline_s=10) as c:
        assert c.publish(tokens, torch.zeros(SMALL.kv_shape(len(tokens)),
                                             dtype=SMALL.dtype)) == len(tokens)
        times = []
        for _ in range(n):
            t = time.perf_counter()
            hit = c.lookup(tokens)
            times.append(time.perf_counter() - t)
            bar.update()
        assert hit == len(tokens)
        t = time.perf_counter()
        for _ in range(20):
            c.keys(tokens)
        keys_ms = (time.perf_counter() - t) / 20 * 1e3
    ms = np.array(times) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "keys_ms": keys_ms}


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
    bar = tqdm(total=args.lookups + len(clients), desc="lookup + scaling", unit="step")
    daemon.start()
    try:
        lookup = lookup_latency(daemon.target, args.lookups, bar)
        rows = scaling(daemon.target, clients, args.seconds, bar)
    finally:
        daemon.stop()
        bar.close()
    print(f"\nlookup of a 131,072-token prompt (512 blocks): p50 {lookup['p50_ms']:.2f} ms, "
          f"p99 {lookup['p99_ms']:.2f} ms (of which key hashing {lookup['keys_ms']:.2f} ms); "
          "goal p50 <= 2 ms\n")
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
