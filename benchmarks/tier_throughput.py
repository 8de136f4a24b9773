"""Host- and disk-tier publish/fetch throughput beside the machine's limits, in one run.

Llama-8B-shaped blocks (bf16, 8 KV heads x 128 dims x 32 layers = 128 KiB/token, 256-token
blocks = 32 MiB). Limits measured in the same run on the same bytes:
- memcpy: `torch.Tensor.copy_` into an existing buffer (what a same-node fetch must do);
- raw disk read: `os.preadv` of a file holding the same bytes, its page cache dropped first
  (`posix_fadvise(DONTNEED)`), exactly as the disk tier's file is before each disk fetch.
Goals (issue 2): host fetch >= 0.7x memcpy, disk fetch >= 0.8x raw read.

    python -m benchmarks.tier_throughput [--blocks 16] [--repeats 5]
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

from benchmarks.common import RESULTS, barh, drop_page_cache, require, table, write_results
from kvstore import KVLayout
from kvstore.client import KVClient
from kvstore.server.process import DaemonProcess

LAYOUT = KVLayout(model="llama-8b-shaped", num_layers=32, num_kv_heads=8, head_dim=128,
                  dtype=torch.bfloat16, block_tokens=256)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def measure_memcpy(nbytes: int, repeats: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in: "an existing buffer"
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return _gbps(nbytes, statistics.median(times))


def measure_raw_read(path: Path, nbytes: int, repeats: int) -> float:
    data = torch.empty(nbytes, dtype=torch.uint8).random_()
    with open(path, "wb") as f:
        f.write(data.numpy().tobytes())
    buf = bytearray(nbytes)
    times = []
    for _ in range(repeats):
        drop_page_cache(path)
        fd = os.open(path, os.O_RDONLY)
        t = time.perf_counter()
        os.preadv(fd, [memoryview(buf)], 0)
        times.append(time.perf_counter() - t)
        os.close(fd)
    path.unlink()
    return _gbps(nbytes, statistics.median(times))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--blocks", type=int, default=16, help="blocks per prompt (32 MiB each)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--data-dir", default=".data/bench")
    args = p.parse_args()

    n_tokens = args.blocks * LAYOUT.block_tokens
    nbytes = n_tokens * LAYOUT.bytes_per_token
    data = Path(args.data_dir)
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    # Host holds exactly one prompt (blocks are page multiples), so alternating two prompts
    # makes every block of every fetch a disk read (promotion) whose demotion costs nothing
    # (both prompts are already on disk). Checked below with the promotion counter.
    host = nbytes
    daemon = DaemonProcess(data / "kvstore", "--host-bytes", str(host),
                           "--disk-bytes", str(4 * nbytes), "--disk-sync", "never")
    bar = tqdm(total=4 + 4 * args.repeats, desc="tier throughput", unit="step")
    memcpy = measure_memcpy(nbytes, args.repeats)
    bar.update()
    raw = measure_raw_read(data / "raw.bin", nbytes, args.repeats)
    bar.update()
    daemon.start()
    bar.update()
    prompts = [[p * 10**6 + t for t in range(n_tokens)] for p in range(2)]
    kvs = [torch.randn(LAYOUT.kv_shape(n_tokens), dtype=torch.bfloat16) for _ in range(2)]
    out = torch.empty(LAYOUT.kv_shape(n_tokens), dtype=torch.bfloat16)
    out.zero_()
    res: dict[str, list[float]] = {k: [] for k in ("host publish", "host fetch", "disk fetch")}
    disk_file = data / "kvstore" / "disk" / "blocks.dat"
    try:
        with KVClient(daemon.target, LAYOUT, deadline_s=60) as c:
            for r in range(args.repeats):
                c.clear()
                t = time.perf_counter()
                stored = c.publish(prompts[0], kvs[0])
                require(stored == n_tokens, f"publish stored {stored} of {n_tokens} tokens")
                res["host publish"].append(_gbps(nbytes, time.perf_counter() - t))
                bar.update()
                t = time.perf_counter()
                n, _ = c.fetch(prompts[0], into=out)
                res["host fetch"].append(_gbps(nbytes, time.perf_counter() - t))
                require(n == n_tokens, f"host fetch served {n} of {n_tokens} tokens")
                bar.update()
                if r == 0:
                    require(torch.equal(out.view(torch.int16), kvs[0].view(torch.int16)),
                            "host fetch returned different bytes")
            # disk: publish both prompts; the second demotes the first; then alternate.
            c.publish(prompts[1], kvs[1])
            promoted_before = c.stats().promotions
            for r in range(args.repeats):
                which = r % 2
                drop_page_cache(disk_file)
                t = time.perf_counter()
                n, _ = c.fetch(prompts[which], into=out)
                res["disk fetch"].append(_gbps(nbytes, time.perf_counter() - t))
                require(n == n_tokens, f"disk fetch served {n} of {n_tokens} tokens")
                bar.update(2)
            last = kvs[(args.repeats - 1) % 2]
            require(torch.equal(out.view(torch.int16), last.view(torch.int16)),
                    "disk fetch returned different bytes")
            stats = c.stats()
            if stats is None:
                raise RuntimeError("the daemon did not answer Stats")
            require(stats.promotions - promoted_before == args.repeats * args.blocks,
                    "a disk fetch was served partly from host")
        bar.update()
    finally:
        daemon.stop(keep_arena=False)
        bar.close()
    med = {k: statistics.median(v) for k, v in res.items()}
    rows = [
        {"path": "memcpy (limit)", "GB/s": memcpy, "ratio": 1.0, "goal": ""},
        {"path": "host publish", "GB/s": med["host publish"], "ratio": med["host publish"] / memcpy,
         "goal": ""},
        {"path": "host fetch", "GB/s": med["host fetch"], "ratio": med["host fetch"] / memcpy,
         "goal": ">= 0.7x memcpy"},
        {"path": "raw disk read (limit)", "GB/s": raw, "ratio": 1.0, "goal": ""},
        {"path": "disk fetch", "GB/s": med["disk fetch"], "ratio": med["disk fetch"] / raw,
         "goal": ">= 0.8x raw read"},
    ]
    print(f"\n{args.blocks} blocks x {LAYOUT.block_bytes >> 20} MiB = {nbytes >> 20} MiB per "
          f"prompt, median of {args.repeats}; promotions {stats.promotions}\n")
    print(table(rows, ["path", "GB/s", "ratio", "goal"]))
    path = write_results("tier_throughput", {"bytes": nbytes, "repeats": args.repeats,
                                             "rows": rows, "samples": res})
    _plot(rows, RESULTS / "tier_throughput.png")
    print(f"\nresults: {path}")


def _plot(rows: list[dict], path: Path) -> None:
    barh(path, [r["path"] for r in rows], [r["GB/s"] for r in rows],
         [f"{r['GB/s']:.2f} ({r['ratio']:.2f}x)" for r in rows],
         ["#999" if "limit" in r["path"] else "#27a" for r in rows], "GB/s (median)",
         "kvstore tier throughput vs the machine's limits (same run)", width=7)


if __name__ == "__main__":
    main()
