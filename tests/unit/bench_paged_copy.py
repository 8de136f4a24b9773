"""Save (gather out of vLLM's CPU pages) and load (scatter into them), beside memcpy.

    .venv/bin/python -m tests.unit.bench_paged_copy [--repeats 9] [--tokens 2048,8192] \
        [--against OLD.c] [--torch] [--isa amx] [--dtypes bfloat16,float32,float8_e4m3fn]

A Llama-8B-shaped block set (32 layers, 8 KV heads, head_dim 128) in bf16 and float32 (or
`--dtypes`: an fp8 cache's `float8_e4m3fn`), prompts
of 2,048 and 8,192 tokens in 128-token pages (shuffled, as a request's pages are) and kvstore
blocks of 128 tokens (separate views, as `fetch_with`/`publish_with` hand them out), copied by
the C routine on as many threads as the process may use CPUs (`taskset -c 1` for one), beside
a plain copy of the same bytes (torch `copy_` between two contiguous tensors). Each is timed in
turn, `--repeats` times; medians in ms and GB/s are printed, then one JSON line.

- `--against OLD.c` also builds another version of the routine (e.g. `git show
  REV:client/integrations/vllm_cpu_copy.c > /tmp/old.c`) and times it in the same turns: the
  ratio of the two is what this machine's noise leaves comparable.
- `--torch` adds the torch fallback (`KVSTORE_NATIVE_COPY=0`).
- `--isa amx` copies caches laid out by vLLM's "amx" ISA (bf16 only) with their own routine.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvstore.client.integrations import paged
from kvstore.client.integrations.paged import PagedCache

LAYERS, HEADS, DIM, PAGE = 32, 8, 128, 128


def routines(against: Path | None, with_torch: bool, isa: str) -> dict[str, object | None]:
    """The copies to time, by name: the C routine ("C"), the one built from `against`
    ("against"), torch ("torch", None: `_native` then falls back)."""
    out: dict[str, object | None] = {}
    fn = paged.native_copy(isa)
    if fn is not None:
        out["C"] = fn
    if against is not None:
        current = paged.NATIVE_SOURCE
        paged.NATIVE_SOURCE = against.resolve()
        try:
            other = paged._build_native(paged.NATIVE_SYMBOLS[isa])
        finally:
            paged.NATIVE_SOURCE = current
        if other is None:
            raise SystemExit(f"cannot build {against}")
        out["against"] = other
    if with_torch or not out:
        out["torch"] = None
    return out


def measure(dtype: torch.dtype, tokens: int, copies: dict[str, object | None],
            repeats: int, isa: str) -> list[dict[str, object]]:
    n = tokens // PAGE
    num_pages = n + 8
    # Filled, not empty: every page touched before the timed copies.
    layers = [torch.ones(num_pages, HEADS, PAGE, 2 * DIM, dtype=dtype) for _ in range(LAYERS)]
    cache = PagedCache.vllm_cpu(layers, isa)
    slot = "_native_amx" if isa == "amx" else "_native_fn"
    blocks = torch.ones(n, LAYERS, 2, PAGE, HEADS, DIM, dtype=dtype)
    flat = torch.empty_like(blocks)
    pages = random.Random(0).sample(range(num_pages), n)
    views = [(blocks[b], 0, [pages[b]]) for b in range(n)]
    ops: dict[str, Callable[[], object]] = {
        "load": lambda: cache.scatter_views(views), "save": lambda: cache.gather_views(views)}
    times: dict[tuple[str, str], list[float]] = {}
    for turn in range(repeats):
        began = time.perf_counter()
        flat.copy_(blocks)
        times.setdefault(("memcpy", ""), []).append(time.perf_counter() - began)
        # Every other turn in reverse order: a routine run right after another one's writes
        # measured up to 1.16x slower (the same code timed against itself), so no one goes
        # first every time.
        order = list(copies.items())
        for name, fn in order if turn % 2 == 0 else reversed(order):
            # None: `native_copy()` is None (its "tried, unavailable" state), torch copies.
            setattr(paged, slot, fn if fn is not None else False)
            for op, run in ops.items():
                began = time.perf_counter()
                run()
                times.setdefault((name, op), []).append(time.perf_counter() - began)
    setattr(paged, slot, None)  # built again (from the cache) on next use
    gb = blocks.numel() * blocks.element_size() / 1e9
    med = {key: statistics.median(v) for key, v in times.items()}
    memcpy = med[("memcpy", "")]
    rows = []
    for name in copies:
        row: dict[str, object] = {"dtype": str(dtype).removeprefix("torch."), "tokens": tokens,
                                  "copy": name, "memcpy_gbps": round(gb / memcpy, 2)}
        for op in ops:
            row[f"{op}_ms"] = round(med[(name, op)] * 1e3, 1)
            row[f"{op}_gbps"] = round(gb / med[(name, op)], 2)
            row[f"{op}_per_memcpy"] = round(med[(name, op)] / memcpy, 2)
            if "against" in copies and name == "C":
                row[f"{op}_per_against"] = round(med[(name, op)] / med[("against", op)], 2)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--tokens", default="2048,8192")
    parser.add_argument("--against", type=Path, help="another version of "
                        f"{paged.NATIVE_SOURCE.name} to time in the same turns")
    parser.add_argument("--torch", action="store_true", help="also time the torch fallback")
    parser.add_argument("--dtypes", default="bfloat16,float32",
                        help="cache dtypes, comma-separated (float8_e4m3fn: an fp8 cache)")
    parser.add_argument("--isa", choices=("vec", "amx"), default="vec",
                        help="the cache layout (vLLM's CPU attention ISA)")
    args = parser.parse_args()
    copies = routines(args.against, args.torch, args.isa)
    if "C" not in copies:
        print("no C compiler (or KVSTORE_NATIVE_COPY=0): the C routine's rows are skipped")
    rows = []
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    for dtype in [torch.bfloat16] if args.isa == "amx" else dtypes:
        for tokens in map(int, args.tokens.split(",")):
            for row in measure(dtype, tokens, copies, args.repeats, args.isa):
                line = f"{row['dtype']:8} {tokens:5} {row['copy']:7}"
                for op in ("load", "save"):
                    line += (f"  {op} {row[f'{op}_ms']:6.1f} ms ({row[f'{op}_gbps']:5.2f} GB/s,"
                             f" {row[f'{op}_per_memcpy']:.2f}x memcpy")
                    if f"{op}_per_against" in row:
                        line += f", {row[f'{op}_per_against']:.2f}x against"
                    line += ")"
                print(line, flush=True)
                rows.append(row)
    print(json.dumps({"threads": paged.copy_threads(paged.caller_cpus()), "isa": args.isa,
                      "against": str(args.against) if args.against else None, "rows": rows}))


if __name__ == "__main__":
    main()
