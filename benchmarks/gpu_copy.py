"""Copy-kernel bandwidth on a GPU (issue 19, step 2): gather and scatter of a Llama-3-8B-shaped
prompt between vLLM's paged layout in device memory and (a) a pinned host arena (a shared
mapping registered with cudaHostRegister, as the daemon's), (b) device staging, beside the
copy engine moving the same bytes (cudaMemcpyAsync through torch) and torch's own indexing
copy. Every kernel result is checked byte for byte against torch's indexing.

    python -m benchmarks.gpu_copy --tokens 2048,4096,8192,16384,32768     # needs CUDA

Goals: >= 0.9x the copy engine's host<->device bytes/s; >= 0.7x a device-to-device memcpy.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.common import require, table, write_results
from kvstore import kernels
from kvstore.kernels import EngineKV, EngineLayout

LAYERS, HEADS, DIM, PAGE, BLOCK = 32, 8, 128, 16, 256  # Llama-3-8B, bf16, vLLM pages


def time_ms(fn: Callable[[], Any], iters: int = 9) -> float:
    """Median device time of `fn` (events), after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        torch.cuda._sleep(20_000_000)  # the GPU waits while the host enqueues: time the copy
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


class PinnedArena:
    """A shared mapping of `/dev/shm` registered as pinned memory, as the daemon's arena."""

    def __init__(self, nbytes: int) -> None:
        fd = os.open("/dev/shm", os.O_RDWR | os.O_TMPFILE, 0o600)
        os.ftruncate(fd, nbytes)
        self.map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        self.raw = torch.frombuffer(self.map, dtype=torch.uint8)
        self.raw.fill_(1)  # backed before it is registered
        began = time.perf_counter()
        rc = torch.cuda.cudart().cudaHostRegister(self.raw.data_ptr(), nbytes, 0)
        self.register_s = time.perf_counter() - began  # what `Arena.pin` costs a client
        require(int(rc) == 0, f"cudaHostRegister failed: {rc}")

    def close(self) -> float:
        """Unregister; returns the seconds it took."""
        began = time.perf_counter()
        torch.cuda.cudart().cudaHostUnregister(self.raw.data_ptr())
        return time.perf_counter() - began


def torch_gather(cache: list[torch.Tensor], ids: torch.Tensor, out: torch.Tensor) -> None:
    """torch's own indexing: each layer's pages picked, then laid out as the staging slots."""
    blocks = ids.shape[0]
    for layer, t in enumerate(cache):  # t: [2, pages, page, heads, dim]
        out[:, layer] = t[:, ids].permute(1, 0, 2, 3, 4, 5).reshape(blocks, 2, BLOCK, HEADS, DIM)


def one_size(tokens: int, gen: torch.Generator) -> list[dict[str, Any]]:
    blocks = tokens // BLOCK
    pages = tokens // PAGE + 64
    cache = [torch.randn(2, pages, PAGE, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
             for _ in range(LAYERS)]
    engine = EngineKV.paged(EngineLayout.VLLM_NHD, cache)
    ids = torch.randperm(pages, generator=gen)[: tokens // PAGE].reshape(blocks, BLOCK // PAGE)
    shape = kernels.staging_shape(engine, blocks, BLOCK)
    dev = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
    nbytes = dev.numel() * 2
    arena = PinnedArena(nbytes)
    host = arena.raw.view(torch.bfloat16).view(shape)
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    flat_dev2 = torch.empty_like(flat_dev)

    expected = torch.empty_like(dev)
    torch_gather(cache, ids.cuda(), expected)
    kernels.gather(engine, host, ids)
    kernels.gather(engine, dev, ids)
    torch.cuda.synchronize()
    require(torch.equal(host.cuda(), expected), f"{tokens}: pinned gather differs from torch")
    require(torch.equal(dev, expected), f"{tokens}: device gather differs from torch")
    # Scatter back from each staging into a poisoned cache: every page the ids name restored.
    for staging in (host, dev):
        saved = [t[:, ids.cuda()].clone() for t in cache]
        for t in cache:
            t[:, ids.cuda()] = float("nan")
        kernels.scatter(staging, engine, ids)
        torch.cuda.synchronize()
        require(all(torch.equal(t[:, ids.cuda()], s) for t, s in zip(cache, saved, strict=True)),
                f"{tokens}: scatter from {staging.device} did not restore the pages")

    ids_dev = ids.cuda()
    rows = []
    cases = [
        ("gather D2H (pinned arena)", lambda: kernels.gather(engine, host, ids),
         lambda: arena.raw.copy_(flat_dev, non_blocking=True),
         lambda: (torch_gather(cache, ids_dev, dev), host.copy_(dev, non_blocking=True))),
        ("scatter H2D (pinned arena)", lambda: kernels.scatter(host, engine, ids),
         lambda: flat_dev.copy_(arena.raw, non_blocking=True), None),
        ("gather D2D", lambda: kernels.gather(engine, dev, ids),
         lambda: flat_dev2.copy_(flat_dev), lambda: torch_gather(cache, ids_dev, dev)),
        ("scatter D2D", lambda: kernels.scatter(dev, engine, ids),
         lambda: flat_dev2.copy_(flat_dev), None),
    ]
    for name, kernel, memcpy, by_torch in cases:
        k_ms, m_ms = time_ms(kernel), time_ms(memcpy)
        t_ms = time_ms(by_torch) if by_torch else float("nan")
        rows.append({"tokens": tokens, "copy": name, "MiB": nbytes / 2**20,
                     "kernel_GBps": nbytes / k_ms / 1e6, "memcpy_GBps": nbytes / m_ms / 1e6,
                     "torch_GBps": nbytes / t_ms / 1e6, "kernel_over_memcpy": m_ms / k_ms})
    arena.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="2048,4096,8192,16384,32768")
    p.add_argument("--out", default="gpu_copy", help="results name (benchmarks/results)")
    p.add_argument("--pin-gib", type=int, default=0,
                   help="also time registering (and unregistering) an arena this large")
    args = p.parse_args()
    require(torch.cuda.is_available(), "needs a CUDA device")
    pin = {}
    if args.pin_gib:
        arena = PinnedArena(args.pin_gib << 30)
        pin = {"GiB": args.pin_gib, "register_s": arena.register_s,
               "unregister_s": arena.close()}
        print(f"cudaHostRegister of a {args.pin_gib} GiB arena: {pin['register_s']:.2f} s, "
              f"unregister {pin['unregister_s']:.2f} s")
    gen = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    for tokens in tqdm([int(x) for x in args.tokens.split(",")], desc="sizes"):
        rows += one_size(tokens, gen)
        torch.cuda.empty_cache()
    print(table(rows, ["tokens", "copy", "MiB", "kernel_GBps", "memcpy_GBps", "torch_GBps",
                       "kernel_over_memcpy"]))
    path = write_results(args.out, {"device": torch.cuda.get_device_name(), "rows": rows,
                                    "pin": pin})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
