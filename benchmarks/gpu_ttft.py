"""TTFT on a GPU through the transformers integration (issue 19, step 4): a random-weight model
with Llama-3-8B's full architecture, prompts of 8k-32k tokens, recompute against warm from the
host tier, each against its physical floor, logits compared. Warm loads are timed every way a
CUDA cache is filled (`load_modes`): hf's defaults, what a user gets (`warm_host_s`); the copy
kernel in one launch (`warm_one_launch_s`); torch's copies (`warm_torch_copy_s`); the kernel in
4 or 8 groups of layers on a side stream beside the forward, which runs on a high-priority
stream (`warm_groups4_s`, `warm_groups8_s`: `hf.CUDA_LOAD_GROUPS`), or without priority or a
capped grid (`warm_groups4_flat_s`, `warm_groups8_flat_s`), or capped at other CTA counts
(`--ctas-sweep`). `--profile DIR` writes where warm prefills from each daemon spend their time
(cProfile, torch's profiler, a Chrome trace of a grouped load). `hbm_best_s` is what a
daemon-held HBM slab could give at best: the prefix already in device memory, scattered into
the cache by the kernel, then the suffix (no lookup, lease or IPC counted). `warm_gpu_tier_s`
is the real thing: a second daemon with a gpu level in device memory (`--gpu-bytes`,
`--gpu-device cuda`), whose slab the client maps through CUDA IPC; the prefix is lifted into that
level by a first warm prefill, then served from it device to device (its hits are counted to
prove it).

    python -m benchmarks.gpu_ttft --lengths 8192,16384,32768      # on the GPU machine

Per length, in one run: the full prefill (recompute), a cold `CachedPrefill.prefill` that
publishes the prompt, then warm prefills from the daemon's host tier. The floor of a warm
prefill is the suffix forward over a cache already on the device plus the prefix's K/V bytes
at the host-to-device rate of pinned memory measured here (`floor_s`); `floor_pageable_s`
uses the pageable rate, which the integration's copies out of the daemon's mapping (not
pinned in the client) get. The warm logits are compared bit for bit with the model's own
computation over the same split (prefix forward, then the suffix over that cache: the same
number of computed tokens), and to the full recompute by their largest difference and
argmax. `--device cpu --layers 2 --hidden 256` runs it small on a CPU (a smoke test).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.common import require, table, write_results
from kvstore.client import KVClient
from kvstore.client.integrations import hf
from kvstore.client.integrations.hf import CachedPrefill, layout_for_model
from kvstore.config import parse_size
from kvstore.server.process import DaemonProcess


def llama3_8b(layers: int, hidden: int, device: str, seed: int = 0) -> Any:
    """Llama-3-8B's architecture (hidden 4096, 32 layers, 32 query and 8 KV heads of 128,
    MLP 14336, vocabulary 128256) with random bf16 weights, built on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = max(1, hidden // 128)
    cfg = LlamaConfig(vocab_size=128256, hidden_size=hidden, intermediate_size=hidden * 7 // 2,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=max(1, heads // 4), head_dim=128,
                      max_position_embeddings=131072, rope_theta=500000.0,
                      initializer_range=0.05, name_or_path="kvstore-gpu/llama-3-8b-arch")
    torch.manual_seed(seed)
    with torch.device(device):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = LlamaForCausalLM(cfg)
        finally:
            torch.set_default_dtype(prev)
    return model.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Any, device: torch.device) -> tuple[float, Any]:
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t, out


def h2d_rates(nbytes: int, device: torch.device) -> dict[str, float]:
    """Host-to-device GB/s of `nbytes`, from pageable and from pinned memory (median of 5)."""
    if device.type != "cuda":
        return {}
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = {}
    for kind in ("pageable", "pinned"):
        src = torch.ones(nbytes, dtype=torch.uint8)
        if kind == "pinned":
            src = src.pin_memory()
        times = [timed(lambda s=src: dst.copy_(s, non_blocking=True), device)[0]
                 for _ in range(6)][1:]
        rates[kind] = nbytes / statistics.median(times) / 1e9
    return rates


