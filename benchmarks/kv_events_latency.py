"""Does a KV-events subscriber that stops reading slow the daemon? (issue 17, item 1)

Three daemons in turn, the same workload: events off; events on with a subscriber that reads
everything; events on with a subscriber connected that never reads (its socket fills, then the
daemon's PUB drops and its queue sheds). The workload churns the tiers so every call makes
events: each round publishes a described prompt (8 blocks of 256 tokens, 16-token engine blocks)
into a host tier of 16 blocks, so each publish demotes another prompt to disk (BlockRemoved CPU +
BlockStored STORAGE), then fetches an older prompt back from disk (BlockStored CPU). Reported:
p50 and p99 of publish and of fetch, and the events published and dropped.

    python -m benchmarks.kv_events_latency [--rounds 300]
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import threading
import time
from pathlib import Path

import torch
import zmq

from benchmarks.common import table, write_results
from kvstore import KVLayout
from kvstore.client import KVClient
from kvstore.engine_blocks import spans_for, vllm_block_hashes
from kvstore.server.process import DaemonProcess

LAYOUT = KVLayout(model="events-probe", num_layers=4, num_kv_heads=2, head_dim=64,
                  dtype=torch.float16, block_tokens=256)  # 512 KiB blocks
PROMPT_BLOCKS = 8
ENGINE_BLOCK = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100)[q - 1] * 1e3 if len(xs) > 1 else xs[0] * 1e3


def run(mode: str, rounds: int, work: Path) -> dict[str, float | str]:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    args = ["--host-bytes", str(16 * LAYOUT.block_bytes), "--disk-bytes", "1GiB",
            "--disk-sync", "never"]
    if mode != "off":
        args += ["--kv-events", endpoint, "--kv-events-queue", "1000"]
    shutil.rmtree(work / mode, ignore_errors=True)
    daemon = DaemonProcess(work / mode, *args).start()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 100)
    stop = threading.Event()
    received = [0]
    reader: threading.Thread | None = None
    if mode != "off":
        sub.connect(endpoint)
    if mode == "reading":
        def read() -> None:
            while not stop.is_set():
                if sub.poll(100):
                    sub.recv_multipart()
                    received[0] += 1
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
    time.sleep(0.5)
    n = PROMPT_BLOCKS * LAYOUT.block_tokens
    kv = torch.randn(LAYOUT.kv_shape(n)).to(LAYOUT.torch_dtype)
    publish_s: list[float] = []
    fetch_s: list[float] = []
    try:
        with KVClient(daemon.target, LAYOUT, deadline_s=10.0) as c:
            for r in range(rounds):
                tokens = [r * 7 + 1, *range(n - 1)]
                spans = spans_for(tokens, vllm_block_hashes(tokens, ENGINE_BLOCK),
                                  ENGINE_BLOCK, LAYOUT.block_tokens)
                t0 = time.perf_counter()
                c.publish(tokens, kv)
                c.describe_blocks(tokens, spans)
                publish_s.append(time.perf_counter() - t0)
                if r >= 4:  # two host tiers ago: on disk now
                    old = [(r - 4) * 7 + 1, *range(n - 1)]
                    t0 = time.perf_counter()
                    got, _ = c.fetch(old)
                    fetch_s.append(time.perf_counter() - t0)
                    if got != n:
                        raise RuntimeError(f"fetch found {got} of {n} tokens: not a disk hit")
            stats = c.stats()
    finally:
        stop.set()
        if reader is not None:
            reader.join()
        sub.close(linger=0)
        ctx.term()
        daemon.stop()
    return {"mode": mode, "publish_p50_ms": pct(publish_s, 50),
            "publish_p99_ms": pct(publish_s, 99),
            "fetch_p50_ms": pct(fetch_s, 50), "fetch_p99_ms": pct(fetch_s, 99),
            "batches_published": int(stats.kv_events_published) if stats else 0,
            "batches_dropped": int(stats.kv_events_dropped) if stats else 0,
            "batches_read": received[0] if mode == "reading" else 0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--work", type=Path, default=Path(".data/bench-kv-events"))
    a = p.parse_args()
    rows = [run(mode, a.rounds, a.work) for mode in ("off", "reading", "stalled")]
    print(table(rows, list(rows[0])))
    write_results("kv_events_latency", {"rounds": a.rounds, "rows": rows})


if __name__ == "__main__":
    main()
