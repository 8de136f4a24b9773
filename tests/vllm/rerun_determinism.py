"""Does one vLLM engine give the same bits when it reruns a batch? (docs/ENGINES.md, "fp8 KV
caches": a batch of two prompts did not; one prompt at a time did.)

    .venv-vllm/bin/python -m tests.vllm.rerun_determinism --kv-cache-dtype fp8 --prompts 2

One engine with the connector (the vLLM tests' tiny Llama, 32-token blocks) computes the batch
cold, then `--rounds` times: vLLM's prefix cache reset, the batch again (loaded from kvstore),
and once more (served by vLLM's own prefix cache). Each round prints the largest gap in top-k
log-probabilities between the load and the rerun, and whether each equals the first round's.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from kvstore.server.process import DaemonProcess
from tests.vllm.test_vllm_connector import Engine, prompts
from tests.vllm.vllm_runner import make_model


def top_gap(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest difference of a top-k log-probability the two runs share."""
    return max((abs(x[t] - y[t]) for sa, sb in zip(a["top"], b["top"], strict=True)
                for x, y in zip(sa, sb, strict=True) for t in x.keys() & y.keys()), default=0.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kv-cache-dtype", default="fp8", help="vLLM's cache dtype (auto, fp8...)")
    p.add_argument("--prompts", type=int, default=2, choices=(1, 2), help="prompts per batch")
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvw-", dir="/tmp"))
    model = make_model(root / "model")
    daemon = DaemonProcess(root / "kvstore", "--host-bytes", "64MiB",
                           "--disk-bytes", "128MiB").start()
    try:
        engine = Engine(model, daemon.target, block_size=32,
                        llm_kwargs={"kv_cache_dtype": args.kv_cache_dtype})
        try:
            batch = prompts(seed=61)[: args.prompts]
            cold = engine.generate(batch)
            first: tuple[dict[str, Any], dict[str, Any]] | None = None
            for i in range(args.rounds):
                engine.reset()
                loaded, rerun = engine.generate(batch), engine.generate(batch)
                first = first or (loaded, rerun)
                print(f"round {i}: cached {loaded['cached']}, load / rerun gap "
                      f"{top_gap(loaded, rerun):.2e}, tokens as cold "
                      f"{loaded['tokens'] == rerun['tokens'] == cold['tokens']}, load as "
                      f"round 0's {loaded['top'] == first[0]['top']}, rerun as round 0's "
                      f"{rerun['top'] == first[1]['top']}", flush=True)
        finally:
            engine.close()
    finally:
        daemon.kill()


if __name__ == "__main__":
    main()
