"""Disaggregated prefill through kvstore: a vLLM prefill instance (`kv_role="kv_producer"`)
and a decode instance (`kv_consumer`), on one daemon, on two daemons sharing a Redis remote
tier, or on two daemons where the consumer loads from the producer's (`kvstore.peers`).

    .venv-vllm/bin/python -m benchmarks.vllm_disagg [--lengths 1024,2048] [--repeats 3]

vLLM's own P/D flow, as its disaggregated-prefill proxies run it: the request goes to the
producer with `max_tokens=1` (and `kv_transfer_params={"do_remote_decode": true}`), then to the
consumer with the `kv_transfer_params` the producer's output returned
(`{"kvstore_prefilled_tokens": N}`). Prompts of `n` tokens in whole blocks: the consumer loads
`n - 1` tokens and computes only the last one.

Measured per prompt length, in the engine processes (wall time of `LLM.generate` of one prompt,
`max_tokens=1`; no tokenizer):
- recompute: the consumer engine computing the whole prompt (a fresh `cache_salt`, so nothing
  is in kvstore under it): what a decode instance without a producer pays;
- producer: the prefill instance's `generate`, its synchronous save included;
- consumer: the decode instance's TTFT on the producer's blocks (lookup, load, the last
  token), after `reset_prefix_cache()`; its first token is compared with the recompute's
  (counted, not required: bf16 near ties; tests/vllm/test_vllm_disagg.py checks outputs).
Setups (`--setups`): `one` (both engines on one daemon), `two` (each engine on its own
daemon; the producer's daemon writes through to redis, the consumer's reads through from it),
`peer` (each on its own daemon, no redis; the producer's daemon listens on TCP as well, the
producer names it in its `kv_transfer_params` (`kvstore.peer_target`) and the consumer, which
lists it (`kvstore.peers`), loads the prompt from it over TCP, as from another machine).

Model: a random-weight Llama with Llama-3-8B's KV shape per layer (8 KV heads x 128, bf16) and
`--layers` layers (default 8: 32 KiB of KV per token), tiny compute; it is built here. The
engine side of this module (`--engine '{json}'`) is also what tests/vllm/test_vllm_disagg.py
runs its engines with.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.vllm_ttft import logging_config  # vLLM's and kvstore's INFO lines
from benchmarks.worker import JsonLineWorker

ROOT = Path(__file__).resolve().parents[1]
TOP_K = 5  # log-probabilities returned per generated token
PREFILLED = "kvstore_prefilled_tokens"  # = kvstore.client.integrations.vllm.PREFILLED_TOKENS
PREFILL_RATE = "kvstore_prefill_tokens_per_s"  # = ...integrations.vllm.PREFILL_RATE


# ---- engine subprocess: `python -m benchmarks.vllm_disagg --engine '{json}'`
def engine_main(opts: dict[str, Any]) -> None:
    """One vLLM engine with the kvstore connector in `opts["role"]`, driven by JSON lines on
    stdin (`generate`, `reset`, `quit`); one `RESULT {json}` line per command."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    extra = {"kvstore.target": opts["target"], **opts.get("extra", {})}
    ktc = KVTransferConfig(kv_connector="KVStoreConnector",
                           kv_connector_module_path="kvstore.client.integrations.vllm",
                           kv_role=opts["role"], kv_connector_extra_config=extra)
    llm = LLM(model=opts["model"], dtype=opts.get("dtype", "float32"), enforce_eager=True,
              skip_tokenizer_init=opts.get("skip_tokenizer_init", False),
              block_size=opts.get("block_size", 32), max_model_len=opts.get("max_model_len", 1024),
              max_num_seqs=4, seed=0, kv_transfer_config=ktc, **opts.get("llm_kwargs", {}))
    print("RESULT " + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "reset":  # saves still running hold blocks: retry briefly
            ok = False
            for _ in range(100):
                if ok := bool(llm.reset_prefix_cache()):
                    break
                time.sleep(0.05)
            print("RESULT " + json.dumps({"reset": ok}), flush=True)
            continue
        prompts = cmd["prompts"]
        transfer = cmd.get("kv_transfer_params") or [None] * len(prompts)
        params = [SamplingParams(temperature=0.0, max_tokens=cmd.get("max_tokens", 16),
                                 ignore_eos=True, logprobs=TOP_K, detokenize=False,
                                 extra_args={"kv_transfer_params": t} if t else None)
                  for t in transfer]
        # A string is a text prompt, a list its token ids, a dict goes as is (cache_salt).
        inputs = [{"prompt": p} if isinstance(p, str) else p if isinstance(p, dict)
                  else {"prompt_token_ids": p} for p in prompts]
        start = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        result = {
            "seconds": time.perf_counter() - start,
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "prompt_tokens": [len(o.prompt_token_ids or []) for o in outs],
            "cached": [o.num_cached_tokens or 0 for o in outs],
            "kv_transfer_params": [o.kv_transfer_params for o in outs],
            "logprobs": [[step[t].logprob for step, t in zip(o.outputs[0].logprobs or [],
                                                             o.outputs[0].token_ids, strict=True)]
                         for o in outs],
            "top": [[{str(t): lp.logprob for t, lp in step.items()}
                     for step in o.outputs[0].logprobs or []] for o in outs]}
        print("RESULT " + json.dumps(result), flush=True)
    del llm  # shuts the engine core process down


class Engine(JsonLineWorker):
    """An `engine_main` subprocess in `role`; its log goes to `log`."""

    def __init__(self, model: Path, target: str, role: str, log: Path, **opts: Any) -> None:
        self.role = role
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
               "VLLM_CPU_KVCACHE_SPACE": str(opts.pop("kv_space_gib", 1)),
               "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
               "VLLM_LOGGING_CONFIG_PATH": str(logging_config())}
        args = {"model": str(model), "target": target, "role": role, **opts}
        super().__init__(f"{role} engine", [sys.executable, "-m", "benchmarks.vllm_disagg",
                                            "--engine", json.dumps(args)],
                         cwd=ROOT, env=env, log_path=log)
        if not self.read().get("ready"):
            raise RuntimeError(f"{role} engine did not start:\n{self.tail()}")

    def send(self, prompts: list[Any], max_tokens: int,
             kv_transfer_params: list[dict[str, Any] | None] | None = None) -> None:
        """Start a generate; `read()` returns its result."""
        stdin = self._pipe(self.proc.stdin)
        stdin.write(json.dumps({"op": "generate", "prompts": prompts, "max_tokens": max_tokens,
                                "kv_transfer_params": kv_transfer_params}) + "\n")
        stdin.flush()

    def generate(self, prompts: list[Any], max_tokens: int,
                 kv_transfer_params: list[dict[str, Any] | None] | None = None,
                 ) -> dict[str, Any]:
        self.send(prompts, max_tokens, kv_transfer_params)
        return self.read()

    def prefill(self, prompts: list[Any]) -> dict[str, Any]:
        """The proxy's first leg: one output token, as vLLM's P/D proxies ask a producer."""
        return self.generate(prompts, 1, [{"do_remote_decode": True}] * len(prompts))

    def reset(self) -> None:
        if not self.call(op="reset")["reset"]:
            raise RuntimeError(f"{self.role}: vLLM's prefix cache did not reset")


