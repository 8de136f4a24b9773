"""Helpers shared by the demo and the benchmarks: test models, tables, result files."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def llama_8b_kv_shaped(num_layers: int = 32, vocab: int = 32000, seed: int = 0,
                       dtype: torch.dtype = torch.bfloat16) -> Any:
    """A random-weight Llama with Llama-3-8B's KV shape (8 KV heads x 128 dims per layer, so
    128 KiB of KV per token at 32 layers) and tiny compute, built locally: no model hub."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=256,
                      num_hidden_layers=num_layers, num_attention_heads=8,
                      num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
                      # Far wider than transformers' 0.02, so greedy outputs depend on the
                      # prompt: at 0.1 this shape still answered 5 of 6 random 128-token
                      # prompts with one token repeated 16 times; at 0.3, none.
                      initializer_range=0.3, name_or_path="kvstore-demo/llama-8b-kv-shaped")
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def require(ok: object, what: str) -> None:
    """A benchmark's correctness check: unlike `assert`, it stays under `python -O`."""
    if not ok:
        raise RuntimeError(what)


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    cells = [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    head = "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))
    lines = [head, "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def write_results(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": name, "when": time.strftime("%Y-%m-%d %H:%M:%S"),
               "machine": {"cpus": torch.get_num_threads(), "platform": platform.platform()},
               **payload}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path


def figure(width: float = 6.5, height: float = 3.2) -> tuple[Any, Any]:
    """A matplotlib figure and axes on the file-only Agg backend (no display here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(width, height))


def save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def barh(path: Path, labels: list[str], values: list[float], notes: list[str], colors: list[str],
         xlabel: str, title: str, width: float = 6.5) -> None:
    """A horizontal bar per row, annotated, largest value given 35% headroom for its note."""
    fig, ax = figure(width)
    ax.barh(labels, values, color=colors)
    for i, (v, note) in enumerate(zip(values, notes, strict=True)):
        ax.text(v, i, f" {note}", va="center")
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.set_xlim(0, max(values) * 1.35)
    save(fig, path)


def flush_budget_s(host_bytes: int) -> int:
    """A `--shutdown-flush-s` that lets a restarted daemon's SIGTERM flush write a full host
    tier of `host_bytes` (20 MiB/s at worst); the default 10 s cut the oldest prompts of a
    4 GiB host tier here, and the disk rows after it recomputed."""
    return 30 + host_bytes // (20 << 20)


def drop_page_cache(path: Path | str) -> None:
    """Write a file's dirty pages, then drop its page cache: the next read comes from the disk,
    as a disk tier's file is read before each disk fetch. (Torch and the standard library
    only: the LMCache worker of `alternatives` imports this under its own venv.)"""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def wait_arena_prefaulted(target: str, timeout_s: float = 600.0) -> float:
    """Wait until the daemon at `target` has backed its whole host arena (`host_prefault`):
    the state of a daemon started ahead of its traffic. Returns the seconds waited."""
    import grpc

    from kvstore.proto import kvstore_pb2 as pb
    from kvstore.proto import kvstore_pb2_grpc as pb_grpc

    began = time.monotonic()
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        size = stub.Info(pb.InfoRequest(), timeout=30).arena_bytes
        while stub.Stats(pb.StatsRequest(), timeout=30).host_prefaulted_bytes < size:
            if time.monotonic() - began > timeout_s:
                raise RuntimeError(f"the daemon's arena was not prefaulted within {timeout_s} s "
                                   "(is host_prefault off?)")
            time.sleep(0.05)
    return time.monotonic() - began
