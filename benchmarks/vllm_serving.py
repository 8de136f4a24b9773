"""Serving under concurrency: several users, several rounds each, over a shared system prompt,
through vLLM's OpenAI server as docker-compose.yml runs it, with kvstore and without, in one run.

    .venv-vllm/bin/python -m benchmarks.vllm_serving [--users 6] [--rounds 4] [--system 1024] \
        [--history 4096 --question 64] [--repeats 3]

As LMCache's multi-round QA benchmark: every user's prompt in round r is the system prompt, the
user's own document (`--history` tokens; none by default), the user's earlier questions and
answers, and a new question; each user sends its next question
when its previous answer is complete, users start `--stagger-s` apart, so their requests
overlap in the engine (one batch, vLLM's scheduler). Every answer is `--answer` tokens
(greedy, `ignore_eos`). What joins the history is a fixed reply of that length drawn with the
questions (as LMCache's benchmark and `benchmarks.multi_round_qa` do), so every configuration
serves exactly the same prompts; the answers themselves are compared between configurations.

The engine is docker-compose.yml's (`tests/vllm/compose.py` starts its services natively with
their flags: the 16-layer float32 Llama-3-8B-KV-shaped model, 128-token blocks), with its KV
cache cut to `--cache-blocks` blocks (vLLM's `--num-gpu-blocks-override`) and a
`--max-model-len` that fits it: a small engine cache, so the users' histories do not all fit
in vLLM's own prefix cache, as on a GPU serving more users than its HBM holds.
Configurations, one engine each, the same workload:
- `vllm`: vLLM alone (its own prefix cache on, as by default);
- `kvstore`: the compose stack as shipped: vLLM with kvstore's connector and daemon (host tier
  4 GiB, disk 32 GiB);
- `lmcache`: vLLM with LMCache 0.5.6's `LMCacheMPConnector` and its MP server (L1 CPU memory
  `--lmcache-gib`, 4 GiB as kvstore's host tier; chunks of 256 tokens), as
  `benchmarks.vllm_ttft` runs it, from `.venv-lmcache` (`bash scripts/setup_lmcache.sh`;
  skipped with a note when that venv is missing);
- `kvstore-async` (not by default): the compose stack with `kvstore.async_load` added to its
  connector config (loads in the connector's background thread while the engine runs the
  other requests);
- `vllm-rerun` (not by default): vLLM alone again, to see how far two runs of the same engine
  agree: with requests batched differently, vLLM's own outputs differ between runs.
- `kvstore-nice0` (not by default): the compose stack with `KVSTORE_SAVE_NICE=0`, the saves'
  copies at the engine's own CPU priority (as before 2026-11-29), beside `kvstore`.
- `vllm-lmvenv` (not by default): vLLM alone from `.venv-lmcache`'s interpreter (the same
  vLLM and torch versions): whether the engine of the `lmcache` configuration computes
  differently from `vllm`'s apart from LMCache.
- `kvstore-noprefault` (not by default): the compose stack with the client's background
  touch of the daemon's arena off (`KVCLIENT_PREFAULT_BYTES=0`).
- `kvstore-nosave` (not by default): the compose stack's connector as a `kv_consumer`: it
  looks up and loads but never saves (so it never hits either): what the connector costs an
  engine apart from its saves.

With `--repeats N` every configuration runs N times, in turn, the order reversed every other
pass (`--rotate`: rotated by one every pass, so each configuration takes every position), and
a request's TTFT is the median of its N runs: on this VM one request's TTFT moved by +-20%
between two runs of the same engine (docs/PERFORMANCE.md, 2026-11-29), more than the
differences the per-request comparison looks for.

TTFT is the time from sending a request to its first streamed token, measured by the client;
throughput is output tokens over the run's wall time. The CPU columns are the seconds the
engine's processes ran during the requests (`benchmarks.thread_cpu`; with `--repeats`, each
the median over the runs): "worker compute", the vLLM worker's main thread, which runs the
forward pass on its own core; "worker other", the worker's other threads (a connector's saves
and loads); "all", every process the benchmark started (the API server, the engine core, the
worker, the store's daemon or server). Per request the kvstore TTFT is compared
with vLLM alone's TTFT of the same request (the same user and round; their neighbours in the
batch may differ). Results: benchmarks/results/vllm_serving.json and .png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from benchmarks.common import RESULTS, figure, save, table, write_results
from benchmarks.thread_cpu import cpu_by_role
from benchmarks.vllm_ttft import LOGGING, free_port, lmcache_server
from tests.vllm.compose import MODEL_NAME, Native, remove_volumes, stack

CONFIGS = ("vllm", "kvstore", "lmcache")
# The arguments that make two results files one workload (--pool).
WORKLOAD = ("users", "rounds", "system", "history", "question", "answer", "cache_blocks",
            "stagger_s")
VENV_LMCACHE = Path(__file__).resolve().parents[1] / ".venv-lmcache" / "bin" / "python"
CPU = "cpu: "  # the counters that are CPU seconds of the run (`thread_cpu.cpu_by_role`)


def changed_transfer_config(native: Native, role: str | None = None,
                            **extra: Any) -> str:
    """The compose file's `--kv-transfer-config` with `kv_role` and connector options changed
    (given after it, it replaces it)."""
    flag = "--kv-transfer-config="
    arg = next(a for a in native.command("vllm") if a.startswith(flag))
    cfg = json.loads(arg[len(flag):])
    cfg["kv_connector_extra_config"].update(extra)
    if role is not None:
        cfg["kv_role"] = role
    return flag + json.dumps(cfg)


def workload(users: int, rounds: int, system: int, question: int, answer: int,
             history: int = 0, seed: int = 0,
             ) -> tuple[list[int], list[list[int]], list[list[list[int]]]]:
    """The shared system prompt, each user's own document (`history` tokens, after the system
    prompt from the first round on), and each user's turns per round: a question, then the
    reply that joins the history (token ids)."""
    rng = random.Random(seed)
    sys_prompt = [rng.randrange(3, 32000) for _ in range(system)]
    turns = [[[rng.randrange(3, 32000) for _ in range(question + answer)]
              for _ in range(rounds)] for _ in range(users)]
    # Drawn last, so that a workload without documents is the one of earlier results files.
    docs = [[rng.randrange(3, 32000) for _ in range(history)] for _ in range(users)]
    return sys_prompt, docs, turns


def stream_completion(url: str, model: str, ids: list[int], max_tokens: int,
                      timeout: float) -> tuple[float, float, list[int], list[float]]:
    """(TTFT s, total s, output token ids, their log-probabilities) of one streamed greedy
    completion."""
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True, "logprobs": 1,
            "return_tokens_as_token_ids": True}  # the compose engine runs without a tokenizer
    req = urllib.request.Request(  # noqa: S310 - `url` is the loopback http:// of Native
        url + "/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"}, method="POST")
    began = time.perf_counter()
    first = 0.0
    tokens: list[int] = []
    logprobs: list[float] = []
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - as above
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:  # the server reports a failed stream in it, status 200
                raise RuntimeError(f"completion stream failed: {event['error']}")
            for choice in event.get("choices", []):
                got = choice.get("token_ids") or []
                if got and not first:
                    first = time.perf_counter() - began
                tokens += got
                logprobs += (choice.get("logprobs") or {}).get("token_logprobs") or []
    return first, time.perf_counter() - began, tokens, logprobs


def metric(url: str, name: str) -> float:
    """The sum of a Prometheus counter's samples on vLLM's /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:  # noqa: S310
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def run_users(native: Native, sys_prompt: list[int], docs: list[list[int]],
              turns: list[list[list[int]]], question: int, answer: int, stagger_s: float,
              bar: tqdm) -> tuple[list[dict[str, Any]], float]:
    """Every user's rounds, users concurrent; the requests' records and the run's wall time."""
    model = native.path(f"/models/{MODEL_NAME}")
    records: list[dict[str, Any]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def user(u: int) -> None:
        try:
            time.sleep(u * stagger_s)
            history = sys_prompt + docs[u]
            for r, turn in enumerate(turns[u]):
                prompt = history + turn[:question]
                ttft, total, out, lp = stream_completion(native.url, model, prompt, answer,
                                                         3600)
                with lock:
                    records.append({"user": u, "round": r, "prompt_tokens": len(prompt),
                                    "ttft_s": ttft, "total_s": total, "output": out,
                                    "logprobs": lp})
                    bar.update()
                history = prompt + turn[question:]
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    began = time.perf_counter()
    threads = [threading.Thread(target=user, args=(u,)) for u in range(len(turns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return sorted(records, key=lambda x: (x["user"], x["round"])), time.perf_counter() - began


def summary(config: str, records: list[dict[str, Any]], wall_s: float,
            counters: dict[str, float]) -> dict[str, Any]:
    ttft = np.array([r["ttft_s"] for r in records])
    out_tokens = sum(len(r["output"]) for r in records)
    queries = counters.get("vllm:prefix_cache_queries_total", 0.0)
    local = counters.get("vllm:prefix_cache_hits_total", 0.0)
    external = counters.get("vllm:external_prefix_cache_hits_total", 0.0)
    return {"config": config, "requests": len(records),
            "TTFT p50 s": float(np.percentile(ttft, 50)),
            "TTFT p99 s": float(np.percentile(ttft, 99)), "TTFT mean s": float(ttft.mean()),
            "output tok/s": out_tokens / wall_s, "wall s": wall_s,
            "vLLM cache hit": local / queries if queries else 0.0,
            "connector hit": external / queries if queries else 0.0,
            **cpu_columns(counters)}


def cpu_columns(counters: dict[str, float]) -> dict[str, float]:
    """The CPU counters of a run, named as the tables show them."""
    return {"CPU " + name[len(CPU):]: v for name, v in counters.items() if name.startswith(CPU)}


def plot(rows: list[dict[str, Any]], per_request: dict[str, list[dict[str, Any]]],
         path: Path) -> None:
    """TTFT p50 / p99 / mean per configuration, and the mean TTFT of each round (where the
    stores' loads are: the first round is a miss in every configuration)."""
    fig, _ = figure(10.0, 3.4)
    fig.clf()  # two panels, the left one wider
    ax, by_round = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    names = [r["config"] for r in rows]
    x = np.arange(len(names))
    keys = (("TTFT p50 s", "#4c72b0"), ("TTFT p99 s", "#dd8452"), ("TTFT mean s", "#55a868"))
    for i, (key, color) in enumerate(keys):
        ax.bar(x + (i - 1) * 0.27, [r[key] for r in rows], 0.27, label=key, color=color)
    ax.set_xticks(x, [f"{n}\n{r['output tok/s']:.1f} out tok/s" for n, r in zip(names, rows,
                                                                                strict=True)])
    ax.set_ylabel("seconds")
    ax.set_title("TTFT under concurrency (multi-round QA)")
    ax.set_ylim(0, 1.2 * max(r[k] for r in rows for k, _ in keys))  # room for the legend
    ax.legend(loc="upper center", ncol=3, fontsize="small")
    for config, records in per_request.items():
        rounds = sorted({r["round"] for r in records})
        means = [np.mean([r["ttft_s"] for r in records if r["round"] == k]) for k in rounds]
        by_round.plot(rounds, means, marker="o", label=config)
    by_round.set_xlabel("round")
    by_round.set_ylabel("mean TTFT, s")
    by_round.set_title("per round")
    by_round.legend(fontsize="small")
    save(fig, path)


def run_config(config: str, args: argparse.Namespace, models: Path, max_len: int,
               sys_prompt: list[int], docs: list[list[int]], turns: list[list[list[int]]],
               ) -> tuple[list[dict[str, Any]], float, dict[str, float]]:
    """One engine of `config`, the whole workload: its requests' records, the wall time and
    vLLM's prefix-cache counters."""
    native = Native(Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp")))  # short paths
    (native.root / "models").symlink_to(models)
    # vLLM's log gets the connector's per-request lines too (loads, saves and their times).
    logging_config = native.root / "logging.json"
    logging_config.write_text(json.dumps(LOGGING))
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib), "LMCACHE_TRACK_USAGE": "false",
           "VLLM_LOGGING_CONFIG_PATH": str(logging_config)}
    vllm_args = [f"--max-model-len={max_len}", f"--num-gpu-blocks-override={args.cache_blocks}"]
    with contextlib.ExitStack() as running:  # vllm-rerun: vLLM alone, a second time
        running.callback(remove_volumes, native)  # keeps the logs
        if config == "lmcache":
            port = free_port()
            running.enter_context(lmcache_server(port, native.root / "lmcache.log",
                                                 args.lmcache_gib, 256))
            vllm_args.append("--kv-transfer-config=" + json.dumps({
                "kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port,
                    "lmcache.mp.mp_transfer_mode": "lmcache_driven"}}))
        if config == "kvstore-async":  # the compose connector config, loads asynchronous
            vllm_args.append(changed_transfer_config(native, **{"kvstore.async_load": True}))
        if config == "kvstore-nosave":  # a consumer: looks up and loads, never saves
            vllm_args.append(changed_transfer_config(native, role="kv_consumer"))
        if config == "kvstore-nice0":  # saves at the engine's priority
            env["KVSTORE_SAVE_NICE"] = "0"
        if config == "kvstore-noprefault":  # no background touch of the arena
            env["KVCLIENT_PREFAULT_BYTES"] = "0"
        running.enter_context(stack(
            native, remote=False, vllm_env=env, connector=config.startswith("kvstore"),
            vllm_args=tuple(vllm_args),
            vllm_python=str(VENV_LMCACHE) if config in ("lmcache", "vllm-lmvenv") else None))
        cpu_before = cpu_by_role()
        with tqdm(total=args.users * args.rounds, desc=config, unit="req") as bar:
            records, wall = run_users(native, sys_prompt, docs, turns, args.question,
                                      args.answer, args.stagger_s, bar)
        cpu_after = cpu_by_role()
        counters = {name: metric(native.url, name) for name in (
            "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
            "vllm:external_prefix_cache_hits_total")}
        counters.update({f"{CPU}{role} s": cpu_after[role] - cpu_before[role]
                         for role in cpu_after})
    return records, wall, counters


def merge(runs: list[tuple[list[dict[str, Any]], float, dict[str, float]]],
          ) -> tuple[list[dict[str, Any]], float, dict[str, float]]:
    """Several runs of one configuration as one: each request's TTFT the median of its runs
    (`ttft_runs` lists them; output and log-probabilities are the first run's), the median
    wall time, vLLM's counters summed, and each CPU figure the median over the runs."""
    records = []
    for same in zip(*(r[0] for r in runs), strict=True):
        times = [r["ttft_s"] for r in same]
        records.append({**same[0], "ttft_s": float(np.median(times)), "ttft_runs": times})
    counters: dict[str, float] = {}
    for _, _, c in runs:
        for name, value in c.items():
            counters[name] = counters.get(name, 0.0) + value
    for name in counters:
        if name.startswith(CPU):
            counters[name] = float(np.median([c.get(name, 0.0) for _, _, c in runs]))
    return records, float(np.median([r[1] for r in runs])), counters


def pooled_runs(names: list[str]) -> dict[str, list[list[float]]]:
    """Every run's TTFT of every request, per configuration, over several results files of
    one workload (`[config][request] -> seconds of each run]`)."""
    runs: dict[str, list[list[float]]] = {}
    first: dict[str, Any] | None = None
    for name in names:
        results = json.loads((RESULTS / f"{name}.json").read_text())
        shape = {k: results["args"].get(k, 0 if k == "history" else None) for k in WORKLOAD}
        if first is not None and shape != first:
            raise SystemExit(f"{name}: workload {shape}, not {names[0]}'s {first}")
        first = shape
        requests = results["requests"]
        for config, records in requests.items():
            per = runs.setdefault(config, [[] for _ in records])
            if len(per) != len(records):
                raise SystemExit(f"{name}: {config} has {len(records)} requests, not "
                                 f"{len(per)}: not the same workload")
            for mine, record in zip(per, records, strict=True):
                mine.extend(record.get("ttft_runs", [record["ttft_s"]]))
    return runs


def _stats(ttft: np.ndarray) -> dict[str, float]:
    return {"p50": float(np.percentile(ttft, 50)), "p99": float(np.percentile(ttft, 99)),
            "mean": float(ttft.mean())}


def pooled(names: list[str]) -> list[dict[str, Any]]:
    """TTFT percentiles over several results files of one workload: each request's TTFT the
    median of its runs in all of them (a single run of the VM is noisier than the stores'
    differences). With a `vllm` configuration, each request's pooled TTFT over vLLM alone's
    (the worst such ratio is "no request slower than recomputation")."""
    runs = pooled_runs(names)
    medians = {config: np.array([np.median(r) for r in per]) for config, per in runs.items()}
    rows = []
    for config, per in runs.items():
        got = _stats(medians[config])
        row: dict[str, Any] = {"config": config, "runs per request": min(len(r) for r in per),
                               "TTFT p50 s": got["p50"], "TTFT p99 s": got["p99"],
                               "TTFT mean s": got["mean"]}
        if "vllm" in medians and config != "vllm":
            row["worst TTFT / vLLM alone's"] = float((medians[config] / medians["vllm"]).max())
        rows.append(row)
    return rows


def bootstrap_ratio(runs: dict[str, list[list[float]]], a: str, b: str,
                    samples: int = 2000, seed: int = 0) -> list[dict[str, Any]]:
    """How sure the pooled comparison of `a` against `b` is: each request's runs resampled
    with replacement (per configuration, independently), the statistics of the requests'
    medians recomputed, and the ratio a / b's 2.5th, 50th and 97.5th percentiles over
    `samples` resamplings (a 95% interval: an interval that holds 1 is parity)."""
    rng = np.random.default_rng(seed)
    ratios: dict[str, list[float]] = {"p50": [], "p99": [], "mean": []}
    for _ in range(samples):
        got = [_stats(np.array([np.median(rng.choice(r, len(r))) for r in runs[c]]))
               for c in (a, b)]
        for stat, values in ratios.items():
            values.append(got[0][stat] / got[1][stat])
    return [{"statistic": f"TTFT {stat}", "ratio": f"{a} / {b}",
             "2.5%": float(np.percentile(v, 2.5)), "median": float(np.median(v)),
             "97.5%": float(np.percentile(v, 97.5))} for stat, v in ratios.items()]


def run_all(configs: list[str], args: argparse.Namespace, models: Path, max_len: int,
            sys_prompt: list[int], docs: list[list[int]], turns: list[list[list[int]]],
            ) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]],
                       list[dict[str, Any]]]:
    """Every configuration `args.repeats` times: a summary row each, their requests, and each
    engine's CPU seconds in the order they ran (a pass's engines ran minutes apart: compare
    those within a pass)."""
    runs: dict[str, list[tuple[list[dict[str, Any]], float, dict[str, float]]]] = {}
    cpu_runs: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        # Every other pass in reverse: the VM's speed drifts within minutes, and no
        # configuration should always run first (the first engine of a run was the slowest).
        if args.rotate:
            order = configs[rep % len(configs):] + configs[:rep % len(configs)]
        else:
            order = configs if rep % 2 == 0 else configs[::-1]
        for config in order:
            run = run_config(config, args, models, max_len, sys_prompt, docs, turns)
            runs.setdefault(config, []).append(run)
            cpu_runs.append({"pass": rep, "config": config, **cpu_columns(run[2])})
    rows, per_request = [], {}
    for config in configs:
        records, wall, counters = merge(runs[config])
        rows.append(summary(config, records, wall, counters))
        per_request[config] = records
    return rows, per_request, cpu_runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    # Defaults: 13,504 distinct prompt tokens, over twice the 6,144 of vLLM's cache.
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--system", type=int, default=1024, help="shared system prompt, tokens")
    p.add_argument("--history", type=int, default=0,
                   help="each user's own document, tokens, after the system prompt from the "
                        "first round on (LMCache's multi-round QA: --user-history-prompt)")
    p.add_argument("--question", type=int, default=1024, help="tokens per question")
    p.add_argument("--answer", type=int, default=16, help="tokens per answer")
    p.add_argument("--cache-blocks", type=int, default=48,
                   help="vLLM's own KV cache, in 128-token blocks (--num-gpu-blocks-override)")
    p.add_argument("--stagger-s", type=float, default=1.0, help="between users' starts")
    p.add_argument("--kv-cache-gib", type=int, default=1,
                   help="VLLM_CPU_KVCACHE_SPACE: the memory vLLM sizes its cache within")
    p.add_argument("--lmcache-gib", type=int, default=4, help="LMCache's L1 (CPU) size")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of every configuration, in turn, the order reversed every other "
                        "pass; a request's TTFT is then the median of its runs")
    p.add_argument("--rotate", action="store_true",
                   help="with --repeats: rotate the order by one every pass instead of "
                        "reversing it, so that each configuration takes every position (with "
                        "three, reversing keeps the second one in the middle of every pass)")
    p.add_argument("--name", default="vllm_serving", help="results file name (.json, .png)")
    p.add_argument("--pool", metavar="NAMES",
                   help="run nothing: pool earlier results files (comma-separated names of "
                        "the same workload), each request's TTFT the median of all its runs")
    args = p.parse_args()
    if args.pool:
        names = args.pool.split(",")
        print(table(pooled(names), ["config", "runs per request", "TTFT p50 s", "TTFT p99 s",
                                    "TTFT mean s", "worst TTFT / vLLM alone's"]))
        runs = pooled_runs(names)
        if "kvstore" in runs and "lmcache" in runs:
            print("\n95% bootstrap intervals (each request's runs resampled):")
            print(table(bootstrap_ratio(runs, "kvstore", "lmcache"),
                        ["statistic", "ratio", "2.5%", "median", "97.5%"]))
        return
    configs = args.configs.split(",")
    for needs_venv in ("lmcache", "vllm-lmvenv"):
        if needs_venv in configs and not VENV_LMCACHE.exists():
            print(f"no {VENV_LMCACHE}: the {needs_venv} configuration is skipped "
                  "(bash scripts/setup_lmcache.sh)")
            configs.remove(needs_venv)
    sys_prompt, docs, turns = workload(args.users, args.rounds, args.system, args.question,
                                       args.answer, args.history)
    longest = args.system + args.history + args.rounds * (args.question + args.answer)
    max_len = min(16384, (args.cache_blocks - 1) * 128)  # a sequence must fit, with a spare
    if longest + args.answer > max_len:
        raise SystemExit(f"the longest prompt ({longest} tokens) does not fit vLLM's cache "
                         f"of {args.cache_blocks} blocks: raise --cache-blocks")
    models = Path(tempfile.mkdtemp(prefix="kvs-models-", dir="/tmp"))  # built once, shared
    try:
        rows, per_request, cpu_runs = run_all(configs, args, models, max_len, sys_prompt,
                                              docs, turns)
    finally:
        shutil.rmtree(models, ignore_errors=True)
    for row in rows:  # each request against vLLM alone's run of the same request
        if row["config"] != "vllm" and "vllm" in per_request:
            pairs = list(zip(per_request[row["config"]], per_request["vllm"], strict=True))
            row["worst TTFT / vLLM's"] = max(a["ttft_s"] / b["ttft_s"] for a, b in pairs)
            row["same output"] = f"{sum(a['output'] == b['output'] for a, b in pairs)}/" \
                                 f"{len(pairs)}"
            # The first token is computed over the same prompt by every configuration: loaded
            # K/V against vLLM's recompute of it, in whatever batch each request met.
            same_first = sum(a["output"][:1] == b["output"][:1] for a, b in pairs)
            row["same first token"] = f"{same_first}/{len(pairs)}"
            row["max |first logprob diff|"] = max(
                (abs(a["logprobs"][0] - b["logprobs"][0]) for a, b in pairs
                 if a["logprobs"] and b["logprobs"] and a["output"][:1] == b["output"][:1]),
                default=float("nan"))
    print(f"\n{args.users} users x {args.rounds} rounds, system {args.system}, history "
          f"{args.history}, question {args.question}, answer {args.answer} tokens; vLLM cache "
          f"{args.cache_blocks} blocks of 128 tokens\n")
    print(table(rows, list(dict.fromkeys(k for r in rows for k in r))))
    if args.repeats > 1:
        print("\nCPU seconds of each engine, in the order they ran:")
        print(table(cpu_runs, list(dict.fromkeys(k for r in cpu_runs for k in r))))
    path = write_results(args.name, {"args": vars(args), "rows": rows,
                                     "requests": per_request, "cpu_runs": cpu_runs})
    plot(rows, per_request, RESULTS / f"{args.name}.png")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
