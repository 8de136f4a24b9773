"""How fast a fresh host arena is backed (its pages zeroed by the kernel), alone and while
another process frees an arena of the same size: what a restarted daemon's prefault meets when
an engine's client unmaps the old daemon's arena at the same time (docs/PERFORMANCE.md, "Disk
fetch right after a restart").

    python -m benchmarks.arena_zeroing --gib 1.5 --trials 5

Each trial backs a fresh arena alone (`Arena.populate`, MADV_POPULATE_WRITE), then backs
another while a second process drops its populated arena (unlinked, then unmapped, as a client
lets go of a restarted daemon's arena). Prints GB/s per trial; the ratio of the two is the
figure (the machine's own rate cancels).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import time
from typing import Any

from benchmarks.common import table, write_results
from kvstore.arena import Arena


def _back_fresh(size: int) -> float:
    """Seconds to back a fresh arena of `size` bytes."""
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        arena = Arena.create(d, size)
        began = time.perf_counter()
        arena.populate(0, size)
        took = time.perf_counter() - began
        arena.unlink()
    return took


def _hold_then_free(size: int, ready: Any, go: Any) -> None:
    """A populated arena, unlinked and unmapped once `go` is set (the process then exits)."""
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        arena = Arena.create(d, size)
        arena.populate(0, size)
        ready.set()
        go.wait()
        arena.unlink()
        del arena  # the last mapping goes: every page is freed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.5, help="arena size")
    p.add_argument("--trials", type=int, default=5)
    args = p.parse_args()
    size = int(args.gib * (1 << 30))
    ctx = mp.get_context("spawn")
    rows = []
    for trial in range(args.trials):
        alone = size / _back_fresh(size) / 1e9
        ready, go = ctx.Event(), ctx.Event()
        other = ctx.Process(target=_hold_then_free, args=(size, ready, go))
        other.start()
        ready.wait()
        go.set()
        beside = size / _back_fresh(size) / 1e9
        other.join()
        rows.append({"trial": trial + 1, "alone_GBps": alone, "beside_a_free_GBps": beside})
        print(table(rows[-1:], list(rows[-1])), flush=True)
    print(table(rows, list(rows[0])))
    summary = {"alone_median_GBps": statistics.median(r["alone_GBps"] for r in rows),
               "beside_median_GBps": statistics.median(r["beside_a_free_GBps"] for r in rows),
               "beside_min_GBps": min(r["beside_a_free_GBps"] for r in rows)}
    print(summary)
    print(write_results("arena_zeroing", {"gib": args.gib, "rows": rows, **summary}))


if __name__ == "__main__":
    main()
