"""A SIGTERM flush cut short by `shutdown_flush_s` must leave a prompt's prefix on disk.

The demo's KV layout (fp32, 32 layers x 8 KV heads x 128, 256-token blocks of 64 MiB) and
daemon (2 GiB host = 32 blocks, 8 GiB disk): publish a 40-block prompt (its middle is demoted
to disk), fetch it twice, stop the daemon with a short flush budget, restart, and report which
blocks are on disk and the cached prefix. Run from the repository root:

    python -m benchmarks.flush_cut_short --flush-s 1.0
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

from benchmarks.common import require
from kvstore import KVLayout
from kvstore.client import KVClient
from kvstore.server.process import DaemonProcess

LAYOUT = KVLayout(model="flush-cut-short", num_layers=32, num_kv_heads=8, head_dim=128,
                  dtype=torch.float32, block_tokens=256)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flush-s", default="1.0", help="shutdown_flush_s of the stopped daemon")
    p.add_argument("--blocks", type=int, default=40, help="prompt length in 256-token blocks")
    p.add_argument("--data-dir", default=".data/flush_cut_short")
    args = p.parse_args()
    data = Path(args.data_dir)
    shutil.rmtree(data, ignore_errors=True)
    daemon = DaemonProcess(data / "kvstore", "--host-bytes", "2GiB", "--disk-bytes", "8GiB",
                           "--shutdown-flush-s", args.flush_s)
    tokens = list(range(args.blocks * LAYOUT.block_tokens))
    kv = torch.randn(LAYOUT.kv_shape(len(tokens)), generator=torch.Generator().manual_seed(0))
    try:
        daemon.start()
        with KVClient(daemon.target, LAYOUT, deadline_s=60) as c:
            require(c.publish(tokens, kv) == len(tokens), "published whole")
            for _ in range(2):
                require(c.fetch(tokens)[0] == len(tokens), "fetched whole")
            stats = c.stats()
            if stats is None:
                raise RuntimeError("the daemon did not answer Stats")
            before = {t.name: t.blocks for t in stats.tiers}
        daemon.stop()  # SIGTERM: flushes host-only blocks for up to --flush-s seconds
        daemon.start()
        with KVClient(daemon.target, LAYOUT, deadline_s=60) as c:
            prefix = c.lookup(tokens) // LAYOUT.block_tokens
            # One key per Lookup: which blocks the disk holds (after the prefix is measured,
            # since lookups rank what they find).
            on_disk = [i for i, key in enumerate(c.keys(tokens))
                       if c._run(c._aio._lookup([key]), None).hits]
    finally:
        daemon.stop(keep_arena=False)
        shutil.rmtree(data, ignore_errors=True)
    print(f"before the stop: host {before['host']} blocks, disk {before['disk']}")
    print(f"after the restart: {len(on_disk)} blocks on disk: {on_disk}")
    print(f"cached prefix: {prefix} of {args.blocks} blocks")


if __name__ == "__main__":
    main()
