"""kvstore's part of the demo's warm TTFT, without the model, for prompts up to and past the
host tier (issue 16): the demo's KV layout (fp32, 32 layers x 8 KV heads x 128, 256-token blocks
of 64 MiB) and daemon (2 GiB host, 8 GiB disk). Per prompt length: publish, fetch twice from
the host tier, restart the daemon (SIGTERM flushes host blocks to disk), fetch twice from the
disk tier; each fetch byte-checked and timed, with the daemon's movement counters over it.
Writes benchmarks/results/fetch_past_host.json.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import require, table, write_results
from kvstore import KVLayout
from kvstore.client import KVClient
from kvstore.server.process import DaemonProcess

LAYOUT = KVLayout(model="fetch-past-host", num_layers=32, num_kv_heads=8, head_dim=128,
                  dtype=torch.float32, block_tokens=256)


def counters(c: KVClient) -> dict[str, int]:
    s = c.stats()
    if s is None:
        raise RuntimeError("the daemon did not answer Stats")
    t = {x.name: x for x in s.tiers}
    return {"host hits": t["host"].hits, "disk hits": t["disk"].hits,
            "promotions": s.promotions, "host evictions": t["host"].evictions,
            "demotions": s.demotions, "disk MiB written": t["disk"].bytes_written >> 20}


def timed(c: KVClient, tokens: list[int], kv: torch.Tensor, out: torch.Tensor,
          run: str) -> dict[str, Any]:
    before = counters(c)
    began = time.perf_counter()
    n, got = c.fetch(tokens, into=out)
    seconds = time.perf_counter() - began
    require(n == len(tokens) and got is not None and torch.equal(got, kv),
            f"{run}: the whole prompt, byte-identical (got {n} of {len(tokens)} tokens; "
            "after a restart, fewer means the SIGTERM flush ran out of shutdown_flush_s)")
    after = counters(c)
    return {"blocks": len(tokens) // LAYOUT.block_tokens, "run": run, "fetch s": seconds,
            **{k: after[k] - before[k] for k in after}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", default="8192,10240", help="prompt lengths (whole blocks)")
    p.add_argument("--data-dir", default=".data/fetch_past_host")
    args = p.parse_args()
    rows = []
    for n in (int(x) // LAYOUT.block_tokens * LAYOUT.block_tokens
              for x in args.tokens.split(",")):
        data = Path(args.data_dir)
        shutil.rmtree(data, ignore_errors=True)
        daemon = DaemonProcess(data / "kvstore", "--host-bytes", "2GiB", "--disk-bytes", "8GiB")
        tokens = list(range(n))
        kv = torch.randn(LAYOUT.kv_shape(n), generator=torch.Generator().manual_seed(0))
        out = torch.zeros_like(kv)  # touched once here: no page faults inside the timings
        try:
            daemon.start()
            with KVClient(daemon.target, LAYOUT, deadline_s=60) as c:
                require(c.publish(tokens, kv) == n, "published whole")
                rows += [timed(c, tokens, kv, out, f"host {i}") for i in (1, 2)]
            daemon.stop()
            daemon.start()
            with KVClient(daemon.target, LAYOUT, deadline_s=60) as c:
                rows += [timed(c, tokens, kv, out, f"disk {i}") for i in (1, 2)]
        finally:
            daemon.stop(keep_arena=False)
            shutil.rmtree(data, ignore_errors=True)
    print(f"\nKV {LAYOUT.bytes_per_token >> 10} KiB/token, {LAYOUT.block_bytes >> 20} MiB blocks; "
          "host tier 32 blocks (2 GiB)\n")
    print(table(rows, list(rows[0])))
    path = write_results("fetch_past_host", {"rows": rows})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
