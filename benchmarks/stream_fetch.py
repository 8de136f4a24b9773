"""Fetch over TCP (`transfer="stream"`): what a client on another machine gets from a daemon,
a disaggregated consumer from its producer's daemon above all (docs/ENGINES.md, "the
producer's daemon as a peer").

One daemon listening on TCP (loopback) is published prompts of the disaggregated benchmark's
shape (8 layers x 8 KV heads x 128, bf16: 32 KiB per token, 4 MiB blocks of 128 tokens). Per
length, alternated, median of `--repeats`:
- "stream": `KVClient.fetch_with` over TCP, the whole prompt (the consumer's load);
- "grpc ceiling": a bare gRPC server streaming the same bytes in messages of the daemon's
  chunk size, to a client in another process (no daemon, no protobuf), both with the
  daemon's malloc tuning: the limit of gRPC's Python library on this machine;
- "shm": the same fetch over the Unix socket, zero copy (the local engine's load);
- "publish stream" / "publish shm": `KVClient.publish_with` of a prompt the daemon lacks (a
  fresh one each time), its `produce` copying from a tensor, over TCP / the Unix socket (an
  engine's save to a daemon on another host / its own).

    python -m benchmarks.stream_fetch [--lengths 1024,2048,4096] [--repeats 7]
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.common import require, table, write_results
from kvstore.client import KVClient
from kvstore.layout import KVLayout
from kvstore.malloc_tuning import keep_large_buffers
from kvstore.server.process import DaemonProcess
from kvstore.server.service import STREAM_CHUNK
from tests.redis_servers import free_port

LAYOUT = KVLayout(model="stream-fetch-bench", num_layers=8, num_kv_heads=8, head_dim=128,
                  dtype=torch.bfloat16, block_tokens=128)


def _fetch_s(client: KVClient, tokens: list[int]) -> float:
    t0 = time.perf_counter()
    got = client.fetch_with(tokens, lambda blocks, views, stop: len(blocks))
    took = time.perf_counter() - t0
    require(got == len(tokens), f"fetched {got} of {len(tokens)} tokens")
    return took


def _publish_s(client: KVClient, tokens: list[int], kv: torch.Tensor) -> float:
    bt = LAYOUT.block_tokens

    def produce(blocks: list[int], views: list[torch.Tensor], stop: Any) -> None:
        for b, view in zip(blocks, views, strict=True):
            view.copy_(kv[:, :, b * bt : (b + 1) * bt])

    t0 = time.perf_counter()
    got = client.publish_with(tokens, produce)
    took = time.perf_counter() - t0
    require(got == len(tokens), f"published {got} of {len(tokens)} tokens")
    return took


# ---- the bare gRPC pair: `python -m benchmarks.stream_fetch --grpc-server PORT`
def _grpc_server(port: int) -> None:
    import grpc

    keep_large_buffers()  # as the daemon does: a like-for-like ceiling
    payload = bytes(STREAM_CHUNK)

    async def stream(request: bytes, context: Any) -> Any:
        for _ in range(int(request.decode()) // STREAM_CHUNK):
            yield payload

    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20)])
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("b.B", {
            "S": grpc.unary_stream_rpc_method_handler(stream, lambda b: b, lambda b: b)}),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        print("READY", flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


class GrpcCeiling:
    def __init__(self) -> None:
        import grpc

        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.stream_fetch",
                                      "--grpc-server", str(self.port)], stdout=subprocess.PIPE,
                                     text=True)
        require(self.proc.stdout is not None and "READY" in self.proc.stdout.readline(),
                "the bare gRPC server did not start")
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}", options=[
            ("grpc.max_receive_message_length", 64 << 20)])
        self.call = self.channel.unary_stream("/b.B/S", request_serializer=lambda b: b,
                                              response_deserializer=lambda b: b)

    def seconds(self, nbytes: int) -> float:
        t0 = time.perf_counter()
        got = sum(len(m) for m in self.call(str(nbytes).encode()))
        took = time.perf_counter() - t0
        require(got == nbytes // STREAM_CHUNK * STREAM_CHUNK, f"got {got} bytes")
        return took

    def close(self) -> None:
        self.channel.close()
        self.proc.kill()
        self.proc.wait()


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--grpc-server":
        _grpc_server(int(sys.argv[2]))
        return
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1024,2048,4096", help="prompt tokens")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--name", default="stream_fetch", help="results file name")
    args = p.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    root = Path(tempfile.mkdtemp(prefix="kvw-", dir="/tmp"))
    port, token = free_port(), secrets.token_hex(16)
    daemon = DaemonProcess(root / "d", "--host-bytes", "2GiB", "--disk-bytes", "0",
                           "--listen", f"127.0.0.1:{port}", "--token", token).start()
    ceiling = GrpcCeiling()
    rows = []
    try:
        with KVClient(daemon.target, LAYOUT) as local, \
                KVClient(f"127.0.0.1:{port}", LAYOUT, token=token, deadline_s=30) as tcp:
            require(tcp.streams, "the TCP client does not stream")
            for n in tqdm(lengths, desc="lengths"):
                tokens = list(range(n))
                kv = torch.randn(LAYOUT.kv_shape(n)).to(LAYOUT.torch_dtype)
                require(local.publish(tokens, kv) == n, "publish refused")
                nbytes = n // LAYOUT.block_tokens * LAYOUT.block_bytes
                times: dict[str, list[float]] = {"stream": [], "grpc ceiling": [], "shm": [],
                                                 "publish stream": [], "publish shm": []}
                for r in range(args.repeats):
                    times["stream"].append(_fetch_s(tcp, tokens))
                    times["grpc ceiling"].append(ceiling.seconds(nbytes))
                    times["shm"].append(_fetch_s(local, tokens))
                    fresh = [t + (2 * r + 1) * 1_000_000 for t in tokens]  # new keys each time
                    times["publish stream"].append(_publish_s(tcp, fresh, kv))
                    fresh = [t + 1_000_000 for t in fresh]
                    times["publish shm"].append(_publish_s(local, fresh, kv))
                row: dict[str, Any] = {"tokens": n, "MiB": nbytes >> 20}
                for k, v in times.items():
                    row[f"{k} ms"] = statistics.median(v) * 1e3
                    row[f"{k} GB/s"] = nbytes / statistics.median(v) / 1e9
                row["stream / ceiling"] = row["stream ms"] / row["grpc ceiling ms"]
                row["samples"] = {k: [round(x * 1e3, 2) for x in v] for k, v in times.items()}
                rows.append(row)
    finally:
        ceiling.close()
        daemon.kill()
        shutil.rmtree(root, ignore_errors=True)
    print(table(rows, ["tokens", "MiB", "stream ms", "stream GB/s", "grpc ceiling ms",
                       "grpc ceiling GB/s", "stream / ceiling", "shm ms", "shm GB/s",
                       "publish stream ms", "publish stream GB/s", "publish shm ms"]))
    print(write_results(args.name, {"command": " ".join(sys.argv), "repeats": args.repeats,
                                    "chunk_bytes": STREAM_CHUNK, "rows": rows}))


if __name__ == "__main__":
    main()
