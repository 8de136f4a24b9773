"""TTFT in vLLM: recompute vs warm from kvstore's host and disk tiers vs LMCache, one run.

    .venv-vllm/bin/python -m benchmarks.vllm_ttft [--lengths 1024,2048,4096] [--repeats 3]

Set up first: `bash scripts/setup_vllm.sh` (vLLM + kvstore) and `bash scripts/setup_lmcache.sh`
(vLLM + LMCache 0.5.6 in `.venv-lmcache`: LMCache pulls protobuf 6, which kvstore's generated
modules refuse, so the two connectors cannot share an interpreter). Without `.venv-lmcache`
the LMCache rows are skipped (`--no-lmcache` skips them on purpose).

Model: a random-weight Llama with Llama-3-8B's KV shape (32 layers x 8 KV heads x 128 dims,
bf16: 128 KiB of KV per token) and tiny compute (hidden 256, intermediate 256), saved locally
with `save_pretrained`; vLLM runs it with `skip_tokenizer_init=True` on token-id prompts
(random ids, one prompt per length, no shared prefixes). A prompt of "n tokens" is n + 1
tokens: n in whole blocks, which a connector or vLLM's prefix cache serves, plus the one
token every engine computes, so warm runs compare at the same computed tokens.

Each engine runs in a subprocess of its own venv (vLLM spawns workers: `__main__` guard):
- recompute: vLLM without a connector; then the same prompt again without a reset ("vLLM
  prefix cache": vLLM's own reuse of the n tokens in whole blocks, computing the last one:
  the floor for any connector, which loads the same n tokens);
- kvstore: `KVStoreConnector` on a daemon started here. Cold run (computes and publishes), then
  warm from the host tier; then the daemon is restarted (SIGTERM flushes the host tier to disk,
  the new daemon starts with an empty host tier) and the warm run loads from the disk tier;
- LMCache: `LMCacheMPConnector` with LMCache's MP server (`--supported-transfer-mode auto`,
  `lmcache_driven` transfer through POSIX shared memory, L1 = CPU memory).

Every engine computes on the same CPUs: vLLM's worker binds its OMP threads to all CPUs but
`--reserved-cpus` (default 1: on 2 cores, the worker computes on core 0; the scheduler process,
the kvstore daemon and LMCache's server share core 1).

TTFT is the wall time of `LLM.generate` of one prompt with `max_tokens=1`, measured in the
engine process: scheduling, the connector's lookup and load, the prefill of the tokens not
loaded, and sampling (no detokenisation: no tokenizer). Every engine runs with vLLM's own
scheduler defaults unless `--max-num-batched-tokens` is given; the settings each engine ran
with (prefix caching, chunked prefill, max batched tokens) are printed and saved with the
results. "save ms" is the connector's background save of the cold run's prompt (logged by
the connector: reserve, copy out of vLLM's pages into the daemon's memory, commit), beside
"load ms", its load of the same prompt from the host tier. "Warm" is `reset_prefix_cache()`
(retried until it returns True: a connector still saving holds blocks) and then the same
prompt again, so every reused token comes from the connector, none from vLLM's own prefix
cache. A warm run's first token is checked against the recompute run's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.worker import JsonLineWorker

ROOT = Path(__file__).resolve().parents[1]
VENV_VLLM = ROOT / ".venv-vllm" / "bin" / "python"
UNMAP_SETTLE_S = 2.0  # --wait-prefault's default --settle-s: after the primer, for the client
VENV_LMCACHE = ROOT / ".venv-lmcache" / "bin" / "python"
VOCAB = 32000
LOGGING = {
    "version": 1, "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(levelname)s %(asctime)s %(name)s: %(message)s"}},
    "handlers": {"out": {"class": "logging.StreamHandler", "formatter": "plain",
                         "stream": "ext://sys.stdout"}},
    "loggers": {name: {"handlers": ["out"], "level": "INFO", "propagate": False}
                for name in ("vllm", "kvstore")},
}


def logging_config() -> Path:
    """`LOGGING` as a file for `VLLM_LOGGING_CONFIG_PATH`: one shared file, rewritten whole
    (atomically) by each caller, rather than one per process left behind in /tmp."""
    path = Path(tempfile.gettempdir()) / "kvstore-vllm-logging.json"
    tmp = path.with_name(f"{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(LOGGING))
    os.replace(tmp, path)
    return path


LOAD_LINE = re.compile(r"kvstore: request \S+ loaded (?:group 0 )?tokens \[(\d+), (\d+)\) in "
                       r"([\d.]+) ms")
SAVE_LINE = re.compile(r"kvstore: request \S+ saved (\d+) tokens (?:\(group \d+\) )?in "
                       r"([\d.]+) ms \(copy ([\d.]+) ms, queued ([\d.]+) ms\); (\d+) prompt "
                       r"tokens cached")


# ---- engine subprocess: `python -m benchmarks.vllm_ttft --engine '{json}'`
def engine_main(opts: dict[str, Any]) -> None:
    """One vLLM engine, driven by JSON lines on stdin; one `RESULT {json}` line per command.

    Imports vLLM only (no kvstore module at import time): this runs in `.venv-lmcache` too.
    """
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    ktc = None
    if opts.get("connector"):
        ktc = KVTransferConfig(kv_connector=opts["connector"],
                               kv_connector_module_path=opts.get("module"),
                               kv_role="kv_both",
                               kv_connector_extra_config=opts.get("extra", {}))
    sched: dict[str, Any] = {k: opts[k] for k in ("max_num_batched_tokens",
                                                  "enable_chunked_prefill") if k in opts}
    if opts.get("tp", 1) > 1:
        sched.update(tensor_parallel_size=opts["tp"], distributed_executor_backend="mp")
    llm = LLM(model=opts["model"], dtype=opts.get("dtype", "bfloat16"), enforce_eager=True,
              skip_tokenizer_init=True, block_size=opts["block_size"],
              max_model_len=opts["max_model_len"], max_num_seqs=4, seed=0,
              kv_cache_dtype=opts.get("kv_cache_dtype", "auto"), kv_transfer_config=ktc,
              **sched)
    sc, cc = llm.llm_engine.vllm_config.scheduler_config, llm.llm_engine.vllm_config.cache_config
    settings = {"enable_prefix_caching": cc.enable_prefix_caching,
                "enable_chunked_prefill": sc.enable_chunked_prefill,
                "max_num_batched_tokens": sc.max_num_batched_tokens,
                "max_num_seqs": sc.max_num_seqs, "block_size": cc.block_size}
    params = SamplingParams(temperature=0.0, max_tokens=opts.get("max_tokens", 1), logprobs=5,
                            detokenize=False)
    print("RESULT " + json.dumps({"ready": True, "settings": settings}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "reset":
            start = time.perf_counter()
            ok = False
            while not ok and time.perf_counter() - start < cmd.get("timeout", 60):
                ok = bool(llm.reset_prefix_cache())
                if not ok:
                    time.sleep(0.02)
            result: dict[str, Any] = {"reset": ok, "seconds": time.perf_counter() - start}
        else:
            start = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": cmd["ids"]}], params, use_tqdm=False)[0]
            seconds = time.perf_counter() - start
            token = out.outputs[0].token_ids[0]
            logprobs = out.outputs[0].logprobs
            result = {"seconds": seconds, "cached": out.num_cached_tokens or 0,
                      "token": token,
                      "logprob": logprobs[0][token].logprob if logprobs else None}
        print("RESULT " + json.dumps(result), flush=True)
    del llm


class Engine(JsonLineWorker):
    """An `engine_main` subprocess; its other output goes to `log`."""

    def __init__(self, python: Path, opts: dict[str, Any], log: Path,
                 env: dict[str, str] | None = None) -> None:
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
                    "VLLM_CPU_KVCACHE_SPACE": str(opts.pop("kv_space_gib", 4)),
                    "VLLM_CPU_NUM_OF_RESERVED_CPU": str(opts.pop("reserved_cpus", 1)),
                    # a step of thousands of tokens on 2 busy cores can take minutes; vLLM's
                    # default (300 s) would kill the engine
                    "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "3600",
                    **(env or {})}
        super().__init__("engine", [str(python), "-m", "benchmarks.vllm_ttft", "--engine",
                                    json.dumps(opts)], cwd=ROOT, env=full_env, log_path=log)
        ready = self.read()
        if not ready.get("ready"):
            raise RuntimeError(f"engine did not start; see {log}")
        self.settings: dict[str, Any] = ready.get("settings", {})

    def generate(self, ids: list[int]) -> dict[str, Any]:
        return self.call(op="generate", ids=ids)

    def reset(self) -> float:
        r = self.call(op="reset")
        if not r["reset"]:
            raise RuntimeError("reset_prefix_cache() stayed False for 60 s")
        return float(r["seconds"])


# ---- the driver
def make_model(path: Path, layers: int, dtype: str = "bfloat16") -> Path:
    import torch

    from benchmarks.common import llama_8b_kv_shaped

    if (path / "config.json").exists():
        return path
    model = llama_8b_kv_shaped(layers, vocab=VOCAB, dtype=getattr(torch, dtype))
    model.save_pretrained(path, safe_serialization=True)
    return path


def prompt_ids(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def remove_dead_lmcache_buffers(shm: Path = Path("/dev/shm")) -> int:
    """Delete the `lmcache_kv_<pid>_<n>` files of processes that are gone; returns how many.
    LMCache 0.5.6's connector leaves one (768 MiB here) in /dev/shm per vLLM worker it ran
    in, never removed: 16 of them, 12 GiB of this VM's 24 GiB of RAM, had piled up over a
    day's runs, and the last engine started with 1.3 GiB available."""
    removed = 0
    for path in shm.glob("lmcache_kv_*_*"):
        parts = path.name.split("_")
        if len(parts) < 4 or not parts[2].isdigit():
            continue
        try:
            os.kill(int(parts[2]), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            removed += 1
        except PermissionError:  # alive, another user's
            continue
    return removed


@contextlib.contextmanager
def lmcache_server(port: int, log: Path, l1_gb: int, chunk: int):  # type: ignore[no-untyped-def]
    """LMCache's MP server (its own venv), up once it accepts connections on `port`. When it
    is done, the buffers its engines left in /dev/shm are removed
    (`remove_dead_lmcache_buffers`): the engine that ran with it has stopped by then."""
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as logf:
        proc = subprocess.Popen(
            [str(VENV_LMCACHE), "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1",
             "--port", str(port), "--l1-size-gb", str(l1_gb), "--chunk-size", str(chunk),
             "--supported-transfer-mode", "auto", "--eviction-policy", "LRU"],
            cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"LMCache server exited; see {log}")
                with contextlib.suppress(OSError), socket.create_connection(
                        ("127.0.0.1", port), timeout=1):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"LMCache server did not listen; see {log}")
                time.sleep(0.5)
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            remove_dead_lmcache_buffers()