def in_device_memory(cache: Any, layout: Any, n: int) -> torch.Tensor:
    """The prefix's blocks as a daemon's HBM slab would hold them: `[blocks, layers, 2, bt,
    heads, dim]` in device memory (gathered from the model's own cache by the copy kernel)."""
    from kvstore import kernels
    from kvstore.kernels import EngineKV

    engine = EngineKV.transformers([lc.keys for lc in cache.layers],
                                   [lc.values for lc in cache.layers])
    blocks = n // layout.block_tokens
    out = torch.empty(kernels.staging_shape(engine, blocks, layout.block_tokens),
                      dtype=layout.torch_dtype, device=cache.layers[0].keys.device)
    kernels.gather(engine, out, [[b] for b in range(blocks)])
    return out


def from_device_memory(model: Any, slab: torch.Tensor, prompt: torch.Tensor, n: int,
                       layout: Any) -> torch.Tensor:
    """An HBM tier's best case (issue 15's decision): the prefix scattered by the copy kernel
    from device memory (as a slab reached through CUDA IPC would be, with no lease or lookup)
    into a fresh cache, then the suffix. Returns the last token's logits."""
    from kvstore import kernels
    from kvstore.kernels import EngineKV

    keys, values = hf._cache_tensors(layout, prompt.shape[1] + 1, None, prompt.device)
    kernels.scatter(slab, EngineKV.transformers(keys, values),
                    [[b] for b in range(slab.shape[0])])
    out, _ = hf.run_model(model, prompt[:, n:], hf.roomy_cache(keys, values, n),
                          last_logits_only=True)
    return out.logits[0, -1].float()


@torch.inference_mode()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="8192,16384,32768", help="cached prefix lengths")
    p.add_argument("--suffix", type=int, default=32, help="new tokens after the prefix")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--host-bytes", default="16GiB")
    p.add_argument("--data-dir", default="/tmp/kvstore-gpu-ttft")
    p.add_argument("--gpu-tier-bytes", default="6GiB",
                   help="the gpu level of the second daemon (warm_gpu_tier_s); 0: not run")
    p.add_argument("--out", default="gpu_ttft", help="results name (benchmarks/results)")
    p.add_argument("--ctas-sweep", default="",
                   help="e.g. 8,64,0: also time 4 groups capped at each (hf.CUDA_LOAD_CTAS)")
    p.add_argument("--profile", default="",
                   help="a directory: where warm prefills spend their time (cProfile, torch's "
                        "profiler, Chrome traces)")
    args = p.parse_args()
    device = torch.device(args.device)
    lengths = [int(x) for x in args.lengths.split(",")]

    model = llama3_8b(args.layers, args.hidden, args.device)
    layout = layout_for_model(model, block_tokens=256)
    print(f"model: {sum(t.numel() for t in model.parameters()) / 1e9:.2f} B parameters, "
          f"{layout.block_bytes / 2**20:.0f} MiB of K/V per 256-token block")
    rates = h2d_rates(1 << 30, device)
    print("host->device GB/s:", {k: round(v, 1) for k, v in rates.items()})

    daemon = DaemonProcess(Path(args.data_dir), "--host-bytes", args.host_bytes,
                           "--disk-bytes", "0")
    daemon.start()
    with_gpu = parse_size(args.gpu_tier_bytes) > 0
    gpu_daemon = DaemonProcess(Path(args.data_dir) / "gpu-level", "--gpu-bytes",
                               args.gpu_tier_bytes, "--gpu-device", args.device,
                               "--host-bytes", args.host_bytes, "--disk-bytes", "0",
                               "--eviction-policy", "lru") if with_gpu else None
    rows: list[dict[str, Any]] = []
    try:
        if gpu_daemon is not None:
            gpu_daemon.start()
        with contextlib.ExitStack() as stack:
            client = stack.enter_context(KVClient(daemon.target, layout, deadline_s=120))
            engine = CachedPrefill(model, client)
            gpu_engine = None
            if gpu_daemon is not None:
                gpu_engine = CachedPrefill(model, stack.enter_context(
                    KVClient(gpu_daemon.target, layout, deadline_s=120)))
            gen = torch.Generator().manual_seed(1)
            warm_up = torch.randint(0, 128256, (1, 512), generator=gen).to(device)
            timed(lambda: model(input_ids=warm_up), device)  # kernels loaded, allocator warm
            for n in tqdm(lengths, desc="lengths"):
                rows.append(one_length(model, engine, client, n, args, rates, gen))
                if gpu_engine is not None:
                    rows[-1].update(gpu_level(gpu_engine, n, args, gen))
                print(table([rows[-1]], list(rows[-1])), flush=True)
    finally:
        daemon.stop(keep_arena=False)
        if gpu_daemon is not None:
            gpu_daemon.stop(keep_arena=False)
    columns = ["prefix_tokens", "recompute_s", "warm_host_s", "warm_one_launch_s",
               "warm_torch_copy_s",
               *(f"warm_{m}_s" for m in load_modes(args) if m.startswith("groups")), "floor_s",
               "floor_pageable_s", "warm_over_floor", "lookup_s", "fetch_s", "hbm_best_s",
               "warm_gpu_tier_s", "fetch_gpu_tier_s", "gpu_tier_hits_per_prefill",
               "gpu_tier_same_split",
               "speedup", "suffix_s", "kv_gib", "bitwise_same_split", "max_abs_vs_recompute",
               "argmax_equal"]
    print(table(rows, columns))
    path = write_results(args.out, {"device": torch.cuda.get_device_name(device)
                                    if device.type == "cuda" else "cpu",
                                    "h2d_GBps": rates, "rows": rows, "args": vars(args)})
    print(f"wrote {path}")


