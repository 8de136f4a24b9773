"""What the vLLM connector's scheduler side spends to look a long prompt up, first and again.

    .venv-vllm/bin/python -m tests.vllm.bench_connector_keys [--tokens 131072] [--repeats 20]

A prompt of `--tokens` tokens plus one (a Python list, as vLLM's `prompt_token_ids`), fully
stored in a daemon started here, looked up by `get_num_new_matched_tokens` as vLLM does: once
when the request arrives, then at every step it waits (`again`); `extended`: after one more
block is appended in place (a streaming session's next turn); `other request`: the same prompt
under another request id. Medians in ms, printed as one JSON line. The scheduler-role connector
runs in this process on fake requests (only the fields it reads); the tiny test model (2 layers,
2 KV heads, head_dim 64, float32: 1 KiB of KV per token), vLLM blocks of 128 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvstore.server.process import DaemonProcess
from tests.vllm.vllm_runner import make_model


def scheduler_connector(model: Path, target: str, block: int, max_len: int,
                        deadline_s: float = 10.0, role: str = "kv_both",
                        extra: dict[str, Any] | None = None) -> Any:
    """A scheduler-role `KVStoreConnector` for `make_model`'s tiny Llama (2 layers, 2 KV heads,
    head_dim 64, float32) with vLLM blocks of `block` tokens. A long deadline: tests and
    timings run on loaded machines, where a miss by deadline would change what they count.

    vLLM sets environment variables for the engine it would start, at import and in its
    config (LD_PRELOAD: tcmalloc, libgomp): they are undone here, so they do not reach this
    process's later subprocesses (the kernels' ASan shim refuses that LD_PRELOAD)."""
    environ = dict(os.environ)
    try:
        return _scheduler_connector(model, target, block, max_len, deadline_s, role, extra)
    finally:
        os.environ.clear()
        os.environ.update(environ)


def _scheduler_connector(model: Path, target: str, block: int, max_len: int,
                         deadline_s: float, role: str, more: dict[str, Any] | None) -> Any:
    import torch
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvstore.client.integrations.vllm import KVStoreConnector

    extra = {"kvstore.target": target, "kvstore.deadline_s": deadline_s, **(more or {})}
    ktc = KVTransferConfig(kv_connector="KVStoreConnector",
                           kv_connector_module_path="kvstore.client.integrations.vllm",
                           kv_role=role, kv_connector_extra_config=extra)
    config = VllmConfig(model_config=ModelConfig(model=str(model), dtype="float32",
                                                 max_model_len=max_len),
                        cache_config=CacheConfig(block_size=block), kv_transfer_config=ktc)
    spec = FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=64,
                             dtype=torch.float32)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    kv_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                              kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    return KVStoreConnector(config, KVConnectorRole.SCHEDULER, kv_config)


def request(req_id: str, tokens: list[int]) -> SimpleNamespace:
    """What the connector reads of a vLLM `Request`."""
    return SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, mm_features=[],
                           prompt_embeds=None, lora_request=None, cache_salt=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    block = 128
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "tiny-llama", positions=args.tokens + 4 * block)
        daemon = DaemonProcess(Path(tmp) / "kvstore", "--host-bytes",
                               f"{(args.tokens + 2 * block) * 1024 * 2}",
                               "--disk-bytes", "0").start()
        try:
            print(json.dumps(run(model, daemon.target, args.tokens, block, args.repeats)))
        finally:
            daemon.kill()


def run(model: Path, target: str, n: int, block: int, repeats: int) -> dict[str, Any]:
    import torch

    from kvstore.client import KVClient

    conn = scheduler_connector(model, target, block, n + 4 * block)
    rng = random.Random(0)
    tokens = [rng.randrange(3, 900) for _ in range(n + 1)]
    with KVClient(target, conn._layout, deadline_s=30) as c:  # store it: lookups hit in full
        kv = torch.zeros(conn._layout.kv_shape(n), dtype=conn._layout.torch_dtype)
        if c.publish(tokens[:n], kv) != n:
            raise RuntimeError("the prompt was not stored")

    def lookup(req: SimpleNamespace) -> float:
        began = time.perf_counter()
        got, _ = conn.get_num_new_matched_tokens(req, 0)
        ms = (time.perf_counter() - began) * 1e3
        if got < n - block:
            raise RuntimeError(f"the lookup found {got} of {n} tokens")
        return ms

    req = request("r1", tokens)
    first = lookup(req)
    again = [lookup(req) for _ in range(repeats)]
    extended = []
    for _ in range(5):
        tokens.extend(rng.randrange(3, 900) for _ in range(block))
        extended.append(lookup(req))
    others = [lookup(request(f"o{i}", tokens[: n + 1])) for i in range(5)]
    conn.request_finished(req, [])
    conn.shutdown()
    return {"tokens": n + 1, "first_ms": round(first, 2),
            "again_ms": round(statistics.median(again), 2),
            "extended_ms": round(statistics.median(extended), 2),
            "other_request_ms": round(statistics.median(others), 2)}


if __name__ == "__main__":
    main()
