"""What promotion into the gpu level costs a fetch (issue 15), side by side in one run.

Two daemons on the same machine, the same Llama-8B-shaped blocks (bf16, 32 MiB) and sizes:
one without a gpu level, one with `--gpu-bytes` of one prompt (`--gpu-device cpu`). Their
fetches are timed in alternation, each copied into an existing tensor and checked:
- **host**: the prompt is in host and not in gpu. Without a gpu level the fetch pins it (zero
  copy) and the client copies it out; with one, the daemon also copies it up into gpu (a lift,
  after it answered, under its own pins) and drops gpu's previous prompt (host holds it: no
  copy down).
- **disk**: the prompt is on disk only (page cache dropped before each fetch). Both daemons
  read it into host (a promotion, as ever); with a gpu level it is lifted into gpu as well.
Every timed fetch is checked on the daemon's counters: exactly one prompt's blocks hit in the
tier named, promoted into gpu where there is a gpu level, and no demotion (no block written
anywhere else). A lift ends after the fetch returned, so each fetch is followed by a wait (Stats
polled) until its promotions are counted and nothing is pinned: the next fetch neither finds
the prompt in gpu nor competes with the lift. That wait is timed too ("lifted after": from the
fetch's start, to the 2 ms of the polling). With device=cpu the lift is the placement engine's
bookkeeping plus a host memcpy, not a host-to-device copy into HBM; the memcpy row is that copy
alone.

    python -m benchmarks.promotion_cost [--blocks 8] [--block-tokens 256] [--repeats 7]
                                        [--gpu-device cpu] [--name promotion_cost]
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.common import RESULTS, barh, drop_page_cache, require, table, write_results
from benchmarks.tier_throughput import LAYOUT
from kvstore.client import KVClient
from kvstore.server.process import DaemonProcess

KINDS = ("no gpu level", "gpu level")


def moves(c: KVClient) -> dict[str, int]:
    s = c.stats()
    if s is None:
        raise RuntimeError("the daemon did not answer Stats")
    hits = {t.name: t.hits for t in s.tiers}
    return {"host": hits["host"], "disk": hits["disk"], "gpu": hits.get("gpu", 0),
            "promotions": s.promotions, "demotions": s.demotions,
            "busy": s.active_leases + sum(t.pinned_blocks for t in s.tiers)}


def settled(c: KVClient, promotions: int, within_s: float = 60.0) -> dict[str, int]:
    """The daemon's moves once the fetch's lift has ended (it runs after the reply): polled
    until `promotions` are counted and no lease or pin is left, or `within_s` has passed."""
    deadline = time.perf_counter() + within_s
    while True:
        m = moves(c)
        if (m["promotions"] >= promotions and not m["busy"]) or time.perf_counter() > deadline:
            return m
        time.sleep(0.002)


def memcpy_s(nbytes: int, repeats: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in: an existing buffer
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def timed_fetch(c: KVClient, tokens: list[int], kv: torch.Tensor, out: torch.Tensor,
                tier: str, lifted: bool, blocks: int) -> tuple[float, float]:
    """One fetch of a prompt `tier` holds, timed; its bytes and the daemon's moves checked
    once its lift has ended. Returns the fetch's seconds and those until the lift ended."""
    before = moves(c)
    want = {"host": 0, "disk": 0, "gpu": 0, tier: blocks,
            "promotions": blocks * ((tier == "disk") + lifted), "demotions": 0, "busy": 0}
    began = time.perf_counter()
    n, _ = c.fetch(tokens, into=out)
    seconds = time.perf_counter() - began
    after = settled(c, before["promotions"] + want["promotions"])
    until_lifted = time.perf_counter() - began
    require(n == len(tokens) and torch.equal(out.view(torch.int16), kv.view(torch.int16)),
            f"{tier} fetch: {n} of {len(tokens)} tokens, byte-identical")
    got = {k: after[k] - before[k] for k in after}
    require(got == want, f"{tier} fetch moved {got}, expected {want}")
    return seconds, until_lifted


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--blocks", type=int, default=8, help="blocks per prompt")
    p.add_argument("--block-tokens", type=int, default=LAYOUT.block_tokens,
                   help="tokens per block (128 KiB each: 256 makes 32 MiB blocks)")
    p.add_argument("--repeats", type=int, default=7, help="timed fetches per tier and daemon")
    p.add_argument("--gpu-device", default="cpu", help="the gpu level's device (cuda on a GPU)")
    p.add_argument("--data-dir", default=".data/promotion_cost")
    p.add_argument("--name", default="promotion_cost", help="results file and plot name")
    args = p.parse_args()
    layout = dataclasses.replace(LAYOUT, block_tokens=args.block_tokens)

    n_tokens = args.blocks * layout.block_tokens
    nbytes = n_tokens * layout.bytes_per_token
    data = Path(args.data_dir)
    shutil.rmtree(data, ignore_errors=True)
    # Host holds two prompts, gpu one, disk all three: alternating two prompts in host, or
    # cycling three through disk, every fetch promotes and every victim is held below already.
    common = ("--host-bytes", str(2 * nbytes), "--disk-bytes", str(8 * nbytes),
              "--disk-sync", "never", "--eviction-policy", "lru")
    daemons = {KINDS[0]: DaemonProcess(data / "plain", *common),
               KINDS[1]: DaemonProcess(data / "gpu", *common, "--gpu-bytes", str(nbytes),
                                       "--gpu-device", args.gpu_device)}
    prompts = [[i * 10**6 + t for t in range(n_tokens)] for i in range(3)]
    g = torch.Generator().manual_seed(0)
    kvs = [torch.randn(layout.kv_shape(n_tokens), generator=g).to(layout.torch_dtype)
           for _ in prompts]
    out = torch.zeros_like(kvs[0])  # touched once here: no page faults inside the timings
    res: dict[str, list[float]] = {f"{tier}, {kind}": [] for tier in ("host", "disk")
                                   for kind in KINDS}
    lifted_after: dict[str, list[float]] = {f"{tier}, {KINDS[1]}": [] for tier in ("host", "disk")}
    bar = tqdm(total=4 + 4 * (args.repeats + 2), desc="promotion cost", unit="step")
    memcpy = memcpy_s(nbytes, args.repeats)
    bar.update()
    try:
        for d in daemons.values():
            d.start()
        bar.update()
        clients = {k: KVClient(d.target, layout, deadline_s=60) for k, d in daemons.items()}
        for c in clients.values():  # host: prompts 1 and 2 (0 went down to disk)
            for tokens, kv in zip(prompts, kvs, strict=True):
                require(c.publish(tokens, kv) == n_tokens, "published whole")
        bar.update()
        for r in range(-2, args.repeats):  # two untimed rounds: each prompt lifted once
            which = 1 + r % 2  # not the prompt gpu holds: the one fetched before
            for kind in KINDS if r % 2 else KINDS[::-1]:
                s, until = timed_fetch(clients[kind], prompts[which], kvs[which], out, "host",
                                       kind == KINDS[1], args.blocks)
                if r >= 0:
                    res[f"host, {kind}"].append(s)
                    if kind == KINDS[1]:
                        lifted_after[f"host, {kind}"].append(until)
                bar.update()
        # A restart flushes host to disk: gpu and host start empty, disk holds all three.
        for c in clients.values():
            c.close()
        for d in daemons.values():
            require(d.stop() == 0, "the daemon stopped cleanly")
            d.start()
        clients = {k: KVClient(d.target, layout, deadline_s=60) for k, d in daemons.items()}
        bar.update()
        for r in range(-2, args.repeats):  # cycling three prompts: each read from disk
            which = (r + 2) % 3
            for kind in KINDS if r % 2 else KINDS[::-1]:
                drop_page_cache(daemons[kind].data_dir / "disk" / "blocks.dat")
                s, until = timed_fetch(clients[kind], prompts[which], kvs[which], out, "disk",
                                       kind == KINDS[1], args.blocks)
                if r >= 0:
                    res[f"disk, {kind}"].append(s)
                    if kind == KINDS[1]:
                        lifted_after[f"disk, {kind}"].append(until)
                bar.update()
        for c in clients.values():
            c.close()
    finally:
        for d in daemons.values():
            d.stop(keep_arena=False)
        bar.close()
    shutil.rmtree(data, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in res.items()}
    rows = [{"fetch": "memcpy of the prompt (reference)", "ms": memcpy * 1e3, "ratio": "",
             "added ms": "", "lifted after ms": ""}]
    for tier in ("host", "disk"):
        base = med[f"{tier}, {KINDS[0]}"]
        for kind in KINDS:
            s = med[f"{tier}, {kind}"]
            after = lifted_after.get(f"{tier}, {kind}")
            rows.append({"fetch": f"{tier}, {kind}", "ms": s * 1e3, "ratio": s / base,
                         "added ms": (s - base) * 1e3,
                         "lifted after ms": statistics.median(after) * 1e3 if after else ""})
    print(f"\n{args.blocks} blocks x {layout.block_bytes >> 20} MiB = {nbytes >> 20} MiB per "
          f"prompt, median of {args.repeats} fetches per row, gpu level on {args.gpu_device}\n")
    print(table(rows, ["fetch", "ms", "ratio", "added ms", "lifted after ms"]))
    path = write_results(args.name, {
        "bytes": nbytes, "block_bytes": layout.block_bytes, "blocks": args.blocks,
        "repeats": args.repeats, "gpu_device": args.gpu_device, "rows": rows, "samples_s": res,
        "lifted_after_s": lifted_after})
    _plot(rows, RESULTS / f"{args.name}.png", f"{nbytes >> 20} MiB prompt, "
          f"{layout.block_bytes >> 20} MiB blocks, device={args.gpu_device}")
    print(f"\nresults: {path}")


def _plot(rows: list[dict], path: Path, what: str) -> None:
    notes = [f"{r['ms']:.0f} ms" + (f" ({r['ratio']:.2f}x)" if r["ratio"] != "" else "")
             for r in rows]
    colors = ["#999" if r["ratio"] == "" else "#27a" if KINDS[0] in r["fetch"] else "#d62"
              for r in rows]
    barh(path, [r["fetch"] for r in rows], [r["ms"] for r in rows], notes, colors,
         "fetch latency, ms (median)",
         f"A fetch with and without promotion into gpu\n({what})", width=7.5)


if __name__ == "__main__":
    main()
