"""What a warm transformers prefill's copy costs on this machine, per piece, in one process.

The K/V of a 2,048-token prompt of the demo's model (32 layers x 8 KV heads x 128 dims, fp32:
512 MiB) copied block by block out of kvstore's token-major layout `[tokens, heads, dim]` into
a cache's `[heads, tokens, dim]` tensors (`fetch_cache`'s copy), three ways:

- into fresh memory (`torch.empty`: the first touch of every page is inside the copy),
- into memory touched before (what `CachedPrefill(reserve_tokens=N)` hands out),
- the same bytes without the transpose, into memory touched before (memcpy-like).

    python -m benchmarks.copy_costs [--tokens 2048] [--repeats 5]

Each figure is the median of `--repeats` passes. Fresh memory stays fresh from pass to pass:
glibc's mmap threshold is pinned (`mallopt`), so every allocation is a new mapping instead of
pages a freed one left touched. docs/PERFORMANCE.md quotes it.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import statistics
import time

import torch

LAYERS, HEADS, DIM, BLOCK = 32, 8, 128, 256


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)  # fetch_cache copies in one worker thread
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not libc.mallopt(-3, 128 << 10):  # M_MMAP_THRESHOLD: no dynamic threshold, no reuse
        raise SystemExit("mallopt(M_MMAP_THRESHOLD) refused: fresh memory would be reused")
    blocks = args.tokens // BLOCK
    src = torch.randn(blocks, LAYERS, 2, BLOCK, HEADS, DIM)

    def fresh() -> list[torch.Tensor]:
        return [torch.empty(1, HEADS, blocks * BLOCK, DIM) for _ in range(2 * LAYERS)]

    def transpose_into(dst: list[torch.Tensor]) -> float:
        began = time.perf_counter()
        for b in range(blocks):
            span = slice(b * BLOCK, (b + 1) * BLOCK)
            for layer in range(LAYERS):
                for kv in range(2):
                    dst[2 * layer + kv][0, :, span].copy_(src[b, layer, kv].transpose(0, 1))
        return time.perf_counter() - began

    def flat_into(dst: list[torch.Tensor]) -> float:
        began = time.perf_counter()
        for b in range(blocks):
            span = slice(b * BLOCK * HEADS, (b + 1) * BLOCK * HEADS)
            for layer in range(LAYERS):
                for kv in range(2):
                    dst[2 * layer + kv].view(-1, DIM)[span].copy_(src[b, layer, kv].view(-1, DIM))
        return time.perf_counter() - began

    first = [transpose_into(fresh()) for _ in range(args.repeats)]
    touched = fresh()
    transpose_into(touched)
    again = [transpose_into(touched) for _ in range(args.repeats)]
    flat = [flat_into(touched) for _ in range(args.repeats)]
    mib = src.numel() * src.element_size() >> 20
    print(f"{mib} MiB of K/V ({args.tokens} tokens), median of {args.repeats}, one thread:")
    for name, times in (("transposing copy into fresh memory", first),
                        ("transposing copy into memory touched before", again),
                        ("plain copy into memory touched before", flat)):
        print(f"  {name:45s} {statistics.median(times) * 1e3:7.0f} ms  "
              f"({min(times) * 1e3:.0f}-{max(times) * 1e3:.0f})")


if __name__ == "__main__":
    main()
