"""A full prefill in vLLM (no connector) per model depth and dtype: what recompute costs.

    .venv-vllm/bin/python -m benchmarks.vllm_prefill [--tokens 2048] [--shapes 32:bfloat16,...]

Each shape is the Llama-3-8B-KV-shaped random model (`benchmarks.common.llama_8b_kv_shaped`,
8 KV heads x 128 dims per layer) at LAYERS:DTYPE, run in a vLLM engine of its own (block
size 128, prefix caching on, `enforce_eager`, `VLLM_CPU_NUM_OF_RESERVED_CPU=1`): a warm-up
prompt, then one prompt of `--tokens` random ids, timed to its first token. It is why
docker-compose.yml's model is 16 layers in float32: the KV bytes per token of 32 layers in bf16
(128 KiB), at half the attention, in the dtype that CPUs without bf16 arithmetic (AVX2) compute
natively. Results: benchmarks/results/vllm_prefill.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 32000


def one(path: Path, layers: int, dtype: str, tokens: int) -> dict[str, Any]:
    """In a child process (vLLM spawns workers: this runs under `__main__`)."""
    import torch

    from benchmarks.common import llama_8b_kv_shaped

    if not (path / "config.json").exists():
        llama_8b_kv_shaped(layers, vocab=VOCAB, dtype=getattr(torch, dtype)).save_pretrained(
            path, safe_serialization=True)
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(path), skip_tokenizer_init=True, enforce_eager=True, block_size=128,
              max_model_len=tokens + 64, dtype=dtype)
    params = SamplingParams(max_tokens=1, temperature=0)
    rng = random.Random(tokens)
    llm.generate([{"prompt_token_ids": [rng.randrange(3, VOCAB) for _ in range(256)]}], params,
                 use_tqdm=False)
    prompt = [rng.randrange(3, VOCAB) for _ in range(tokens)]
    began = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    seconds = time.perf_counter() - began
    return {"layers": layers, "dtype": dtype, "tokens": tokens, "seconds": seconds,
            "kv_bytes_per_token": layers * 2 * 8 * 128 * torch.finfo(getattr(torch, dtype)).bits
            // 8, "token": out[0].outputs[0].token_ids[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--shapes", default="32:bfloat16,32:float32,16:float32",
                   help="LAYERS:DTYPE,... (default %(default)s)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vllm_prefill.json"))
    args = p.parse_args()
    if args.child:
        layers, dtype, path = args.child.split(":", 2)
        print("RESULT " + json.dumps(one(Path(path), int(layers), dtype, args.tokens)), flush=True)
        return
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        shapes = args.shapes.split(",")
        for i, shape in enumerate(shapes, 1):
            layers, dtype = shape.split(":")
            print(f"[{i}/{len(shapes)}] {layers} layers, {dtype}, {args.tokens} tokens ...",
                  flush=True)
            child = subprocess.run(
                [sys.executable, "-m", "benchmarks.vllm_prefill", "--tokens", str(args.tokens),
                 "--child", f"{layers}:{dtype}:{Path(tmp) / shape.replace(':', '-')}"],
                cwd=ROOT, env=env, capture_output=True, text=True, check=False)
            result = [ln for ln in child.stdout.splitlines() if ln.startswith("RESULT ")]
            if child.returncode or not result:
                raise RuntimeError(f"{shape} failed ({child.returncode}):\n{child.stderr[-3000:]}")
            rows.append(json.loads(result[0].removeprefix("RESULT ")))
            print(f"    prefill {rows[-1]['seconds']:.1f} s", flush=True)
    print(f"\n{'layers':>6}  {'dtype':>8}  {'KV/token':>9}  {'prefill':>9}")
    for r in rows:
        print(f"{r['layers']:>6}  {r['dtype']:>8}  {r['kv_bytes_per_token'] // 1024:>6} KiB"
              f"  {r['seconds']:>7.1f} s")
    Path(args.out).write_text(json.dumps(
        {"benchmark": "vllm_prefill", "when": time.strftime("%Y-%m-%d %H:%M:%S"),
         "load_average": os.getloadavg(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