LoadMode = tuple[str, int, bool, int, int]
DEFAULTS: LoadMode = (hf.CUDA_LOAD, hf.CUDA_LOAD_GROUPS, hf.CUDA_LOAD_PRIORITY,
                      hf.CUDA_LOAD_CTAS, hf.CUDA_LOAD_GROUPED_BYTES)


def set_load_mode(mode: LoadMode) -> None:
    (hf.CUDA_LOAD, hf.CUDA_LOAD_GROUPS, hf.CUDA_LOAD_PRIORITY, hf.CUDA_LOAD_CTAS,
     hf.CUDA_LOAD_GROUPED_BYTES) = mode


def load_modes(args: argparse.Namespace) -> dict[str, LoadMode]:
    """Each way a warm load is timed: (hf.CUDA_LOAD, CUDA_LOAD_GROUPS, CUDA_LOAD_PRIORITY,
    CUDA_LOAD_CTAS, CUDA_LOAD_GROUPED_BYTES). "default": hf's defaults, what a user gets
    (`warm_host_s`); "kernel": the copy kernel in one launch; "torch": torch's copies;
    "groupsN": the kernel in N groups of layers on a side stream beside the forward, at every
    size, the forward on a high-priority stream, each group's grid capped at
    `CUDA_LOAD_CTAS` CTAs; "_flat": neither (the forward on the caller's stream, a CTA per
    unit); "groups4_ctasC": 4 groups capped at C CTAs (`--ctas-sweep`)."""
    ctas = DEFAULTS[3]
    modes = {"default": DEFAULTS, "kernel": ("kernel", 1, True, ctas, 0),
             "torch": ("torch", 1, True, ctas, 0),
             "groups4": ("kernel", 4, True, ctas, 0), "groups8": ("kernel", 8, True, ctas, 0),
             "groups4_flat": ("kernel", 4, False, 0, 0),
             "groups8_flat": ("kernel", 8, False, 0, 0)}
    for c in (int(x) for x in args.ctas_sweep.split(",") if x):
        modes[f"groups4_ctas{c}"] = ("kernel", 4, True, c, 0)
    return modes


