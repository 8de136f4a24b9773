"""Write-through latency: from a publish's return until its last block is readable in Redis.

A disaggregated decode instance on another daemon waits exactly this long for its producer's
blocks (docs/PERFORMANCE.md, "Disaggregated prefill"). One daemon (`--remote` on a fresh
standalone `redis-server`, both on loopback) is published prompts of the disaggregated
benchmark's shape (8 layers x 8 KV heads x 128, bf16: 32 KiB per token, 4 MiB blocks of 128
tokens); a raw redis-py client polls `EXISTS` for the prompt's keys every millisecond. Beside
it, in the same run and on the same server, "raw SET": one blocking redis-py pipeline of SETs
of the same number of fresh values of the same size (the bytes alone, no framing, no daemon):
the limit of the client library and the server; and "raw SET, asyncio": the same pipeline
through redis-py's asyncio client (which the daemon's writer used before it moved to the
blocking one). Median of `--repeats`, alternated.

    python -m benchmarks.write_through [--lengths 1024,2048,4096] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis
import redis.asyncio
import redis.utils
import torch
from tqdm import tqdm

from benchmarks.common import require, table, write_results
from kvstore.client import KVClient
from kvstore.layout import KVLayout
from kvstore.server.process import DaemonProcess
from kvstore.tiers.remote import redis_key
from tests.redis_servers import RedisServer

LAYOUT = KVLayout(model="write-through-bench", num_layers=8, num_kv_heads=8, head_dim=128,
                  dtype=torch.bfloat16, block_tokens=128)


def _shared_s(client: KVClient, r: redis.Redis, tokens: list[int], kv: torch.Tensor) -> float:
    """Seconds from `publish`'s return until every full block's key exists in Redis."""
    names = [redis_key(client.namespace.digest(), k) for k in client.keys(tokens)]
    require(client.publish(tokens, kv) == len(names) * LAYOUT.block_tokens, "publish refused")
    t0 = time.perf_counter()
    while r.exists(*names) < len(names):
        if time.perf_counter() - t0 > 30:
            raise RuntimeError("blocks not written through within 30 s (see the daemon's log)")
        time.sleep(0.001)
    return time.perf_counter() - t0


def _raw_set_s(r: redis.Redis, blocks: int, tag: str) -> float:
    value = os.urandom(LAYOUT.block_bytes)
    t0 = time.perf_counter()
    pipe = r.pipeline(transaction=False)
    for i in range(blocks):
        pipe.set(f"raw:{tag}:{i}", value)
    pipe.execute()
    return time.perf_counter() - t0


def _raw_set_asyncio_s(loop: asyncio.AbstractEventLoop, r: redis.asyncio.Redis, blocks: int,
                       tag: str) -> float:
    value = os.urandom(LAYOUT.block_bytes)

    async def send() -> float:
        t0 = time.perf_counter()
        pipe = r.pipeline(transaction=False)
        for i in range(blocks):
            pipe.set(f"async:{tag}:{i}", value)
        await pipe.execute()
        return time.perf_counter() - t0

    return loop.run_until_complete(send())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--lengths", default="1024,2048,4096", help="prompt tokens (whole blocks)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--name", default="write_through")
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    root = Path(tempfile.mkdtemp(prefix="kvw-"))
    server = RedisServer(root / "redis").start()
    daemon = DaemonProcess(root / "kv", "--host-bytes", "2GiB", "--remote", server.url)
    rows: list[dict[str, Any]] = []
    loop = asyncio.new_event_loop()
    ra: redis.asyncio.Redis | None = None
    try:
        daemon.start()
        r = redis.Redis.from_url(server.url)
        ra = redis.asyncio.Redis.from_url(server.url)
        gen = torch.Generator().manual_seed(0)
        with KVClient(daemon.target, LAYOUT, deadline_s=10.0) as client, \
                tqdm(total=len(lengths) * args.repeats, desc="write-through") as bar:
            _shared_s(client, r, list(range(LAYOUT.block_tokens)),  # warm-up: connections
                      torch.zeros(LAYOUT.num_layers, 2, LAYOUT.block_tokens, 8, 128,
                                  dtype=torch.bfloat16))
            for n in lengths:
                require(n % LAYOUT.block_tokens == 0, f"--lengths: {n} is not whole blocks")
                through, raw, raw_async = [], [], []
                blocks = n // LAYOUT.block_tokens
                for rep in range(args.repeats):
                    tokens = torch.randint(0, 1 << 30, (n,), generator=gen).tolist()
                    kv = torch.randn(LAYOUT.num_layers, 2, n, 8, 128,
                                     generator=gen).to(torch.bfloat16)
                    through.append(_shared_s(client, r, tokens, kv))
                    # The two raw clients alternate which goes first (the first one's
                    # values land in the server's freshest memory).
                    tag = f"{n}-{rep}"
                    if rep % 2:
                        raw_async.append(_raw_set_asyncio_s(loop, ra, blocks, tag))
                        raw.append(_raw_set_s(r, blocks, tag))
                    else:
                        raw.append(_raw_set_s(r, blocks, tag))
                        raw_async.append(_raw_set_asyncio_s(loop, ra, blocks, tag))
                    bar.update()
                mib = n * LAYOUT.block_bytes // LAYOUT.block_tokens / (1 << 20)
                row = {"tokens": n, "MiB": mib,
                       "write-through ms": 1e3 * statistics.median(through),
                       "raw SET ms": 1e3 * statistics.median(raw),
                       "raw SET, asyncio ms": 1e3 * statistics.median(raw_async)}
                row["write-through MB/s"] = mib * 1.048576 / statistics.median(through)
                row["x raw SET"] = row["write-through ms"] / row["raw SET ms"]
                row["samples ms"] = [round(1e3 * s, 1) for s in through]
                rows.append(row)
        print(table(rows, [k for k in rows[0] if k != "samples ms"]))
        write_results(args.name, {"command": " ".join(sys.argv), "lengths": lengths,
                                  "hiredis": redis.utils.HIREDIS_AVAILABLE,
                                  "repeats": args.repeats, "rows": rows})
    finally:
        if ra is not None:
            loop.run_until_complete(ra.aclose())
        loop.close()
        daemon.stop(keep_arena=False)
        server.kill()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
