"""Warm transformers prefills of a sliding-window model: the window's blocks only, or all.

A random-weight Gemma-3-shaped model (five sliding-window layers to one full-attention layer,
a 1,024-token window) with the demo's KV shape (8 KV heads x 128 dims per layer, fp32: 256
KiB per token at 32 layers), one prompt published by a cold prefill, then warm prefills from
the host tier alternating between the two ways to load it, in one process:

- `window`: a sliding-window layer copies only the blocks its window reaches
  (`CachedPrefill.windows`, the default);
- `every block`: each layer copies the whole prefix (`windows = None`, as before).

    python -m benchmarks.window_loads [--tokens 8224] [--repeats 5] [--arch gemma4]

`--arch gemma4`: Gemma 4's layer shapes instead, the full-attention layers' heads twice the
sliding ones' dims (8 x 256 beside 8 x 128): each full layer spans two of the layout's layers
(hf_layers.py). Its results go to window_loads_gemma4.json.

Each TTFT is the median of `--repeats` warm prefills; the bytes are those the load copies.
Loading every block gives the cold run's logits exactly. Loading the window's blocks gives
them to float noise: each window layer's attention then sums over its window's keys only,
not over the whole prefix under a mask, as the model's own sliding-window cache does when
it decodes (bit for bit the model's own split: tests/integration/test_hf_models.py).
Writes benchmarks/results/window_loads.json and .png; docs/PERFORMANCE.md quotes it.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.common import RESULTS, barh, require, table, write_results
from kvstore.client import KVClient
from kvstore.client.integrations.hf import CachedPrefill, layout_for_model
from kvstore.server.process import DaemonProcess


def gemma3_8b_kv_shaped(layers: int, window: int) -> Any:
    """Gemma 3's layer pattern (5 sliding-window : 1 full) with the demo's KV shape."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=32000, hidden_size=256, intermediate_size=256,
                           num_hidden_layers=layers, num_attention_heads=8,
                           num_key_value_heads=8, head_dim=128, sliding_window=window,
                           sliding_window_pattern=6, max_position_embeddings=32768,
                           initializer_range=0.3, tie_word_embeddings=False,
                           name_or_path="kvstore-bench/gemma3-8b-kv-shaped")
    torch.manual_seed(0)
    return Gemma3ForCausalLM(cfg).eval()


def gemma4_8b_kv_shaped(layers: int, window: int) -> Any:
    """Gemma 4's layer pattern (5 sliding-window : 1 full) and head dims per layer: the demo's
    KV shape on the sliding layers, heads of twice its dims on the full ones."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    cfg = Gemma4TextConfig(vocab_size=32000, vocab_size_per_layer_input=32000,
                           hidden_size_per_layer_input=16, hidden_size=256,
                           intermediate_size=256, num_hidden_layers=layers,
                           num_attention_heads=8, num_key_value_heads=8, head_dim=128,
                           global_head_dim=256, sliding_window=window,
                           max_position_embeddings=32768, initializer_range=0.3,
                           tie_word_embeddings=False,
                           name_or_path="kvstore-bench/gemma4-8b-kv-shaped")
    torch.manual_seed(0)
    return Gemma4ForCausalLM(cfg).eval()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192 + 32, help="prompt length")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--data-dir", default=".data/window-loads")
    p.add_argument("--arch", choices=("gemma3", "gemma4"), default="gemma3")
    args = p.parse_args()

    data = Path(args.data_dir)
    shutil.rmtree(data, ignore_errors=True)
    model = (gemma3_8b_kv_shaped if args.arch == "gemma3" else gemma4_8b_kv_shaped)(
        args.layers, args.window)
    layout = layout_for_model(model)
    host = layout.bytes_per_token * args.tokens + (512 << 20)
    daemon = DaemonProcess(data / "kvstore", "--host-bytes", str(host),
                           "--disk-bytes", str(2 * host))
    prompt = torch.randint(0, 32000, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {"window": [], "every block": []}
    diffs: dict[str, float] = {}
    bar = tqdm(total=1 + 2 * args.repeats, desc="window loads", unit="prefill")
    daemon.start()
    try:
        with KVClient(daemon.target, layout, deadline_s=60) as client:
            client.clear()
            engine = CachedPrefill(model, client, reserve_tokens=args.tokens)
            windows = engine.windows
            require(windows is not None, "this transformers gives no sliding-window layers")
            cold = engine.prefill(prompt)
            require(cold.published_tokens > 0, "the cold prefill published nothing")
            bar.update()
            for i in range(2 * args.repeats):
                way = ("window", "every block")[(i + i // 2) % 2]  # alternate who goes first
                engine.windows = windows if way == "window" else None
                r = engine.prefill(prompt, publish=False)
                require(r.cached_tokens == cold.published_tokens, f"{way}: loaded {r}")
                times[way].append(r.ttft_s)
                diffs[way] = max(diffs.get(way, 0.0), float((r.logits - cold.logits).abs().max()))
                del r
                bar.update()
    finally:
        bar.close()
        daemon.stop(keep_arena=False)

    cached = cold.published_tokens
    per_block = [s.heads * (s.key_dim + s.value_dim) * layout.block_tokens * layout.dtype_bytes
                 for s in engine.shapes]  # one layer of one block
    blocks = cached // layout.block_tokens
    first = max(0, cached - (args.window - 1)) // layout.block_tokens
    window_bytes = sum(b * (blocks - first if w else blocks)
                       for b, w in zip(per_block, windows or [], strict=True))
    rows = [{"load": way, "TTFT s": statistics.median(ts), "samples": " ".join(
                 f"{t:.3f}" for t in ts),
             "copied MiB": (window_bytes if way == "window" else sum(per_block) * blocks)
             / 2**20,
             "max |logit diff| vs cold": diffs[way]} for way, ts in times.items()]
    print(f"\n{args.tokens}-token prompt ({cached} cached), {args.layers} layers, window "
          f"{args.window}, {layout.bytes_per_token // 1024} KiB/token; cold {cold.ttft_s:.1f} s\n")
    # The differences are float noise (~1e-5): the table's three decimals would show 0.000.
    print(table([{**r, "max |logit diff| vs cold": f"{r['max |logit diff| vs cold']:.2g}"}
                 for r in rows], list(rows[0])))
    ratio = rows[0]["TTFT s"] / rows[1]["TTFT s"]
    print(f"\nwindow / every block: {ratio:.2f}x the TTFT")
    name = "window_loads" if args.arch == "gemma3" else f"window_loads_{args.arch}"
    path = write_results(name, {"args": vars(args), "cold_s": cold.ttft_s,
                                "layout": layout.to_dict(), "rows": rows, "ratio": ratio})
    barh(RESULTS / f"{name}.png", [r["load"] for r in rows], [r["TTFT s"] for r in rows],
         [f"{r['TTFT s']:.2f}s, {r['copied MiB']:.0f} MiB" for r in rows], ["#2a7", "#999"],
         "warm TTFT from the host tier (s)",
         f"{args.arch}-shaped: window loads ({args.tokens} tokens)", width=6)
    print(f"results: {path} and {RESULTS / f'{name}.png'}")


if __name__ == "__main__":
    main()