# ---- the benchmark
def make_model(path: Path, layers: int) -> Path:
    import torch

    from benchmarks.common import llama_8b_kv_shaped

    if not (path / "config.json").exists():
        llama_8b_kv_shaped(layers, dtype=torch.bfloat16).save_pretrained(
            path, safe_serialization=True)
    return path


SETUPS = {"one": "one daemon", "two": "two daemons + redis", "peer": "two daemons, peer"}


@contextlib.contextmanager
def daemons(root: Path, setup: str,
            ) -> Iterator[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    """`(producer target, consumer target, producer's extra config, consumer's)` of `setup`
    (`SETUPS`): one daemon; two writing through to and reading through from one redis; or
    two, the producer's listening on TCP for its consumer (`kvstore.peers`)."""
    from kvstore.server.process import DaemonProcess
    from tests.redis_servers import RedisServer, free_port

    redis = RedisServer(root / "redis").start() if setup == "two" else None
    remote = ["--remote", redis.url] if redis is not None else []
    extra_p: dict[str, Any] = {}
    extra_c: dict[str, Any] = {}
    listen: list[str] = []
    if setup == "peer":
        address, token = f"127.0.0.1:{free_port()}", secrets.token_hex(16)
        listen = ["--listen", address, "--token", token]
        extra_p = {"kvstore.peer_target": address}
        extra_c = {"kvstore.peers": address, "kvstore.peer_token": token}
    started: list[DaemonProcess] = []
    try:
        a = DaemonProcess(root / "kv-a", "--host-bytes", "2GiB", *remote, *listen).start()
        started.append(a)
        b = a
        if setup != "one":
            b = DaemonProcess(root / "kv-b", "--host-bytes", "2GiB", *remote).start()
            started.append(b)
        yield a.target, b.target, extra_p, extra_c
    finally:
        for d in started:
            d.kill()
        if redis is not None:
            redis.kill()


def prompt_ids(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 32000) for _ in range(n)]


