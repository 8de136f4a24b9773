"""Disk fetches right after a daemon restart: the first reads into a fresh host tier.

A restart empties the host tier, so the first fetches read every block from disk. Into pages no
process has touched yet where the daemon makes a new arena (`KVSTORE_HOST_HANDOVER_S=0`), while
the client's background prefault (`KVCLIENT_PREFAULT_BYTES`) starts on the same new arena; by
default the restarted daemon takes its predecessor's arena over, its pages backed. This
publishes one prompt per length (16-layer float32 blocks of 128 tokens: the 8B KV shape, 128
KiB per token, as `benchmarks.vllm_ttft`), then `--restarts` times: SIGTERM (the host tier is
flushed to disk), start, map the arena with a short primer fetch, and fetch each prompt from
disk into a tensor, shortest first, byte-checked. The disk file's page cache is left as the
flush leaves it (as after a real restart), unless `--drop-cache`.

    python -m benchmarks.restart_fetch [--lengths 2048,4096,8192,16384] [--restarts 3]

Compare the prefault's effect in one run: `KVCLIENT_PREFAULT_BYTES=0` turns it off.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.common import (
    RESULTS,
    drop_page_cache,
    figure,
    flush_budget_s,
    require,
    table,
    wait_arena_prefaulted,
    write_results,
)
from kvstore import KVLayout
from kvstore.client import KVClient
from kvstore.client.aio import PREFAULT_ENV
from kvstore.server.process import DaemonProcess

LAYOUT = KVLayout(model="llama-8b-kv-16l-float32", num_layers=16, num_kv_heads=8, head_dim=128,
                  block_tokens=128, dtype=torch.float32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", default="2048,4096,8192,16384", help="prompt lengths (tokens)")
    p.add_argument("--restarts", type=int, default=3)
    p.add_argument("--drop-cache", action="store_true",
                   help="drop the disk file's page cache before each restart's fetches")
    p.add_argument("--wait-prefault", action="store_true",
                   help="after each restart, wait until the daemon has prefaulted its arena "
                        "(host_prefault) before the fetches: a daemon started ahead of traffic")
    p.add_argument("--data-dir", default=".data/bench-restart-fetch")
    p.add_argument("--name", default="restart_fetch", help="results file name")
    args = p.parse_args()

    lengths = sorted(int(x) for x in args.lengths.split(","))
    data = Path(args.data_dir)
    shutil.rmtree(data, ignore_errors=True)
    host = sum(lengths) * LAYOUT.bytes_per_token + (512 << 20)  # every prompt fits, as in vllm_ttft
    flush_s = flush_budget_s(host)
    daemon = DaemonProcess(data / "kvstore", "--host-bytes", str(host),
                           "--disk-bytes", str(2 * host), "--shutdown-flush-s", str(flush_s))
    prompts = {n: [n * 10_000 + t for t in range(n)] for n in lengths}
    kvs = {n: torch.randn(LAYOUT.kv_shape(n), dtype=LAYOUT.torch_dtype) for n in lengths}
    outs = {n: torch.zeros_like(kvs[n]) for n in lengths}
    primer = list(range(2 * LAYOUT.block_tokens))
    seconds: dict[int, list[float]] = {n: [] for n in lengths}
    waited: list[float] = []  # seconds each restart's arena prefault took (--wait-prefault)
    primed: list[float] = []  # seconds of each restart's primer fetch (2 blocks, a new arena)
    bar = tqdm(total=args.restarts * len(lengths), desc="restart fetch", unit="fetch")
    daemon.start()
    try:
        with KVClient(daemon.target, LAYOUT, deadline_s=120) as c:
            for n in lengths:
                require(c.publish(prompts[n], kvs[n]) == n, f"publish of {n} tokens fell short")
        for _ in range(args.restarts):
            daemon.stop(flush_s + 30)  # SIGTERM: the host tier is flushed to disk
            if args.drop_cache:
                drop_page_cache(data / "kvstore" / "disk" / "blocks.dat")
            daemon.start()
            if args.wait_prefault:
                waited.append(wait_arena_prefaulted(daemon.target))
            with KVClient(daemon.target, LAYOUT, deadline_s=120) as c:
                t = time.perf_counter()
                c.fetch(primer)  # maps the new arena (and starts the client's prefault)
                primed.append(time.perf_counter() - t)
                for n in lengths:
                    promoted = c.stats().promotions
                    t = time.perf_counter()
                    got, _ = c.fetch(prompts[n], into=outs[n])
                    seconds[n].append(time.perf_counter() - t)
                    require(got == n, f"disk fetch served {got} of {n} tokens")
                    require(c.stats().promotions - promoted == n // LAYOUT.block_tokens,
                            "a fetch after the restart was served partly from host")
                    require(torch.equal(outs[n], kvs[n]), "disk fetch returned different bytes")
                    bar.set_postfix_str(f"{n}: {seconds[n][-1]:.3f} s")
                    bar.update()
    finally:
        daemon.stop(flush_s + 30, keep_arena=False)
        bar.close()
        shutil.rmtree(data / "kvstore", ignore_errors=True)  # gigabytes of blocks
    prefault = os.environ.get(PREFAULT_ENV, "default (16 GiB)")
    rows = []
    for n in lengths:
        med = statistics.median(seconds[n])
        nbytes = n * LAYOUT.bytes_per_token
        rows.append({"tokens": n, "MiB": nbytes >> 20, "median s": med,
                     "GB/s": nbytes / med / 1e9,
                     "each restart (s)": ", ".join(f"{s:.3f}" for s in seconds[n])})
    print(f"\ndisk fetch right after a daemon restart, median of {args.restarts}; "
          f"{PREFAULT_ENV}={prefault}, page cache {'dropped' if args.drop_cache else 'kept'}\n")
    print(table(rows, ["tokens", "MiB", "median s", "GB/s", "each restart (s)"]))
    print(f"\nthe primer fetch after each restart (2 blocks; the client maps the new arena): "
          f"{', '.join(f'{s:.3f}' for s in primed)} s")
    if waited:
        print(f"\nthe daemon prefaulted its {host >> 20} MiB arena in "
              f"{', '.join(f'{s:.2f}' for s in waited)} s before the fetches")
    path = write_results(args.name, {"config": vars(args), "prefault": prefault, "rows": rows,
                                     "prefault_wait_s": waited,
                                     "primer_s": primed,
                                     "seconds": {str(n): s for n, s in seconds.items()}})
    _plot(rows, seconds, RESULTS / f"{args.name}.png", prefault)
    print(f"\nresults: {path}")


def _plot(rows: list[dict], seconds: dict[int, list[float]], path: Path, prefault: str) -> None:
    fig, ax = figure(6.5)
    for n in seconds:
        ax.scatter([n] * len(seconds[n]), seconds[n], color="tab:blue", alpha=0.5)
    ax.plot([r["tokens"] for r in rows], [r["median s"] for r in rows], "o-", color="tab:blue",
            label="median")
    ax.set_xlabel("prompt tokens (128 KiB each)")
    ax.set_ylabel("disk fetch after a restart (s)")
    ax.set_title(f"Disk fetch into a fresh host tier ({PREFAULT_ENV}={prefault})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
