"""kvstore beside the alternatives an engine has, on the same blocks, in one run (issue 7).

Llama-8B-shaped blocks (`tier_throughput.LAYOUT`: bf16, 32 layers x 8 KV heads x 128 dims =
128 KiB/token, 256-token blocks = 32 MiB), one prompt of `--blocks` blocks, published and then
fetched into an existing `[layers, 2, tokens, heads, dim]` tensor, through:
- kvstore host tier: a real daemon, `client.KVClient` over the same-node shared-memory path
  (`publish(tokens, kv)`, `fetch(tokens, into=out)`);
- LMCache 0.5.6 `LocalCPUBackend`, as LMCache's engine drives it (`cache_engine.store` and
  `retrieve` minus the GPU connector): keys from its `ChunkedTokenDatabase`; store = `allocate`
  a `KV_2LTD` memory object per 256-token chunk, copy the chunk in, `batched_submit_put_task`,
  drop the caller's reference (what `StorageManager.batched_put` does); retrieve =
  `batched_get_blocking`, copy each object into the destination tensor (what the GPU connector's
  `to_gpu` does), drop the reference. It runs in a subprocess under `.venv-lmcache/bin/python`
  (LMCache pulls protobuf 6, which kvstore's generated modules refuse), on the same bytes
  (the parent writes them to a file the worker reads);
- "just use Redis": a local `redis-server` on loopback (persistence off) and redis-py (8.x, its
  pure-Python parser), one key per block (chained SHA-256 of the tokens), three ways of turning
  a block into bytes and back, all measured: copy the block into a reused contiguous staging
  tensor and SET a memoryview of it, then GET, `torch.frombuffer` over the returned bytes (no
  copy) and one copy into the destination (the fastest, so the goal's row); SET of
  `block.view(uint8).numpy().tobytes()` (publish only: its GET path is the same); and
  `torch.save`/`torch.load` through a BytesIO;
- disk (unless `--no-disk`): kvstore's disk tier (host holds one prompt, so the measured prompt
  is promoted from disk; both prompts are already on disk, so no demotion is timed) beside
  LMCache's `LocalDiskBackend` (its default: one file per chunk, read by its thread pool into
  memory objects from a `LocalCPUBackend` allocator, then copied into the destination). The
  page cache of both stores' files is dropped before every timed fetch.
A memcpy row (`copy_` of the whole prompt into an existing tensor) gives the machine's limit.
Repeats are interleaved (memcpy, kvstore, LMCache, Redis, then again), so drift hits all alike;
a first, untimed round faults every path's memory in (a cache serves from warm memory).
Goals (issue 7): kvstore fetch >= 1.5x LMCache fetch, >= 3x Redis fetch.

    python -m benchmarks.alternatives [--blocks 16] [--repeats 7] [--no-lmcache] [--no-disk]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

# torch + standard library: fine in either venv
from benchmarks.common import drop_page_cache, require
from benchmarks.worker import JsonLineWorker

ROOT = Path(__file__).resolve().parents[1]
VENV_LMCACHE = ROOT / ".venv-lmcache" / "bin" / "python"
GOAL_LMCACHE = 1.5
GOAL_REDIS = 3.0
REDIS = "Redis (copy + memoryview)"
# (row, how to serialise, how to deserialise): the first is the fastest, and the goal's row.
REDIS_VARIANTS = (
    (REDIS, "memoryview", "frombuffer"),
    ("Redis (numpy().tobytes())", "tobytes", None),
    ("Redis (torch.save/load)", "torch.save", "torch.load"),
)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _tokens(prompt: int, n_tokens: int) -> list[int]:
    return [prompt * 10**6 + t for t in range(n_tokens)]


# ---- LMCache worker: `.venv-lmcache/bin/python -m benchmarks.alternatives --lmcache-worker`
# Imports torch, the standard library and LMCache only: no kvstore module (protobuf 6 there).
class _LMCacheBench:
    def __init__(self, opts: dict[str, Any]) -> None:
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.token_database import ChunkedTokenDatabase

        self.opts = opts
        L, H, D, T = (opts[k] for k in ("layers", "heads", "head_dim", "block_tokens"))
        self.n_tokens = opts["tokens"]
        self.nbytes = opts["bytes"]
        self.dtype = getattr(torch, opts["dtype"])
        self.chunk_view = (2, L, T, H, D)  # KV_2LTD [2, L, T, H*D], heads split out
        raw = torch.from_file(opts["src"], shared=False, size=self.nbytes, dtype=torch.uint8)
        self.src = raw.view(self.dtype).view(L, 2, self.n_tokens, H, D)
        self.out = torch.zeros_like(self.src)
        gib = (self.nbytes + (64 << 20)) / 2**30
        self.cfg = LMCacheEngineConfig.from_defaults(chunk_size=T, local_cpu=True,
                                                     max_local_cpu_size=gib)
        self.md = LMCacheMetadata(model_name="llama-8b-shaped", world_size=1,
                                  local_world_size=1, worker_id=0, local_worker_id=0,
                                  kv_dtype=self.dtype, kv_shape=(L, 2, T, H, D), chunk_size=T)
        self.db = ChunkedTokenDatabase(self.cfg, self.md)
        self.cpu = LocalCPUBackend(self.cfg, self.md)
        self.disk: Any = None
        self.disk_keys: list[Any] = []
        self.verified = False

    def _keys(self, prompt: int) -> list[tuple[int, int, Any]]:
        return list(self.db.process_tokens(tokens=_tokens(prompt, self.n_tokens)))

    def _store(self, backend: Any, allocator: Any, prompt: int) -> list[Any]:
        """`cache_engine.store` + `StorageManager.batched_put`, with a CPU source for the GPU."""
        from lmcache.v1.memory_management import MemoryFormat

        chunks = self._keys(prompt)
        objs = []
        for start, end, _ in chunks:
            obj = allocator.allocate(self.md.get_shapes(end - start), self.md.get_dtypes(),
                                     MemoryFormat.KV_2LTD)
            if obj is None:
                raise RuntimeError("LMCache allocator is full")
            obj.tensor.view(self.chunk_view).transpose(0, 1).copy_(self.src[:, :, start:end])
            objs.append(obj)
        keys = [k for _, _, k in chunks]
        backend.batched_submit_put_task(keys, objs)
        for obj in objs:
            obj.ref_count_down()
        return keys

    def _retrieve(self, backend: Any, prompt: int) -> None:
        """`cache_engine.retrieve`: get the objects, copy each into the destination, release."""
        chunks = self._keys(prompt)
        objs = backend.batched_get_blocking([k for _, _, k in chunks])
        for (start, end, _), obj in zip(chunks, objs, strict=True):
            if obj is None:
                raise RuntimeError(f"LMCache missed chunk [{start}, {end})")
            self.out[:, :, start:end].copy_(obj.tensor.view(self.chunk_view).transpose(0, 1))
            obj.ref_count_down()

    def _check(self) -> None:
        require(torch.equal(self.out.view(torch.int16), self.src.view(torch.int16)),
                "LMCache returned different bytes")
        self.out.zero_()
        self.verified = True

    def host(self, check: bool) -> dict[str, Any]:
        self.cpu.clear()
        t = time.perf_counter()
        self._store(self.cpu, self.cpu, 0)
        pub = time.perf_counter() - t
        t = time.perf_counter()
        self._retrieve(self.cpu, 0)
        fetch = time.perf_counter() - t
        if check:
            self._check()
        return {"publish": _gbps(self.nbytes, pub), "fetch": _gbps(self.nbytes, fetch)}

    def disk_setup(self, path: str) -> dict[str, Any]:
        import asyncio
        import threading

        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

        gib = (self.nbytes + (64 << 20)) / 2**30
        cfg = LMCacheEngineConfig.from_defaults(
            chunk_size=self.md.chunk_size, local_cpu=False, max_local_cpu_size=gib,
            local_disk=path, max_local_disk_size=2 * gib)
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
        allocator = LocalCPUBackend(cfg, self.md)  # staging memory only: hot cache off
        self.disk = LocalDiskBackend(cfg, loop, allocator, metadata=self.md)
        t = time.perf_counter()
        self.disk_keys = self._store(self.disk, allocator, 0)
        while not all(self.disk.contains(k) for k in self.disk_keys):
            time.sleep(0.001)
        return {"publish": _gbps(self.nbytes, time.perf_counter() - t)}

    def disk_fetch(self, check: bool) -> dict[str, Any]:
        for k in self.disk_keys:
            drop_page_cache(self.disk._key_to_path(k))
        t = time.perf_counter()
        self._retrieve(self.disk, 0)
        fetch = time.perf_counter() - t
        if check:
            self._check()
        return {"fetch": _gbps(self.nbytes, fetch)}


    def close(self) -> None:
        """Release every stored object (no LMCache leak warnings at exit)."""
        self.cpu.clear()
        if self.disk is not None:
            self.disk.close()


def lmcache_worker() -> None:
    """Driven by JSON lines on stdin; one `RESULT {json}` line on stdout per command."""
    opts = json.loads(sys.stdin.readline())
    import lmcache

    bench = _LMCacheBench(opts)
    print("RESULT " + json.dumps({"ready": True, "version": lmcache.__version__,
                                  "torch": torch.__version__}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            bench.close()
            break
        if cmd["op"] == "host":
            result = bench.host(cmd["check"])
        elif cmd["op"] == "disk_setup":
            result = bench.disk_setup(cmd["path"])
        else:
            result = bench.disk_fetch(cmd["check"])
        result["verified"] = bench.verified
        print("RESULT " + json.dumps(result), flush=True)


class LMCacheProcess(JsonLineWorker):
    """The `lmcache_worker` subprocess; its other output goes to `log`."""

    def __init__(self, opts: dict[str, Any], log: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
               "LMCACHE_TRACK_USAGE": "false", "LMCACHE_LOG_LEVEL": "WARNING",
               "PYTHONHASHSEED": "0"}
        super().__init__("LMCache worker", [str(VENV_LMCACHE), "-m", "benchmarks.alternatives",
                                            "--lmcache-worker"], cwd=ROOT, env=env,
                         log_path=log)
        ready = self.call(**opts)
        if not ready.get("ready"):
            raise RuntimeError(f"LMCache worker did not start; see {log}")
        self.version = ready["version"]

    def close(self, timeout: float = 30) -> None:
        super().close(timeout)


# ---- "just use Redis"
class RedisPath:
    """What an engine would write without kvstore: one Redis key per block, redis-py."""

    def __init__(self, port: int, layout: Any) -> None:
        import redis

        self.r = redis.Redis(host="127.0.0.1", port=port, socket_timeout=60)
        self.layout = layout
        self.stage = torch.empty(layout.kv_shape(layout.block_tokens), dtype=layout.torch_dtype)
        self.stage_bytes = memoryview(self.stage.view(-1).view(torch.uint8).numpy())

    def _keys(self, tokens: list[int]) -> list[bytes]:
        """Chained SHA-256 over each block's tokens, as an engine's prefix cache keys them."""
        keys, h, T = [], b"", self.layout.block_tokens
        for b in range(len(tokens) // T):
            h = hashlib.sha256(h + torch.tensor(tokens[b * T:(b + 1) * T]).numpy().tobytes()
                               ).digest()
            keys.append(b"kv:" + h)
        return keys

    def clear(self, tokens: list[int]) -> None:
        self.r.delete(*self._keys(tokens))

    def publish(self, tokens: list[int], kv: torch.Tensor, how: str = "memoryview") -> None:
        """SET each block. `memoryview` (the fastest): one copy into the staging tensor, then
        redis-py sends a view of it; `tobytes`: `.view(uint8).numpy().tobytes()` of the block
        (a copy into new bytes); `torch.save`: into a BytesIO."""
        T = self.layout.block_tokens
        for b, key in enumerate(self._keys(tokens)):
            block = kv[:, :, b * T:(b + 1) * T]
            if how == "memoryview":
                self.stage.copy_(block)
                self.r.set(key, self.stage_bytes)
            elif how == "tobytes":
                self.r.set(key, block.view(torch.uint8).numpy().tobytes())
            else:
                buf = io.BytesIO()
                torch.save(block.contiguous(), buf)
                self.r.set(key, buf.getbuffer())

    def fetch(self, tokens: list[int], out: torch.Tensor, how: str = "frombuffer") -> None:
        """GET each block into `out`: `frombuffer` (the fastest): a tensor over the returned
        bytes (no copy), copied into place; `torch.load`: from a BytesIO, then copied."""
        T = self.layout.block_tokens
        shape = self.layout.kv_shape(T)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # frombuffer over read-only bytes
            for b, key in enumerate(self._keys(tokens)):
                value = self.r.get(key)
                if value is None:
                    raise RuntimeError(f"Redis lost block {b}")
                if how == "frombuffer":
                    block = torch.frombuffer(value, dtype=self.layout.torch_dtype).view(shape)
                else:
                    block = torch.load(io.BytesIO(value))
                out[:, :, b * T:(b + 1) * T].copy_(block)

    def close(self) -> None:
        self.r.close()


# ---- the run
def run(layout: Any, blocks: int, repeats: int, data: Path, lmcache: bool, disk: bool,
        progress: Any = None) -> dict[str, Any]:
    """Measure every path; returns samples (GB/s per repeat) and what was skipped, and why."""
    from kvstore.client import KVClient
    from kvstore.server.process import DaemonProcess
    from tests.redis_servers import RedisServer

    def step(n: int = 1) -> None:
        if progress is not None:
            progress.update(n)

    n_tokens = blocks * layout.block_tokens
    nbytes = n_tokens * layout.bytes_per_token
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    src = torch.randn(layout.kv_shape(n_tokens), generator=g).to(layout.torch_dtype)
    out = torch.zeros_like(src)
    src_file = data / "src.bin"
    src.view(-1).view(torch.uint8).numpy().tofile(src_file)  # LMCache's copy of the same bytes
    prompts = [_tokens(0, n_tokens), _tokens(1, n_tokens)]
    samples: dict[str, dict[str, list[float]]] = {}

    warming = [True]  # the first host round is untimed: every path's memory is faulted in

    def record(path: str, what: str, value: float) -> None:
        if not warming[0]:
            samples.setdefault(path, {}).setdefault(what, []).append(value)

    def check(name: str) -> None:
        require(torch.equal(out.view(torch.int16), src.view(torch.int16)),
                f"{name} returned different bytes")
        out.zero_()

    out.copy_(src)  # fault every page of both in: "an existing tensor"
    out.zero_()
    step()
    # Host holds exactly one prompt (blocks are page-aligned runs; the slack is under one
    # block): the disk phase's second prompt demotes all of the first.
    daemon = DaemonProcess(data / "kvstore", "--host-bytes", str(nbytes + layout.block_bytes // 2),
                           "--disk-bytes", str(4 * nbytes), "--disk-sync", "never")
    redis_server = RedisServer(data / "redis")
    lmc: LMCacheProcess | None = None
    info: dict[str, Any] = {}
    try:
        daemon.start()
        redis_server.start()
        rp = RedisPath(redis_server.port, layout)
        if lmcache:
            lmc = LMCacheProcess({
                "layers": layout.num_layers, "heads": layout.num_kv_heads,
                "head_dim": layout.head_dim, "block_tokens": layout.block_tokens,
                "dtype": str(layout.torch_dtype).removeprefix("torch."), "tokens": n_tokens,
                "bytes": nbytes, "src": str(src_file.resolve())}, data / "lmcache.log")
            info["lmcache_version"] = lmc.version
        step()
        with KVClient(daemon.target, layout, deadline_s=60) as c:
            for r in range(-1, repeats):
                warming[0] = r < 0
                t = time.perf_counter()
                out.copy_(src)  # the limit: one copy of the same bytes into the same tensor
                record("memcpy (limit)", "fetch", _gbps(nbytes, time.perf_counter() - t))
                out.zero_()
                c.clear()
                t = time.perf_counter()
                stored = c.publish(prompts[0], src)
                require(stored == n_tokens, f"kvstore publish stored {stored} of {n_tokens} tokens")
                record("kvstore host", "publish", _gbps(nbytes, time.perf_counter() - t))
                t = time.perf_counter()
                n, _ = c.fetch(prompts[0], into=out)
                record("kvstore host", "fetch", _gbps(nbytes, time.perf_counter() - t))
                require(n == n_tokens, f"kvstore host fetch served {n} of {n_tokens} tokens")
                if r < 1:
                    check("kvstore host")
                step()
                if lmc is not None:
                    res = lmc.call(op="host", check=r < 1)
                    record("LMCache LocalCPUBackend", "publish", res["publish"])
                    record("LMCache LocalCPUBackend", "fetch", res["fetch"])
                    info["lmcache_verified"] = res["verified"]
                    step()
                for name, pub, get in REDIS_VARIANTS:
                    rp.clear(prompts[0])
                    t = time.perf_counter()
                    rp.publish(prompts[0], src, pub)
                    record(name, "publish", _gbps(nbytes, time.perf_counter() - t))
                    if get is None:
                        continue  # the same GET path as the row above: publish only
                    t = time.perf_counter()
                    rp.fetch(prompts[0], out, get)
                    record(name, "fetch", _gbps(nbytes, time.perf_counter() - t))
                    if r < 1:
                        check(name)
                step()
            warming[0] = False
            rp.clear(prompts[0])
            rp.close()
            if disk:
                # Publish the second prompt (demotes the first to disk), fetch the first back
                # (demotes the second): both are on disk now, so a timed fetch promotes one
                # and evicts the other without a write, as in tier_throughput.
                c.publish(prompts[1], src)
                c.fetch(prompts[0], into=out)
                out.zero_()
                disk_file = data / "kvstore" / "disk" / "blocks.dat"
                if lmc is not None:
                    lmc.call(op="disk_setup", path=str((data / "lmcache-disk").resolve()))
                step()
                promotions = c.stats().promotions
                for r in range(repeats):
                    which = (r + 1) % 2  # the prompt that is on disk only
                    drop_page_cache(disk_file)
                    t = time.perf_counter()
                    n, _ = c.fetch(prompts[which], into=out)
                    record("kvstore disk", "fetch", _gbps(nbytes, time.perf_counter() - t))
                    require(n == n_tokens, f"kvstore disk fetch served {n} of {n_tokens} tokens")
                    now = c.stats().promotions
                    require(now - promotions == blocks,
                            f"kvstore disk fetch promoted {now - promotions} of {blocks} blocks")
                    promotions = now
                    if r == 0:
                        check("kvstore disk")
                    step()
                    if lmc is not None:
                        res = lmc.call(op="disk_fetch", check=r == 0)
                        record("LMCache LocalDiskBackend", "fetch", res["fetch"])
                        step()
    finally:
        if lmc is not None:
            lmc.close()
        redis_server.stop()
        daemon.stop(keep_arena=False)
        src_file.unlink(missing_ok=True)
        for bulky in ("kvstore", "lmcache-disk"):  # GBs of blocks; the logs stay
            shutil.rmtree(data / bulky, ignore_errors=True)
    return {"bytes": nbytes, "samples": samples, **info}


def paired_ratios(result: dict[str, Any]) -> dict[str, float]:
    """Median over repeats of kvstore's fetch over each other path's fetch in the same repeat:
    steadier than the ratio of medians when the load on the machine drifts."""
    s = result["samples"]
    out = {}
    for path, m in s.items():
        if not path.startswith("kvstore") and "fetch" in m:
            base = s["kvstore disk" if "Disk" in path else "kvstore host"]["fetch"]
            out[path] = statistics.median(k / x for k, x in zip(base, m["fetch"], strict=True))
    return out


def summarise(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per path: median publish/fetch GB/s, and kvstore's fetch over each."""
    med = {p: {w: statistics.median(v) for w, v in s.items()}
           for p, s in result["samples"].items()}
    rows: list[dict[str, Any]] = []
    goals = {"LMCache LocalCPUBackend": GOAL_LMCACHE, REDIS: GOAL_REDIS}
    for path, m in med.items():
        base = med["kvstore disk" if "Disk" in path else "kvstore host"]["fetch"]
        ratio = base / m["fetch"] if "fetch" in m and not path.startswith("kvstore") else ""
        goal = ""
        if path in goals:
            goal = f">= {goals[path]:g}x: " + ("met" if ratio >= goals[path] else "NOT met")
        rows.append({"path": path, "publish GB/s": m.get("publish", ""),
                     "fetch GB/s": m.get("fetch", ""), "kvstore fetch / this": ratio,
                     "goal": goal})
    return rows


