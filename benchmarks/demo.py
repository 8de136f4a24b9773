"""`make demo`: the TTFT win, end to end, on the embedded default (host + disk tiers).

Starts `kvstore-server` under .data/demo, builds a random-weight Llama with Llama-3-8B's KV
shape locally, and prefills one prompt three times through transformers + kvstore:
cold (computed, then published), warm from the host tier, and warm from the disk tier after
a daemon restart. Checks that the logits are identical each time, prints a table and writes
benchmarks/results/demo.json and demo.png.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.common import RESULTS, barh, llama_8b_kv_shaped, table, write_results
from kvstore.client import KVClient
from kvstore.client.integrations.hf import CachedPrefill, layout_for_model
from kvstore.server.process import DaemonProcess


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=2048 + 32, help="prompt length")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--data-dir", default=".data/demo")
    p.add_argument("--target", help="use this running daemon instead of starting one "
                   "(the disk-tier run after a restart is skipped)")
    # float32 by default: CPUs without AVX-512 BF16 run bf16 matmuls ~90x slower than fp32
    # (measured here), which would make recomputation look far worse than it is.
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    data = Path(args.data_dir)
    shutil.rmtree(data, ignore_errors=True)
    daemon = None if args.target else DaemonProcess(
        data / "kvstore", "--host-bytes", "2GiB", "--disk-bytes", "8GiB")
    target = args.target or daemon.target  # type: ignore[union-attr]
    steps = tqdm(total=5, desc="demo", unit="step")
    if daemon:
        daemon.start()
    steps.update()
    try:
        model = llama_8b_kv_shaped(args.layers, dtype=getattr(torch, args.dtype))
        layout = layout_for_model(model)
        prompt = torch.randint(0, model.config.vocab_size, (1, args.tokens),
                               generator=torch.Generator().manual_seed(1))
        steps.update()
        runs = []
        with KVClient(target, layout, deadline_s=30) as client:
            client.clear()  # this prompt's namespace only: the first run must be cold
            # The engine reserves K/V memory for its prompts when it starts, as serving
            # engines do: a warm prefill then pays no page faults for the loaded prefix.
            engine = CachedPrefill(model, client, reserve_tokens=args.tokens)
            for label in ("cold: recompute", "warm: host tier"):
                runs.append((label, engine.prefill(prompt)))
                steps.update()
            stats = client.stats()
        if daemon:
            daemon.stop()  # SIGTERM flushes host blocks to disk
            daemon.start()
            with KVClient(target, layout, deadline_s=30) as client:
                engine = CachedPrefill(model, client, reserve_tokens=args.tokens)
                runs.append(("warm: disk tier", engine.prefill(prompt)))
                stats = client.stats()
        steps.update()
    finally:
        if daemon:
            daemon.stop()
        steps.close()
    if stats is None:
        raise SystemExit(f"the daemon at {target} did not answer")

    base = runs[0][1]
    rows = []
    for label, r in runs:
        rows.append({"run": label, "cached tokens": r.cached_tokens,
                     "computed tokens": r.computed_tokens, "TTFT s": r.ttft_s,
                     "speed-up": base.ttft_s / r.ttft_s,
                     "max |logit diff|": float((r.logits - base.logits).abs().max())})
    kv_mb = layout.bytes_per_token * runs[1][1].cached_tokens / 2**20
    print(f"\nprompt {args.tokens} tokens, KV {layout.bytes_per_token // 1024} KiB/token "
          f"({kv_mb:.0f} MiB cached); model {args.layers} layers, random weights\n")
    print(table(rows, list(rows[0])))
    disk = next((t for t in stats.tiers if t.name == "disk"), None)
    print(f"\ndisk tier: {disk.blocks if disk else 0} blocks; integrity failures "
          f"{stats.integrity_failures}")
    for r in rows[1:]:
        if r["max |logit diff|"] != 0.0:
            raise SystemExit(f"logits differ with the cache: {r}")
    print("logits with the cache are identical to recomputation.")
    path = write_results("demo", {"tokens": args.tokens, "layers": args.layers,
                                  "kv_bytes_per_token": layout.bytes_per_token, "runs": rows})
    _plot(rows, RESULTS / "demo.png")
    print(f"results: {path} and {RESULTS / 'demo.png'}")


def _plot(rows: list[dict], path: Path) -> None:
    barh(path, [r["run"] for r in rows], [r["TTFT s"] for r in rows],
         [f"{r['TTFT s']:.2f}s ({r['speed-up']:.1f}x)" for r in rows], ["#999", "#2a7", "#27a"],
         "time to first token (s)", "kvstore: TTFT with a cached prefix", width=6)


if __name__ == "__main__":
    main()
