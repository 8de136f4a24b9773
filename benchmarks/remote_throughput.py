"""Remote-tier fetch throughput beside a raw redis-py GET of the same values, in one run.

For a standalone Redis and a 3-node Cluster, both on loopback, and several block sizes
(32 MiB is a Llama-8B-shaped 256-token bf16 block), the same framed values are read:
- raw GET: a redis-py pipeline of GETs in the same batches, bytes returned, nothing checked
  (the limit: what the client library delivers);
- remote tier: `RemoteTier.get` (what read-through uses): the same pipelined GETs in the same
  batches, plus header decoding and the xxh3-128 verification of every payload against its
  key and layout;
- + copy to host: the tier's payloads copied into a preallocated buffer, as read-through into
  the host arena did before it read straight into it;
- into host: what read-through does now, `RemoteTier.held` (each batch's headers) then
  `RemoteTier.get_into` (each payload received straight into its place in a preallocated
  buffer, standing for the host arena, and verified there).
Goal (issue 5): remote tier >= 0.9x raw GET. Batches are the store's (`REMOTE_BATCH_*`).
`--nodes-ab`: instead, on the Cluster only, "into host" with each batch's nodes read at once
(`tiers.bulk_get.PARALLEL_NODES`) against one after another, alternated in one process.

    python -m benchmarks.remote_throughput [--total-mib 256] [--repeats 5] [--name NAME]
    python -m benchmarks.remote_throughput --nodes-ab [--repeats 7]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.common import RESULTS, require, table, write_results
from kvstore.server.store import REMOTE_BATCH_BLOCKS, REMOTE_BATCH_BYTES
from kvstore.tiers import bulk_get
from kvstore.tiers.remote import RemoteOptions, RemoteTier, RemoteWrite, frame_value, redis_key
from tests import redis_servers
from tests.redis_servers import RedisClusterNodes, RedisServer

NS = bytes(range(32))
LAYOUT = b"L" * 32
SIZES_MIB = (1, 4, 32)
PATHS = ("raw GET", "remote tier", "+ copy to host", "into host")


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _batches(keys: list[bytes], size: int) -> list[list[bytes]]:
    n = max(1, min(REMOTE_BATCH_BLOCKS, REMOTE_BATCH_BYTES // size))
    return [keys[i : i + n] for i in range(0, len(keys), n)]


async def _raw(tier: RemoteTier, batches: list[list[bytes]]) -> int:
    client: Any = tier._client  # the same connection pool the tier reads through
    got = 0
    for batch in batches:
        pipe = client.pipeline(transaction=False)
        for k in batch:
            pipe.get(redis_key(NS, k))
        got += sum(len(v) for v in await pipe.execute())
    return got


async def _tier(tier: RemoteTier, batches: list[list[bytes]], dst: bytearray | None) -> int:
    """The read-through path: `RemoteTier.get` per batch (verified), as the store calls it."""
    got = 0
    out = memoryview(dst) if dst is not None else None
    for batch in batches:
        values = await tier.get(NS, batch, LAYOUT)
        for payload in values:
            if payload is None:
                raise RuntimeError("a value went missing")
            if out is not None:
                out[: len(payload)] = payload
            got += len(payload)
        del values, payload  # as the store does: a batch's buffers go before the next read
    return got


async def _into(tier: RemoteTier, batches: list[list[bytes]], size: int, dst: bytearray) -> int:
    """The read-through path now: headers first, then each payload into its place in `dst`."""
    got = 0
    for batch in batches:
        views = [memoryview(dst)[i * size : (i + 1) * size] for i in range(len(batch))]
        if not all(await tier.held(NS, batch, LAYOUT, size)):
            raise RuntimeError("a value went missing")
        if not all(await tier.get_into(NS, batch, LAYOUT, views)):
            raise RuntimeError("a value failed its read")
        got += size * len(batch)
    return got


async def _stored(tier: RemoteTier, size: int, total: int,
                  ) -> tuple[int, list[bytes], list[list[bytes]]]:
    """`total` bytes of framed `size`-byte values written through `tier`: (size, their keys,
    the keys in the store's read batches)."""
    keys = [i.to_bytes(32, "big") for i in range(max(2, total // size))]
    payload = os.urandom(size)
    for batch in _batches(keys, size):
        writes = [RemoteWrite(NS, k, frame_value(k, LAYOUT, payload)) for k in batch]
        written = (await tier.put(writes)).written
        require(written == len(batch), f"wrote {written} of {len(batch)} values")
    return size, keys, _batches(keys, size)


async def measure(url: str, total: int, repeats: int, bar: tqdm) -> list[dict[str, Any]]:
    tier = RemoteTier(url, RemoteOptions(ttl_s=3600, timeout_s=30.0))
    rows = []
    try:
        for mib in SIZES_MIB:
            size, keys, batches = await _stored(tier, mib << 20, total)
            nbytes = size * len(keys)
            dst = bytearray(size)
            arena = bytearray(size * len(batches[0]))  # touched, as the prefaulted arena
            samples: dict[str, list[float]] = {p: [] for p in PATHS}
            await _raw(tier, batches)  # warm the connections
            for _ in range(repeats):  # interleaved, so drift hits every path alike
                for path in PATHS:
                    t = time.perf_counter()
                    if path == "raw GET":
                        await _raw(tier, batches)
                    elif path == "into host":
                        got = await _into(tier, batches, size, arena)
                        require(got == nbytes, f"{path}: read {got} of {nbytes} bytes")
                    else:
                        got = await _tier(tier, batches,
                                          dst if path == "+ copy to host" else None)
                        require(got == nbytes, f"{path}: read {got} of {nbytes} bytes")
                    samples[path].append(_gbps(nbytes, time.perf_counter() - t))
                    bar.update()
            await tier.delete(NS, keys)
            med = {p: statistics.median(v) for p, v in samples.items()}
            rows.append({"block MiB": mib, "blocks": len(keys), **med,
                         "tier/raw": med["remote tier"] / med["raw GET"],
                         "into/copy": med["into host"] / med["+ copy to host"],
                         "samples": samples})
        failures = tier.stats().integrity_failures
        require(failures == 0, f"{failures} values failed verification")
    finally:
        await tier.close()
    return rows


async def nodes_ab(url: str, total: int, repeats: int, bar: tqdm) -> list[dict[str, Any]]:
    """GB/s of "into host" on a Cluster, its nodes read at once and one after another."""
    tier = RemoteTier(url, RemoteOptions(ttl_s=3600, timeout_s=30.0))
    rows = []
    try:
        for mib in SIZES_MIB:
            size, keys, batches = await _stored(tier, mib << 20, total)
            arena = bytearray(size * len(batches[0]))
            await _into(tier, batches, size, arena)  # the connections made
            samples: dict[bool, list[float]] = {True: [], False: []}
            for r in range(repeats):
                for parallel in (True, False) if r % 2 == 0 else (False, True):
                    bulk_get.PARALLEL_NODES = parallel
                    t = time.perf_counter()
                    got = await _into(tier, batches, size, arena)
                    samples[parallel].append(_gbps(got, time.perf_counter() - t))
                    bar.update()
            await tier.delete(NS, keys)
            at_once, in_turn = (statistics.median(samples[p]) for p in (True, False))
            rows.append({"block MiB": mib, "batch blocks": len(batches[0]),
                         "nodes at once": at_once, "one after another": in_turn,
                         "at once / in turn": at_once / in_turn})
    finally:
        bulk_get.PARALLEL_NODES = True
        await tier.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--total-mib", type=int, default=256, help="bytes read per measurement")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--name", default="remote_throughput", help="results file and plot name")
    p.add_argument("--nodes-ab", action="store_true",
                   help="the Cluster's nodes read at once against one after another")
    args = p.parse_args()
    if not redis_servers.available():
        raise SystemExit(redis_servers.SKIP_REASON)
    total = args.total_mib << 20
    if args.nodes_ab:
        bar = tqdm(total=2 * len(SIZES_MIB) * args.repeats, desc="cluster nodes", unit="pass")
        with tempfile.TemporaryDirectory(prefix="kvstore-bench-redis-") as tmp:
            cluster = RedisClusterNodes(Path(tmp) / "cluster", 3).start()
            try:
                rows = asyncio.run(nodes_ab(cluster.url, total, args.repeats, bar))
            finally:
                cluster.stop()
        bar.close()
        print(f"\n3-node Cluster, into host, GB/s of payload, median of {args.repeats}\n")
        print(table(rows, list(rows[0])))
        name = args.name if args.name != "remote_throughput" else "remote_throughput_nodes"
        print(f"\nresults: {write_results(name, {'repeats': args.repeats, 'rows': rows})}")
        return
    results: dict[str, list[dict[str, Any]]] = {}
    bar = tqdm(total=2 * len(SIZES_MIB) * args.repeats * len(PATHS), desc="remote throughput",
               unit="pass")
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-redis-") as tmp:
        server = RedisServer(Path(tmp) / "standalone").start()
        try:
            results["standalone"] = asyncio.run(measure(server.url, total, args.repeats, bar))
        finally:
            server.stop()
        cluster = RedisClusterNodes(Path(tmp) / "cluster", 3).start()
        try:
            results["cluster (3 nodes)"] = asyncio.run(
                measure(cluster.url, total, args.repeats, bar))
        finally:
            cluster.stop()
    bar.close()
    flat = [{"redis": mode, **{k: v for k, v in r.items() if k != "samples"}}
            for mode, rows in results.items() for r in rows]
    print(f"\nGB/s of payload, median of {args.repeats}, {args.total_mib} MiB per measurement; "
          "goal: remote tier >= 0.9x raw GET\n")
    print(table(flat, ["redis", "block MiB", "blocks", *PATHS, "tier/raw", "into/copy"]))
    path = write_results(args.name, {
        "total_bytes": total, "repeats": args.repeats, "batch_bytes": REMOTE_BATCH_BYTES,
        "batch_blocks": REMOTE_BATCH_BLOCKS, "goal": "remote tier >= 0.9x raw GET",
        "results": results})
    _plot(results, RESULTS / f"{args.name}.png")
    print(f"\nresults: {path}")


def _plot(results: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.4), sharey=True)
    for ax, (mode, rows) in zip(axes, results.items(), strict=True):
        width = 0.2
        for j, (p, color) in enumerate(zip(PATHS, ("#999", "#27a", "#7ac", "#e83"),
                                           strict=True)):
            xs = [i + (j - 1.5) * width for i in range(len(rows))]
            ax.bar(xs, [r[p] for r in rows], width, label=p, color=color)
        for i, r in enumerate(rows):
            ax.text(i, r["remote tier"], f"{r['tier/raw']:.2f}x", ha="center", va="bottom",
                    fontsize=8)
        ax.set_xticks(range(len(rows)), [f"{r['block MiB']} MiB" for r in rows])
        ax.set_title(f"{mode}")
        ax.set_xlabel("block size")
    axes[0].set_ylabel("GB/s (median)")
    axes[0].legend(fontsize=8)
    fig.suptitle("remote-tier fetch vs raw redis-py GET (same values, same run)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