def one_length(model: Any, engine: CachedPrefill, client: KVClient, n: int,
               args: argparse.Namespace, rates: dict[str, float],
               gen: torch.Generator) -> dict[str, Any]:
    device = torch.device(args.device)
    client.clear()
    prompt = torch.randint(0, 128256, (1, n + args.suffix), generator=gen).to(device)
    full = [timed(lambda: model(input_ids=prompt, logits_to_keep=1), device)
            for _ in range(args.repeats)]
    recompute_s = statistics.median(t for t, _ in full)
    ref_logits = full[-1][1].logits[0, -1].float()
    del full

    cold = engine.prefill(prompt)  # computes and publishes
    require(cold.cached_tokens == 0, f"{n}: the first prefill was not cold")
    require(cold.published_tokens >= n, f"{n}: published {cold.published_tokens} of {n}")
    del cold
    warm_s, warm_logits = {}, {}
    for mode, setting in load_modes(args).items():
        set_load_mode(setting)
        times = []
        for _ in range(args.repeats):
            r = engine.prefill(prompt, publish=False)
            require(r.cached_tokens == n, f"{n}: warm prefill loaded {r.cached_tokens} tokens")
            times.append(r.ttft_s)
            warm_logits[mode] = r.logits
            del r
        warm_s[mode] = statistics.median(times)
    set_load_mode(DEFAULTS)
    profile(engine, prompt, args, f"{n}_host")
    if args.profile and prompt.is_cuda:  # how the grouped load's kernels meet the forward's
        set_load_mode(load_modes(args)["groups4"])
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
            engine.prefill(prompt, publish=False)
        p.export_chrome_trace(str(Path(args.profile) / f"{n}_host_groups4.trace.json"))
        set_load_mode(DEFAULTS)
    # Where a warm prefill's time goes: the lookup (hashing and one call), then the fetch
    # alone into a CUDA cache (the copy kernel), each the median of `repeats`.
    ids = prompt[0, : n + args.suffix - 1].cpu()
    lookup_s = statistics.median(timed(lambda: client.lookup(ids), device)[0]
                                 for _ in range(args.repeats))
    fetch_s = fetch_alone(client, prompt, n, args)

    # The same split computed by the model itself: prefix forward, suffix over its cache.
    cache = hf.run_model(model, prompt[:, :n], last_logits_only=True)[1]
    hbm: torch.Tensor | None = in_device_memory(cache, client.layout, n)  # (CPU: a smoke test)
    suffix_s, (out, _) = timed(lambda: hf.run_model(model, prompt[:, n:], cache,
                                                    last_logits_only=True), device)
    own_logits = out.logits[0, -1].float()
    del out
    hbm_s, hbm_same = float("nan"), None
    if hbm is not None:
        times = []
        for _ in range(args.repeats):
            t, logits = timed(lambda: from_device_memory(model, hbm, prompt, n,
                                                         client.layout), device)
            times.append(t)
            hbm_same = torch.equal(logits, own_logits) if hbm_same in (None, True) else False
        hbm_s = statistics.median(times)
        del hbm
    kv_bytes = n * client.layout.block_bytes // client.layout.block_tokens
    def floor(kind: str) -> float:
        rate = rates.get(kind, 0.0)
        return suffix_s + (kv_bytes / (rate * 1e9) if rate else 0.0)

    best = min(warm_s.values())
    return {"prefix_tokens": n, "recompute_s": recompute_s,
            "warm_host_s": warm_s["default"], "warm_one_launch_s": warm_s["kernel"],
            "warm_torch_copy_s": warm_s["torch"],
            **{f"warm_{m}_s": t for m, t in warm_s.items() if m.startswith("groups")},
            "floor_s": floor("pinned"), "warm_over_floor": warm_s["default"] / floor("pinned"),
            "floor_pageable_s": floor("pageable"),
            "speedup": recompute_s / warm_s["default"], "best_warm_s": best,
            "suffix_s": suffix_s, "lookup_s": lookup_s, "fetch_s": fetch_s,
            "hbm_best_s": hbm_s, "hbm_bitwise_same_split": hbm_same,
            "kv_gib": kv_bytes / 2**30,
            "bitwise_same_split": all(torch.equal(x, own_logits) for x in warm_logits.values()),
            "max_abs_vs_recompute": max(float((x - ref_logits).abs().max())
                                        for x in warm_logits.values()),
            "argmax_equal": all(bool(x.argmax() == ref_logits.argmax())
                                for x in warm_logits.values())}