def run_setup(setup: str, model: Path, root: Path, lengths: list[int], repeats: int,
              block: int) -> list[dict[str, Any]]:
    from benchmarks.common import require

    rows: list[dict[str, Any]] = []
    opts = {"dtype": "bfloat16", "skip_tokenizer_init": True, "block_size": block,
            "max_model_len": max(lengths) + 64, "kv_space_gib": 1}
    name = SETUPS[setup]
    with daemons(root / setup, setup) as (target_p, target_c, extra_p, extra_c):
        producer = Engine(model, target_p, "kv_producer", root / f"{setup}-producer.log",
                          extra=extra_p, **opts)
        consumer = Engine(model, target_c, "kv_consumer", root / f"{setup}-consumer.log",
                          extra=extra_c, **opts)
        try:
            for n in lengths:
                ids = prompt_ids(n, seed=n)
                recompute, prefill, decode = [], [], []
                same = 0  # runs whose first token equals the recompute's (bf16: near ties)
                for r in range(repeats):
                    cold = consumer.generate([{"prompt_token_ids": ids,
                                               "cache_salt": f"recompute-{r}"}], 1)
                    require(cold["cached"] == [0], f"recompute run found {cold['cached']}")
                    recompute.append(cold["seconds"])
                    consumer.reset()
                    prompt = {"prompt_token_ids": ids, "cache_salt": f"{name}-{r}"}
                    p = producer.prefill([prompt])
                    require(p["kv_transfer_params"][0].get(PREFILLED) == n,
                            f"producer returned {p['kv_transfer_params']}")
                    prefill.append(p["seconds"])
                    d = consumer.generate([prompt], 1, p["kv_transfer_params"])
                    require(d["cached"] == [n - 1], f"consumer loaded {d['cached']} of {n - 1}")
                    same += d["tokens"] == cold["tokens"]
                    decode.append(d["seconds"])
                    consumer.reset()
                row = {"setup": name, "tokens": n,
                       "recompute s": statistics.median(recompute),
                       "producer s": statistics.median(prefill),
                       "consumer TTFT s": statistics.median(decode),
                       "same first token": f"{same}/{repeats}"}
                row["speedup"] = row["recompute s"] / row["consumer TTFT s"]
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            consumer.close()
            producer.close()
    return rows


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--engine":
        engine_main(json.loads(sys.argv[2]))
        return
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1024,2048", help="prompt tokens (whole blocks)")
    p.add_argument("--repeats", type=int, default=3, help="runs per prompt (median)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--setups", default="one,two,peer",
                   help="one (one daemon), two (two + redis), peer (two, the consumer loading "
                        "from the producer's daemon)")
    p.add_argument("--name", default="vllm_disagg", help="results file name (JSON)")
    args = p.parse_args()
    from benchmarks.common import RESULTS, table

    lengths = [int(n) for n in args.lengths.split(",")]
    if any(n % args.block_size for n in lengths):
        raise SystemExit("--lengths must be whole blocks of --block-size")
    setups = args.setups.split(",")
    if unknown := [s for s in setups if s not in SETUPS]:  # before minutes of other setups
        raise SystemExit(f"--setups: unknown {unknown}; known: {sorted(SETUPS)}")
    root = Path(tempfile.mkdtemp(prefix="kvd-", dir="/tmp"))  # short socket paths
    rows: list[dict[str, Any]] = []
    try:
        model = make_model(root / "model", args.layers)
        for setup in setups:
            rows += run_setup(setup, model, root, lengths, args.repeats, args.block_size)
    finally:  # the model and the daemons' blocks; the logs stay
        for path in root.iterdir():
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
    columns = ["setup", "tokens", "recompute s", "producer s", "consumer TTFT s", "speedup",
               "same first token"]
    print(table(rows, columns))
    out = RESULTS / f"{args.name}.json"
    out.write_text(json.dumps({"command": " ".join(sys.argv), "layers": args.layers,
                               "block_size": args.block_size, "repeats": args.repeats,
                               "rows": rows}, indent=1))
    print(f"wrote {out}; logs in {root}")


if __name__ == "__main__":
    main()