def save_times(log: Path) -> dict[int, list[float]]:
    """kvstore connector save times (ms) in the engine log, by prompt tokens saved (only
    saves that stored the whole prompt)."""
    found: dict[int, list[float]] = {}
    for line in log.read_text().splitlines():
        if (m := SAVE_LINE.search(line)) and m.group(1) == m.group(5):
            found.setdefault(int(m.group(1)), []).append(float(m.group(2)))
    return found


def load_times(log: Path, seen: int) -> tuple[list[float], int]:
    """kvstore connector load times (ms) logged since line `seen` of the engine log."""
    lines = log.read_text().splitlines()
    found = [float(m.group(3)) for line in lines[seen:] if (m := LOAD_LINE.search(line))]
    return found, len(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1024,2048,4096",
                   help="prompt lengths in tokens (e.g. 1024,2048,4096,8192,16384)")
    p.add_argument("--repeats", type=int, default=3, help="warm runs per prompt (median)")
    p.add_argument("--recompute-repeats", type=int, default=2,
                   help="runs of the engine without a connector per prompt (median)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="model dtype; --layers 16 --dtype float32 is the compose model: the same "
                        "128 KiB of KV per token as 32 bf16 layers, prefilled ~4x faster here")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
                   default="auto", help="vLLM's KV cache dtype (fp8: one byte per element; "
                   "on the CPU it needs AVX-512, and a float32 model where the CPU has AMX)")
    p.add_argument("--block-size", type=int, default=128,
                   help="vLLM block size (a multiple of 32; CPU default 128)")
    p.add_argument("--kv-block", type=int, default=0,
                   help="kvstore block_tokens (default: the vLLM block size)")
    p.add_argument("--chunk-size", type=int, default=256, help="LMCache chunk size")
    p.add_argument("--deadline-s", type=float, default=10.0,
                   help="kvstore client deadline (a disk load of a long prompt takes seconds)")
    p.add_argument("--reserved-cpus", type=int, default=1,
                   help="CPUs vLLM keeps its OMP threads off (VLLM_CPU_NUM_OF_RESERVED_CPU), the "
                        "same for every engine: without it vLLM reserves one more CPU when a "
                        "connector is configured, which on 2 cores gives the connector engines "
                        "2 compute threads and the plain one 1")
    p.add_argument("--max-num-batched-tokens", type=int, default=0,
                   help="vLLM's max_num_batched_tokens, the same for every engine (default: "
                        "vLLM's own, 4096 for the LLM class on CPU)")
    p.add_argument("--max-tokens", type=int, default=1,
                   help="tokens generated per request (TTFT is measured with 1)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor parallel size of every engine (> 1: one core per rank, bound "
                        "with VLLM_CPU_OMP_THREADS_BIND; no LMCache rows; results in "
                        "vllm_ttft_tpN.json)")
    p.add_argument("--name", default="",
                   help="results file name (default vllm_ttft, or vllm_ttft_tpN with --tp N)")
    p.add_argument("--async-load", action="store_true",
                   help="also a kvstore engine that loads in the connector's background thread "
                        "(kvstore.async_load), on the same daemon after the synchronous one: "
                        "rows 'kvstore async host'")
    p.add_argument("--whole-load", action="store_true",
                   help="also a kvstore engine that copies each load whole before the forward "
                        "(kvstore.layerwise_load=false), on the same daemon after the default "
                        "one: rows 'kvstore whole host'")
    p.add_argument("--connector-extra", type=json.loads, default={}, metavar="JSON",
                   help="more kv_connector_extra_config for the first kvstore engine, e.g. "
                        "'{\"kvstore.layerwise_min_tokens\": 0}'")
    p.add_argument("--no-lmcache", action="store_true")
    p.add_argument("--no-disk", action="store_true")
    p.add_argument("--wait-prefault", action="store_true",
                   help="disk rows: after each restart, wait until the daemon has prefaulted "
                        "its arena (host_prefault) before the engine reconnects, and "
                        "--settle-s after the engine's primer (its client unmaps the old arena "
                        "and maps the new one in the background): a daemon restarted ahead of "
                        "its traffic")
    p.add_argument("--settle-s", type=float, default=UNMAP_SETTLE_S,
                   help="with --wait-prefault: seconds after the primer (0: the daemon's "
                        "prefault waited for, not the engine's client)")
    p.add_argument("--sync-after-stop", action="store_true",
                   help="disk rows: sync(2) after each daemon stop, before the restart: the "
                        "shutdown flush's writeback is over before the engine's loads (the "
                        "seconds each sync took are in the results)")
    p.add_argument("--data-dir", default=".data/bench-vllm-ttft")
    p.add_argument("--engine", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.engine:
        engine_main(json.loads(args.engine))
        return
    run(args)


def run(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from benchmarks.common import (
        RESULTS,
        flush_budget_s,
        table,
        wait_arena_prefaulted,
        write_results,
    )
    from kvstore.server.process import DaemonProcess

    lengths = [int(x) for x in args.lengths.split(",")]
    data = (ROOT / args.data_dir).resolve()
    shutil.rmtree(data / "kvstore", ignore_errors=True)
    data.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.dtype == "bfloat16" else f"-{args.dtype}"
    model = make_model(data / f"llama-8b-kv-{args.layers}l{suffix}", args.layers, args.dtype)
    element = 1 if args.kv_cache_dtype != "auto" else 2 if args.dtype == "bfloat16" else 4
    bytes_per_token = args.layers * 2 * 8 * 128 * element
    max_len = max(lengths) + 64
    kv_space = max(2, -(-2 * max_len * bytes_per_token // (1 << 30)))
    # n tokens in whole blocks plus one: vLLM's prefix cache then serves the same n tokens a
    # connector loads, and both compute exactly the last token (comparable outputs).
    prompts = {n: prompt_ids(n + 1, seed=n) for n in lengths}
    warmup = prompt_ids(512, seed=7)  # first-use costs of each engine, outside the figures
    primer = prompt_ids(2 * args.block_size, seed=11)  # reconnects clients after a restart
    base: dict[str, Any] = {"model": str(model), "dtype": args.dtype,
                            "kv_cache_dtype": args.kv_cache_dtype,
                            "block_size": args.block_size,
                            "max_model_len": max_len, "kv_space_gib": kv_space,
                            "reserved_cpus": args.reserved_cpus, "max_tokens": args.max_tokens}
    if args.max_num_batched_tokens:
        base["max_num_batched_tokens"] = args.max_num_batched_tokens
    settings: dict[str, dict[str, Any]] = {}
    env: dict[str, str] = {}
    if args.tp > 1:
        # vLLM's automatic binding wants a NUMA node per rank: one core each, by hand.
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < args.tp:
            raise SystemExit(f"--tp {args.tp} needs {args.tp} CPUs, this process has {len(cpus)}")
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in cpus[: args.tp])
        base["tp"] = args.tp
        args.no_lmcache = True
    lmcache = not args.no_lmcache and VENV_LMCACHE.exists()
    if not args.no_lmcache and not lmcache:
        print(f"no {VENV_LMCACHE}: LMCache rows skipped (bash scripts/setup_lmcache.sh)")
    per_prompt = args.recompute_repeats + args.repeats
    per_prompt += 1 + args.repeats + (0 if args.no_disk else args.repeats)  # kvstore
    per_prompt += args.repeats if args.async_load else 0
    per_prompt += (1 + args.repeats) if lmcache else 0
    bar = tqdm(total=len(lengths) * per_prompt, desc="vllm ttft", unit="run")
    samples: dict[tuple[int, str], list[dict[str, Any]]] = {}

    def measure(engine: Engine, run_name: str, n: int, *, reset: bool) -> dict[str, Any]:
        if reset:
            engine.reset()
        seen = len(engine.log_path.read_text().splitlines())
        r = engine.generate(prompts[n])
        r["load_ms"], _ = load_times(engine.log_path, seen)
        samples.setdefault((n, run_name), []).append(r)
        bar.set_postfix_str(f"{run_name} {n}: {r['seconds']:.3f} s")
        bar.update()
        return r

    def warm_up(engine: Engine) -> None:
        engine.generate(warmup)
        engine.reset()
        engine.generate(warmup)

    def cold_then_warm(engine: Engine, cold: str, warm: str) -> None:
        """Each prompt computed (and saved) once, then recalled `args.repeats` times."""
        warm_up(engine)
        for n in lengths:
            measure(engine, cold, n, reset=True)
            for _ in range(args.repeats):
                measure(engine, warm, n, reset=True)

    # 1. recompute: vLLM alone
    engine = Engine(VENV_VLLM, dict(base), data / "engine-recompute.log", env=env)
    settings["recompute"] = engine.settings
    try:
        warm_up(engine)
        for n in lengths:
            for _ in range(args.recompute_repeats):
                measure(engine, "recompute", n, reset=True)
            for _ in range(args.repeats):  # the floor: vLLM's own prefix cache holds it all
                measure(engine, "vLLM prefix cache", n, reset=False)
    finally:
        engine.close()

    # 2. kvstore: host tier, then disk tier after restarts
    kv_block = args.kv_block or args.block_size
    host = sum(lengths) * bytes_per_token + (512 << 20)
    # The disk rows restart the daemon: its SIGTERM flush must write the whole host tier.
    flush_s = flush_budget_s(host)
    daemon = DaemonProcess(data / "kvstore", "--host-bytes", str(host),
                           "--disk-bytes", str(2 * host), "--shutdown-flush-s", str(flush_s))
    extra = {"kvstore.target": daemon.target, "kvstore.deadline_s": args.deadline_s,
             "kvstore.block_tokens": kv_block}
    daemon.start()
    # vLLM configures logging in each of its processes from this file: the connector's load
    # times (logger "kvstore", INFO) reach the engine log with vLLM's own lines.
    logging_config = data / "logging.json"
    logging_config.write_text(json.dumps(LOGGING))

    def kvstore_engine(name: str, more: dict[str, Any]) -> Engine:
        """An engine with kvstore's connector on the daemon, its log `engine-{name}.log`."""
        engine = Engine(VENV_VLLM, {**base, "connector": "KVStoreConnector",
                                    "module": "kvstore.client.integrations.vllm",
                                    "extra": {**extra, **more}},
                        data / f"engine-{name}.log",
                        env={**env, "VLLM_LOGGING_CONFIG_PATH": str(logging_config)})
        settings[name.replace("-", " ")] = engine.settings
        return engine

    engine = kvstore_engine("kvstore", args.connector_extra)
    sync_s: list[float] = []  # `--sync-after-stop`: each restart's sync
    try:
        cold_then_warm(engine, "kvstore cold", "kvstore host")
        for flag, name, more in (
                (args.async_load, "async", {"kvstore.async_load": True}),  # in the background
                (args.whole_load, "whole", {"kvstore.layerwise_load": False})):  # before it
            if not flag:  # the same prompts in the host tier, loaded another way
                continue
            engine.close()
            engine = kvstore_engine(f"kvstore-{name}", more)
            warm_up(engine)
            for n in lengths:
                for _ in range(args.repeats):
                    measure(engine, f"kvstore {name} host", n, reset=True)
        for _ in range(0 if args.no_disk else args.repeats):
            daemon.stop(flush_s + 30)  # SIGTERM: the host tier is flushed to disk
            if args.sync_after_stop:  # the flush's writeback done before the restart
                began = time.perf_counter()
                os.sync()
                sync_s.append(time.perf_counter() - began)
            daemon.start()  # a new, empty host tier: every hit below is read from disk
            if args.wait_prefault:
                wait_arena_prefaulted(daemon.target)
            engine.reset()
            engine.generate(primer)  # the engine's clients reconnect to the new daemon
            if args.wait_prefault:
                # Ahead of traffic, as the prefault: the worker's client unmaps the old
                # daemon's arena in a background thread (0.67 s per 4 GiB here).
                time.sleep(args.settle_s)
            for n in lengths:
                measure(engine, "kvstore disk", n, reset=True)
    finally:
        engine.close()
        daemon.stop(keep_arena=False)
        shutil.rmtree(data / "kvstore", ignore_errors=True)  # gigabytes of blocks
    saves = save_times(data / "engine-kvstore.log")
    for n in lengths:  # the cold run saved the prompt (in the background, after its TTFT)
        for r in samples.get((n, "kvstore cold"), []):
            r["save_ms"] = saves.get(n, [])

    # 3. LMCache through its MP connector and server
    # A failure here (its engine OOM-killed at 32k tokens on this 24 GiB machine) must not
    # lose the rows measured above: it is reported with them instead.
    lmcache_error = ""
    if lmcache:
        try:
            port = free_port()
            # Room for every prompt with LMCache's own overheads; 3x the host tier (13 GiB at
            # 2k-16k) left its server idle and the engine waiting for it on this 24 GiB machine.
            l1_gb = max(4, -(-3 * host // (2 << 30)))
            with lmcache_server(port, data / "lmcache-server.log", l1_gb, args.chunk_size):
                extra = {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port,
                         "lmcache.mp.mp_transfer_mode": "lmcache_driven"}
                engine = Engine(VENV_LMCACHE, {**base, "connector": "LMCacheMPConnector",
                                               "extra": extra},
                                data / "engine-lmcache.log", env={"LMCACHE_TRACK_USAGE": "false"})
                try:
                    cold_then_warm(engine, "LMCache cold", "LMCache warm")
                finally:
                    engine.close()
        except RuntimeError as e:
            lmcache_error = str(e).splitlines()[0][:300]
            print(f"\nLMCache failed, its rows are missing: {lmcache_error}")
    bar.close()

    rows = summarize(samples, lengths, args.repeats)
    name = args.name or ("vllm_ttft" if args.tp == 1 else f"vllm_ttft_tp{args.tp}")
    print(f"\nvLLM {_vllm_version()} on CPU, TP={args.tp}, {args.layers}-layer Llama with "
          f"8B's KV shape ({bytes_per_token // 1024} KiB/token, {args.dtype}), vLLM block "
          f"{args.block_size}, kvstore block {kv_block}, LMCache chunk {args.chunk_size}; "
          f"TTFT = wall time of a {args.max_tokens}-token generate, median of {args.repeats} "
          f"(cold: 1 run); load average {os.getloadavg()[0]:.1f}")
    print(f"vLLM settings: {json.dumps(settings)}\n")
    columns = ["tokens", "run", "cached", "TTFT s", "load ms", "save ms", "save/load",
               "vs recompute", "vs LMCache", "compared with", "same token", "logprob diff"]
    print(table(rows, columns))
    for n in lengths:
        ratio = next((r["vs LMCache"] for r in rows
                      if r["tokens"] == n and r["run"] == "kvstore host"), None)
        if isinstance(ratio, float):
            print(f"{n} tokens: kvstore host recall = {ratio:.2f}x LMCache's (goal <= 0.4)")
    payload = {"config": {k: v for k, v in vars(args).items() if k != "engine"},
               "vllm_settings": settings, "load_average": os.getloadavg(),
               "kv_block": kv_block, "bytes_per_token": bytes_per_token,
               "lmcache_error": lmcache_error, "sync_after_stop_s": sync_s,
               "vllm": _vllm_version(), "rows": rows,
               "samples": {f"{n}/{name}": s for (n, name), s in samples.items()}}
    path = write_results(name, payload)
    plot(rows, lengths, RESULTS / f"{name}.png")
    print(f"\nresults: {path} and {RESULTS / f'{name}.png'}; engine logs in {data}")


def summarize(samples: dict[tuple[int, str], list[dict[str, Any]]], lengths: list[int],
              repeats: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    order = ["recompute", "vLLM prefix cache", "kvstore cold", "kvstore host",
             "kvstore whole host", "kvstore async host", "kvstore disk", "LMCache cold",
             "LMCache warm"]
    for n in lengths:
        base = samples.get((n, "recompute"), [])
        hit = samples.get((n, "vLLM prefix cache"), [])
        recompute = statistics.median(s["seconds"] for s in base) if base else None
        lm = samples.get((n, "LMCache warm"))
        lm_ttft = statistics.median(s["seconds"] for s in lm) if lm else None
        for name in order:
            runs = samples.get((n, name))
            if not runs:
                continue
            ttft = statistics.median(s["seconds"] for s in runs)
            # Outputs are compared at the same computed tokens: a run that loaded n tokens
            # against vLLM's own prefix-cache hit (both compute the last token over the same
            # cached KV), a run that computed everything against the recompute run. (A full
            # prefill and a one-token step over cached KV differ in the last bits in bf16.)
            warm = name.endswith((" host", " disk", " warm"))
            ref = (hit if warm else base)[:1]
            ref_name = ("vLLM prefix cache" if warm else "recompute") if ref else ""
            loads = [ms for s in runs for ms in s.get("load_ms", [])]
            saved = [ms for s in runs for ms in s.get("save_ms", [])]
            host = [ms for s in samples.get((n, "kvstore host"), [])
                    for ms in s.get("load_ms", [])]
            row: dict[str, Any] = {
                "tokens": n, "run": name, "cached": runs[-1]["cached"], "TTFT s": ttft,
                "load ms": statistics.median(loads) if loads else "",
                "save ms": statistics.median(saved) if saved else "",
                # a save beside the host-tier load of the same prompt
                "save/load": (statistics.median(saved) / statistics.median(host)
                              if saved and host else ""),
                "vs recompute": recompute / ttft if recompute else "",
                "vs LMCache": (ttft / lm_ttft if lm_ttft and name.startswith("kvstore ")
                               and name != "kvstore cold" else ""),
                "compared with": ref_name,
                "same token": (all(s["token"] == ref[0]["token"] for s in runs)
                               if ref else ""),
                "logprob diff": (max(abs(s["logprob"] - ref[0]["logprob"]) for s in runs)
                                 if ref and ref[0].get("logprob") is not None
                                 and all(s.get("logprob") is not None for s in runs)
                                 else ""),
                "runs": [s["seconds"] for s in runs]}
            rows.append(row)
    return rows


def plot(rows: list[dict[str, Any]], lengths: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [("recompute", "#999999"), ("vLLM prefix cache", "#cccccc"),
            ("kvstore host", "#22aa77"), ("kvstore whole host", "#55bb99"),
            ("kvstore async host", "#88cc44"),
            ("kvstore disk", "#2277aa"), ("LMCache warm", "#aa5522")]
    present = [(r, c) for r, c in runs if any(row["run"] == r for row in rows)]
    width = 0.8 / max(1, len(present))
    fig, ax = plt.subplots(figsize=(7.5, 4))
    for i, (run_name, color) in enumerate(present):
        xs, ys = [], []
        for j, n in enumerate(lengths):
            row = next((r for r in rows if r["tokens"] == n and r["run"] == run_name), None)
            if row:
                xs.append(j + (i - (len(present) - 1) / 2) * width)
                ys.append(row["TTFT s"])
        bars = ax.bar(xs, ys, width, label=run_name, color=color)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (s), log scale")
    ax.set_yscale("log")
    ax.set_title("vLLM 0.32 CPU TTFT: recompute vs kvstore tiers vs LMCache 0.5.6")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _vllm_version() -> str:
    try:
        import importlib.metadata as m

        return m.version("vllm-cpu")
    except Exception:  # a label only
        return "?"


if __name__ == "__main__":
    main()
