"""Ways a disk read can fill host-arena pages, and what a client's first copy out of a new
mapping costs: the pieces of a disk load right after a daemon restart (docs/PERFORMANCE.md,
"Disk reads through the arena's file: tried, not kept").

    python -m benchmarks.arena_fill --gib 1 --trials 3

A file of `--gib` random bytes is read (from the page cache, as after a restart's flush) into
a fresh arena, in pieces of the disk tier's `READ_PIECE`, each hashed (xxh3-128) as the tier
verifies it, three ways:
- `mapping, fresh`: `Arena.populate` then `preadv` into the mapping (the daemon today, ahead
  of its prefault: `HostTier.back`);
- `mapping, backed`: `preadv` into a mapping whose pages were backed before (the prefault
  done); the backing itself is not timed;
- `file, fresh`: `preadv` into a buffer of the thread's, then `pwrite` through the arena's
  file: whole pages written so are never zeroed and no page table of the writer is filled.
Each with 1, 2 and 4 threads (the daemon's `io_threads` is 4), pieces dealt round robin. Then
a client's copy of the whole arena into a tensor through a mapping of its own, fresh (its page
faults inside the copy) and after `MADV_POPULATE_READ` (timed apart). Seconds per GiB, median
of the trials.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import xxhash

from benchmarks.common import barh, table, write_results
from kvstore.arena import Arena
from kvstore.tiers.disk_index import READ_PIECE

_MADV_POPULATE_READ = 22
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _fill(arena: Arena, src: int, size: int, threads: int, way: str) -> float:
    """Seconds to read `size` bytes of `src` into `arena` `way`, with `threads` threads."""
    fd = os.open(arena.path, os.O_RDWR)  # a writer's descriptor, as the daemon's `_lock_fd`
    view = memoryview(arena.array.data)

    def work(k: int) -> None:
        buf = memoryview(bytearray(READ_PIECE))
        for i, off in enumerate(range(0, size, READ_PIECE)):
            if i % threads != k:
                continue
            n = min(READ_PIECE, size - off)
            if way == "file, fresh":
                piece = buf[:n]
                os.preadv(src, [piece], off)
                xxhash.xxh3_128(piece).digest()
                os.pwrite(fd, piece, off)
            else:
                if way == "mapping, fresh":
                    arena.populate(off, n)
                piece = view[off : off + n]
                os.preadv(src, [piece], off)
                xxhash.xxh3_128(piece).digest()

    workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    began = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    took = time.perf_counter() - began
    os.close(fd)
    return took


def _client_copy(arena: Arena, populate: bool) -> tuple[float, float]:
    """(populate s, copy s) of a copy of the whole arena through a new mapping of it."""
    fd = os.open(arena.path, os.O_RDONLY)
    mapping = mmap.mmap(fd, arena.size, mmap.MAP_SHARED, mmap.PROT_READ)
    os.close(fd)
    array = np.frombuffer(mapping, dtype=np.uint8)
    out = torch.ones(arena.size, dtype=torch.uint8)
    began = time.perf_counter()
    if populate:
        _libc.madvise(array.ctypes.data, arena.size, _MADV_POPULATE_READ)
    populated = time.perf_counter() - began
    began = time.perf_counter()
    out.numpy()[:] = array
    copied = time.perf_counter() - began
    del array
    mapping.close()
    return populated, copied


def _trial(directory: str, size: int, fn: Callable[[Arena], float]) -> float:
    arena = Arena.create(directory, size)
    try:
        return fn(arena)
    finally:
        arena.unlink()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--name", default="arena_fill")
    args = p.parse_args()
    size = int(args.gib * (1 << 30)) // READ_PIECE * READ_PIECE
    gib = size / (1 << 30)
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm, \
            tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as disk:
        path = Path(disk) / "record.dat"
        rng = np.random.default_rng(0)
        with open(path, "wb") as f:
            for _ in range(size // READ_PIECE):
                f.write(rng.integers(0, 256, READ_PIECE, dtype=np.uint8).tobytes())
        src = os.open(path, os.O_RDONLY)
        for off in range(0, size, READ_PIECE):  # in the page cache, as after a flush
            os.pread(src, READ_PIECE, off)

        def backed_fill(threads: int) -> Callable[[Arena], float]:
            def fn(arena: Arena) -> float:
                arena.populate(0, size)
                return _fill(arena, src, size, threads, "mapping, backed")
            return fn

        for way in ("mapping, fresh", "mapping, backed", "file, fresh"):
            for threads in (1, 2, 4):
                fill = (backed_fill(threads) if way == "mapping, backed" else
                        lambda a, t=threads, w=way: _fill(a, src, size, t, w))
                s = [_trial(shm, size, fill) for _ in range(args.trials)]
                rows.append({"step": f"daemon read: {way}", "threads": threads,
                             "s_per_gib": statistics.median(s) / gib, "samples_s": s})
                print(f"{way}, {threads} thread(s): {statistics.median(s) / gib:.3f} s/GiB")
        for populate in (False, True):
            def client(arena: Arena, populate: bool = populate) -> float:
                _fill(arena, src, size, 1, "mapping, fresh")
                populated, copied = _client_copy(arena, populate)
                return populated + copied
            s = [_trial(shm, size, client) for _ in range(args.trials)]
            name = "client copy, populated first (both timed)" if populate else \
                "client copy, fresh mapping"
            rows.append({"step": name, "threads": torch.get_num_threads(),
                         "s_per_gib": statistics.median(s) / gib, "samples_s": s})
        os.close(src)
    print(table(rows, ["step", "threads", "s_per_gib"]))
    path = write_results(args.name, {"gib": gib, "piece": READ_PIECE, "rows": rows})
    barh(path.with_suffix(".png"), [f"{r['step']} ({r['threads']})" for r in rows],
         [float(r["s_per_gib"]) for r in rows],  # type: ignore[arg-type]
         [f"{r['s_per_gib']:.3f}" for r in rows],
         ["#c84" if "file" in str(r["step"]) else "#27a" for r in rows],
         "seconds per GiB (median)", f"filling host-arena pages ({os.cpu_count()} CPUs)",
         width=8.5)


if __name__ == "__main__":
    main()