def _plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    from benchmarks.common import figure, save

    fig, ax = figure(7.5, 0.55 * len(rows) + 1.4)
    ys = range(len(rows))
    h = 0.38
    pub = [r["publish GB/s"] if isinstance(r["publish GB/s"], float) else 0.0 for r in rows]
    fet = [r["fetch GB/s"] if isinstance(r["fetch GB/s"], float) else 0.0 for r in rows]
    ax.barh([y - h / 2 for y in ys], pub, h, color="#7ac")
    ax.barh([y + h / 2 for y in ys], fet, h,
            color=["#999" if "limit" in r["path"] else "#27a" for r in rows])
    for y, r in zip(ys, rows, strict=True):
        note = f" {fet[y]:.2f}" if fet[y] else ""
        if isinstance(r["kvstore fetch / this"], float):
            note += f"  (kvstore {r['kvstore fetch / this']:.2f}x)"
        ax.text(fet[y], y + h / 2, note, va="center", fontsize=8)
        if pub[y]:
            ax.text(pub[y], y - h / 2, f" {pub[y]:.2f}", va="center", fontsize=8)
    ax.set_yticks(list(ys), [r["path"] for r in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, max(fet + pub) * 1.45)
    ax.set_xlabel("GB/s (median)")
    ax.set_title(title, fontsize=10)
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color="#7ac", label="publish"), Patch(color="#27a", label="fetch"),
                       Patch(color="#999", label="memcpy")], loc="lower right", fontsize=8)
    save(fig, path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=16, help="blocks per prompt (32 MiB each)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--no-lmcache", action="store_true", help="skip the LMCache rows")
    p.add_argument("--no-disk", action="store_true", help="skip the disk rows")
    p.add_argument("--data-dir", default=".data/bench-alternatives")
    p.add_argument("--lmcache-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.lmcache_worker:
        lmcache_worker()
        return

    from tqdm import tqdm

    from benchmarks.common import RESULTS, table, write_results
    from benchmarks.tier_throughput import LAYOUT
    from tests import redis_servers

    if not redis_servers.available():
        raise SystemExit(redis_servers.SKIP_REASON)
    lmcache = not args.no_lmcache
    skipped = {}
    if args.no_lmcache:
        skipped["lmcache"] = "--no-lmcache"
    elif not VENV_LMCACHE.exists():
        lmcache = False
        skipped["lmcache"] = (f"{VENV_LMCACHE.relative_to(ROOT)} not found: run "
                              "`bash scripts/setup_lmcache.sh` for the LMCache rows")
    if args.no_disk:
        skipped["disk"] = "--no-disk"
    for what, why in skipped.items():
        print(f"skipping {what}: {why}")
    per_repeat = 3 if lmcache else 2
    per_repeat_disk = 0 if args.no_disk else (2 if lmcache else 1)
    bar = tqdm(total=2 + (0 if args.no_disk else 1) + per_repeat * (args.repeats + 1)
               + per_repeat_disk * args.repeats,
               desc="alternatives", unit="step")
    try:
        result = run(LAYOUT, args.blocks, args.repeats, Path(args.data_dir), lmcache,
                     not args.no_disk, bar)
    finally:
        bar.close()
    rows = summarise(result)
    import redis

    nbytes = result["bytes"]
    print(f"\n{args.blocks} blocks x {LAYOUT.block_bytes >> 20} MiB = {nbytes >> 20} MiB per "
          f"prompt, median of {args.repeats}; fetch copies into an existing tensor; "
          f"Redis: redis-py {redis.__version__}, no hiredis; the goal's Redis row serialises by "
          "one copy into a staging tensor + a memoryview of it, deserialises by "
          "torch.frombuffer + one copy (the numpy().tobytes() row uses the same GET path)\n")
    print(table(rows, ["path", "publish GB/s", "fetch GB/s", "kvstore fetch / this", "goal"]))
    print("\nkvstore fetch / this, median of the per-repeat ratios: " + ", ".join(
        f"{k} {v:.2f}x" for k, v in paired_ratios(result).items()))
    ratios = {r["path"]: r["kvstore fetch / this"] for r in rows
              if isinstance(r["kvstore fetch / this"], float)}
    path = write_results("alternatives", {
        "bytes": nbytes, "blocks": args.blocks, "repeats": args.repeats,
        "layout": {"layers": LAYOUT.num_layers, "kv_heads": LAYOUT.num_kv_heads,
                   "head_dim": LAYOUT.head_dim, "block_tokens": LAYOUT.block_tokens,
                   "dtype": "bfloat16"},
        "redis_client": f"redis-py {redis.__version__} (pure-Python parser: no hiredis)",
        "redis_serialisation": {
            REDIS: "copy_ into a reused contiguous staging tensor, SET of a memoryview of it; "
                   "GET, torch.frombuffer over the bytes, copy_ into the destination",
            "Redis (numpy().tobytes())": "SET of block.view(uint8).numpy().tobytes(); its GET "
                                         "path is the row above's, not measured again",
            "Redis (torch.save/load)": "SET of torch.save(block) into a BytesIO; GET, "
                                       "torch.load from a BytesIO, copy_ into the destination"},
        "goals": {"kvstore fetch / LMCache fetch": GOAL_LMCACHE,
                  "kvstore fetch / Redis fetch": GOAL_REDIS},
        "ratios": ratios, "paired_ratios": paired_ratios(result), "skipped": skipped,
        "rows": rows,
        **{k: v for k, v in result.items() if k not in ("bytes",)}})
    _plot(rows, RESULTS / "alternatives.png",
          f"the same {nbytes >> 20} MiB of Llama-8B-shaped KV, same run\n"
          f"goals: kvstore fetch >= {GOAL_LMCACHE:g}x LMCache's, >= {GOAL_REDIS:g}x Redis'")
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
