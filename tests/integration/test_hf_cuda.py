"""transformers + kvstore with the model on a GPU: the loaded prefix lands in a CUDA cache
(each block crosses in one copy, transposed on the device), and the outputs are the model's
own over the same split, bit for bit. Run on a GPU machine: `pytest -m gpu` (docs/GPU.md)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from kvstore.client import KVClient
from kvstore.client.integrations import hf
from kvstore.client.integrations.hf import CachedPrefill, layout_for_model, run_model
from tests.reliability import stats, tier, wait_quiescent, wait_until

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytestmark = [
    pytest.mark.integration,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]


def llama_on(device: str) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=4096, initializer_range=0.3,
                                   name_or_path="tiny-llama-cuda")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(device, torch.bfloat16).eval()


@torch.inference_mode()
def own_split(model: torch.nn.Module, ids: torch.Tensor, cached: int, steps: int,
              ) -> tuple[torch.Tensor, list[int]]:
    """The model's own computation over the same split: prefix, then suffix, then greedy."""
    out, cache = run_model(model, ids[:, cached:], run_model(model, ids[:, :cached])[1],
                           last_logits_only=True)
    first, logits, tokens = out.logits[0, -1].float(), out.logits[0, -1].float(), []
    for _ in range(steps):
        tokens.append(int(torch.argmax(logits)))
        out, cache = run_model(model, torch.tensor([[tokens[-1]]], device=ids.device), cache)
        logits = out.logits[0, -1].float()
    assert len(set(tokens)) > 1, f"degenerate test model: {tokens}"
    return first, tokens


@pytest.mark.parametrize("reserve", [0, 1200])
@pytest.mark.parametrize("copy", ["kernel", "torch", "kernel-groups", "kernel-groups-flat",
                                  "kernel-groups-fallback"])
def test_warm_prefill_on_cuda_is_the_models_own_split(daemon, reserve, copy, monkeypatch):
    # kernel-groups: the copy kernel in 3 groups of the 4 layers (1, 1, 2) on a side stream,
    # each layer's attention waiting on the device for its own group only; the forward on a
    # high-priority stream (`CUDA_LOAD_PRIORITY`), or on the caller's (-flat). -fallback: the
    # forward on the high-priority stream, the load in one launch on the loading thread's
    # stream (as when a fetch comes in several windows): only the gates' events order them.
    monkeypatch.setattr(hf, "CUDA_LOAD", "torch" if copy == "torch" else "kernel")
    monkeypatch.setattr(hf, "CUDA_LOAD_GROUPS", 3 if copy.startswith("kernel-groups") else 1)
    monkeypatch.setattr(hf, "CUDA_LOAD_GROUPED_BYTES", 0)  # this small prompt's load too
    monkeypatch.setattr(hf, "CUDA_LOAD_PRIORITY", copy != "kernel-groups-flat")
    streams: list[int] = []
    real_forward = hf._forward_stream

    @contextlib.contextmanager
    def forward_stream(device, grouped):
        with real_forward(device, grouped):
            streams.append(torch.cuda.current_stream(device).priority)
            yield
    grouped: list[int | None] = []
    real = hf._kernel_scatter_grouped
    monkeypatch.setattr(hf, "_kernel_scatter_grouped",
                        lambda *a: grouped.append(None if copy.endswith("fallback")
                                                  else real(*a)) or grouped[-1])
    monkeypatch.setattr(hf, "_forward_stream", forward_stream)
    model = llama_on("cuda")
    layout = layout_for_model(model, block_tokens=64)
    ids = torch.randint(0, 512, (1, 1000), generator=torch.Generator().manual_seed(4)).cuda()
    with KVClient(daemon.target, layout) as c:
        engine = CachedPrefill(model, c, reserve_tokens=reserve)
        # A model on a GPU has the daemon's arena pinned in this process: loads are DMA.
        assert c._aio._arena is not None and c._aio._arena.pinned
        cold = engine.prefill(ids)
        assert cold.cached_tokens == 0 and cold.published_tokens == 960
        tokens, warm = engine.generate(ids, 24)
    assert warm.cached_tokens == 960 and warm.computed_tokens == 40
    assert warm.cache.layers[0].keys.is_cuda
    want = {"kernel-groups": [15], "kernel-groups-flat": [15], "kernel-groups-fallback": [None]}
    assert grouped == want.get(copy, [])  # the grouped load ran (or was tried)
    # The warm forward ran on a high-priority stream only with grouped loads and priority.
    high = copy in ("kernel-groups", "kernel-groups-fallback")
    assert len(streams) == 1 and (streams[0] < 0) == high, streams
    want_logits, want_tokens = own_split(model, ids, 960, 24)
    assert torch.equal(warm.logits, want_logits)
    assert tokens == want_tokens
    # The published bytes are the cache's: what came back equals the model's own prefix K/V.
    own = run_model(model, ids[:, :960])[1]
    for got, want in zip(warm.cache.layers, own.layers, strict=True):
        assert torch.equal(got.keys[..., :960, :], want.keys)
        assert torch.equal(got.values[..., :960, :], want.values)