def fetch_alone(client: KVClient, prompt: torch.Tensor, n: int,
                args: argparse.Namespace) -> float:
    """The fetch of the prompt's `n` cached tokens alone into a CUDA cache (the copy kernel),
    median of `repeats`."""
    device = torch.device(args.device)
    ids = prompt[0, : n + args.suffix - 1].cpu()
    blocks = n // client.layout.block_tokens
    return statistics.median(
        timed(lambda: hf.fetch_cache(client, ids, blocks, device=device), device)[0]
        for _ in range(args.repeats))


def profile(engine: CachedPrefill, prompt: torch.Tensor, args: argparse.Namespace,
            name: str) -> None:
    """With `--profile DIR`, where a warm prefill's time goes, client side: `repeats` warm
    prefills under cProfile (the calling thread: its 40 costliest calls by cumulative time in
    DIR/NAME.txt), then under torch's profiler (every thread's torch calls and the device's
    kernels and copies: DIR/NAME.torch.txt, and a Chrome trace DIR/NAME.trace.json)."""
    if not args.profile:
        return
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    out = Path(args.profile)
    out.mkdir(parents=True, exist_ok=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.repeats):
        engine.prefill(prompt, publish=False)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
    (out / f"{name}.txt").write_text(text.getvalue())
    cuda = prompt.device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with torch_profile(activities=activities) as traced:
        for _ in range(args.repeats):
            engine.prefill(prompt, publish=False)
    by = "cuda_time_total" if cuda else "cpu_time_total"
    (out / f"{name}.torch.txt").write_text(traced.key_averages().table(sort_by=by,
                                                                        row_limit=40))
    traced.export_chrome_trace(str(out / f"{name}.trace.json"))


def gpu_level(engine: CachedPrefill, n: int, args: argparse.Namespace,
              gen: torch.Generator) -> dict[str, Any]:
    """Warm prefills served from the daemon's gpu level, mapped by CUDA IPC: publish (cold),
    one warm prefill from host (which lifts the prefix into gpu), wait for the lift, then
    `repeats` timed warm prefills, their gpu hits counted. The logits are compared with the
    model's own split, bit for bit."""
    device = torch.device(args.device)
    client = engine.client
    client.clear()
    prompt = torch.randint(0, 128256, (1, n + args.suffix), generator=gen).to(device)
    require(engine.prefill(prompt).published_tokens >= n, f"{n}: gpu daemon publish")
    require(engine.prefill(prompt, publish=False).cached_tokens == n, f"{n}: from host")
    blocks = n // client.layout.block_tokens

    def gpu_stats() -> Any:
        reply = client.stats()
        require(reply is not None, "the gpu daemon answered no Stats")
        return next(t for t in reply.tiers if t.name == "gpu")

    deadline = time.monotonic() + 60
    while gpu_stats().blocks < blocks and time.monotonic() < deadline:
        time.sleep(0.05)  # the lift runs after the fetch answered
    lifted = gpu_stats().blocks
    require(lifted >= blocks, f"{n}: {lifted} of {blocks} blocks lifted into the gpu level")
    slab = client._aio._slab
    require(slab is not None, f"{n}: the client does not map the gpu slab")
    hits = gpu_stats().hits
    times, logits = [], None
    for _ in range(args.repeats):
        r = engine.prefill(prompt, publish=False)
        require(r.cached_tokens == n, f"{n}: gpu-level prefill loaded {r.cached_tokens}")
        times.append(r.ttft_s)
        logits = r.logits
    served = gpu_stats().hits - hits
    fetch_s = fetch_alone(client, prompt, n, args)
    profile(engine, prompt, args, f"{n}_gpu_level")
    cache = hf.run_model(engine.model, prompt[:, :n], last_logits_only=True)[1]
    own = hf.run_model(engine.model, prompt[:, n:], cache, last_logits_only=True)[0]
    return {"warm_gpu_tier_s": statistics.median(times), "fetch_gpu_tier_s": fetch_s,
            "gpu_tier_hits_per_prefill": served / args.repeats,
            "gpu_tier_same_split": bool(logits is not None and torch.equal(
                logits, own.logits[0, -1].float())),
            "gpu_slab_on": str(slab.tensor.device) if slab is not None else ""}


if __name__ == "__main__":
    main()
