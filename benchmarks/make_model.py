"""Write a random-weight Llama with Llama-3-8B's KV shape to a folder vLLM and transformers load.

No model hub: the weights are random (TTFT and output equality do not need trained weights).

    python -m benchmarks.make_model --out /models/llama-8b-kv-shaped [--layers 32]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.common import llama_8b_kv_shaped


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = p.parse_args()
    out = Path(args.out)
    if (out / "config.json").exists():
        print(f"{out} exists; keeping it")
        return
    model = llama_8b_kv_shaped(args.layers, dtype=getattr(torch, args.dtype))
    model.save_pretrained(out, safe_serialization=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