@pytest.mark.parametrize("handover", ["taken-over", "new-arena"])
def test_a_restarted_daemons_arena_is_pinned_again(daemon_factory, handover):
    """After a restart the client's loads are DMA again: an arena the new daemon took over is
    the mapping the client already pinned (no second registration); a new arena
    (`--host-handover-s 0`) is pinned in the background, loads meanwhile from pageable memory."""
    extra = ("--host-handover-s", "0") if handover == "new-arena" else ()
    d = daemon_factory("--host-bytes", "8MiB", "--disk-bytes", "32MiB", *extra,
                       name="restarted").start()
    model = llama_on("cuda")
    layout = layout_for_model(model, block_tokens=64)
    ids = torch.randint(0, 512, (1, 1000), generator=torch.Generator().manual_seed(5)).cuda()
    with KVClient(d.target, layout) as c:
        engine = CachedPrefill(model, c)
        first = c._aio._arena
        assert first is not None and first.pinned
        assert engine.prefill(ids).published_tokens == 960
        assert d.stop() == 0  # the flush writes the blocks to disk
        d.start()
        warm = engine.prefill(ids, publish=False)  # from disk, through the (new) arena
        assert warm.cached_tokens == 960
        new = c._aio._arena
        assert new is not None
        if handover == "taken-over":
            assert new is first and new.pinned  # still registered: nothing to wait for
        else:
            assert new is not first
            wait_until(lambda: new.pinned, 60, "the new arena pinned in the background")
        again = engine.prefill(ids, publish=False)  # out of the pinned arena, by the kernel
        assert again.cached_tokens == 960
    with torch.inference_mode():
        cache = run_model(model, ids[:, :960])[1]
        want = run_model(model, ids[:, 960:], cache, last_logits_only=True)[0].logits[0, -1].float()
    assert torch.equal(warm.logits, want) and torch.equal(again.logits, want)
    del first  # its mapping is unregistered, then unmapped, on the unmap thread
    assert d.stop(keep_arena=False) == 0


@pytest.mark.parametrize("copy", ["kernel", "torch"])
def test_blocks_only_the_gpu_level_holds_load_from_its_slab_by_cuda_ipc(daemon_factory, copy,
                                                                         monkeypatch):
    """The daemon's gpu level on this GPU, mapped by the client through CUDA IPC: a prefix
    host no longer holds loads from the slab (device to device), and the outputs are the
    model's own over the same split, bit for bit."""
    monkeypatch.setattr(hf, "CUDA_LOAD", copy)
    model = llama_on("cuda")
    layout = layout_for_model(model, block_tokens=64)
    room = 16 * layout.block_bytes  # one 960-token prompt (15 blocks) and one block more
    d = daemon_factory("--gpu-bytes", str(room), "--gpu-device", "cuda", "--host-bytes",
                       str(room), "--disk-bytes", "64MiB", "--eviction-policy", "lru",
                       name="slab").start()
    gen = torch.Generator().manual_seed(6)
    ids, other = (torch.randint(0, 512, (1, 1000), generator=gen).cuda() for _ in range(2))
    with KVClient(d.target, layout) as c:
        engine = CachedPrefill(model, c)
        assert engine.prefill(ids).published_tokens == 960
        assert engine.prefill(ids).cached_tokens == 960  # from host, then lifted into gpu
        wait_until(lambda: tier(stats(d.target), "gpu").blocks == 15, 20, "the lift")
        wait_quiescent(d.target, 10)
        assert engine.prefill(other).published_tokens == 960  # pushes `ids` out of host
        assert c._aio._slab is not None and c._aio._slab.tensor.is_cuda  # by CUDA IPC
        hits = tier(stats(d.target), "gpu").hits
        tokens, warm = engine.generate(ids, 24)
    assert warm.cached_tokens == 960
    assert tier(stats(d.target), "gpu").hits - hits >= 14  # served from the slab
    want_logits, want_tokens = own_split(model, ids, 960, 24)
    assert torch.equal(warm.logits, want_logits)
    assert tokens == want_tokens
    d.stop()
