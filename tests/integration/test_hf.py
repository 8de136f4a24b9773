"""transformers + kvstore: identical outputs with the cache, and only the suffix computed."""

from __future__ import annotations

import time

import pytest
import torch

from kvstore import InvalidArgumentError
from kvstore.client import KVClient
from kvstore.client.integrations.hf import (
    CachedPrefill,
    PrefillResult,
    layout_for_model,
    run_model,
)

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytestmark = pytest.mark.integration


def tiny_llama(dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=1024, name_or_path="tiny-llama")
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).to(dtype).eval()


class TokenCounter:
    """Counts the tokens that reach the model's forward pass."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.tokens = 0
        model.model.embed_tokens.register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        self.tokens += args[0].numel()


@torch.inference_mode()
def reference(model: torch.nn.Module, ids: torch.Tensor, steps: int) -> tuple[torch.Tensor,
                                                                               list[int]]:
    out, cache = run_model(model, ids, last_logits_only=True)
    logits = out.logits[0, -1].float()
    first, tokens = logits, []
    for _ in range(steps):
        nxt = int(torch.argmax(logits))
        tokens.append(nxt)
        out, cache = run_model(model, torch.tensor([[nxt]]), cache)
        logits = out.logits[0, -1].float()
    # A random model whose greedy output is one repeated token makes "same tokens" prove
    # nothing: refuse it (raise initializer_range in its config).
    assert steps < 16 or len(set(tokens[:16])) > 1, f"degenerate test model: {tokens[:16]}"
    return first, tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_prefill_matches_recompute(daemon, dtype):
    model = tiny_llama(dtype)
    layout = layout_for_model(model, block_tokens=32)
    ids = torch.randint(0, 512, (1, 200), generator=torch.Generator().manual_seed(3))
    want_logits, want_tokens = reference(model, ids, 32)
    counter = TokenCounter(model)
    with KVClient(daemon.target, layout) as c:
        engine = CachedPrefill(model, c)
        cold_tokens, cold = engine.generate(ids, 32)
        assert cold.cached_tokens == 0
        assert cold.published_tokens == 192  # 6 full blocks of 32
        counter.tokens = 0
        warm_tokens, warm = engine.generate(ids, 32)
        assert warm.cached_tokens == 192
        assert warm.computed_tokens == 8
        assert counter.tokens == 8 + 32  # the suffix, then one token per decoding step
        # The loaded cache was allocated with room for the prompt and the 32 decoded tokens:
        # every forward appended in place, no buffer outgrown and copied (a view's head
        # stride is its buffer's capacity x head_dim).
        keys = warm.cache.layers[0].keys
        assert keys.shape[-2] == 200 + 32 and keys.stride(1) == (200 + 32) * keys.shape[-1]
    for r in (cold, warm):
        assert (r.logits - want_logits).abs().max().item() == 0.0
    assert cold_tokens == want_tokens
    assert warm_tokens == want_tokens


class SlowCopies:
    """Wraps a `KVClient`: each `fetch_with` copy starts `delay_s` late, and the first
    `short` fetches report one block fewer than they copied, its bytes NaN (a block evicted
    between the lookup and the fetch)."""

    def __init__(self, client: KVClient, delay_s: float = 0.0, short: int = 0) -> None:
        self._client, self._delay_s, self._short = client, delay_s, short

    def __getattr__(self, name: str) -> object:
        return getattr(self._client, name)

    def fetch_with(self, tokens, consume, **kwargs) -> int:
        short = self._short > 0
        self._short -= 1

        def slow(indices, views, stop):
            time.sleep(self._delay_s)
            if short:
                views = [*views[:-1], torch.full_like(views[-1], float("nan"))]
            return consume(indices, views, stop)

        end = self._client.fetch_with(tokens, slow, **kwargs)
        return end - self._client.layout.block_tokens if short and end else end


def warm_through(daemon, seed: int, **copies: float) -> tuple[PrefillResult, torch.Tensor]:
    """A 200-token prompt published, then prefilled again through `SlowCopies(**copies)`;
    returns that prefill and the recomputed logits."""
    model = tiny_llama(torch.float32)
    layout = layout_for_model(model, block_tokens=32)
    ids = torch.randint(0, 512, (1, 200), generator=torch.Generator().manual_seed(seed))
    want, _ = reference(model, ids, 0)
    with KVClient(daemon.target, layout) as c:
        CachedPrefill(model, c).prefill(ids)
        slow = SlowCopies(c, **copies)  # type: ignore[arg-type]
        return CachedPrefill(model, slow).prefill(ids), want  # type: ignore[arg-type]


def test_forward_waits_for_each_layer_of_a_load_still_copying(daemon):
    """The load runs beside the forward, layer by layer: a copy that starts 0.3 s late must
    hold each layer's attention until its K/V are in (else it reads empty memory)."""
    r, want = warm_through(daemon, 9, delay_s=0.3)
    assert r.cached_tokens == 192 and r.ttft_s >= 0.3
    assert torch.allclose(r.logits, want, atol=1e-5, rtol=0)


def test_a_load_that_brings_less_than_its_lookup_is_redone(daemon):
    """The fetch reports a block fewer than the lookup found (its bytes NaN): the forward that
    ran beside it is thrown away, the prefix loaded again, and the logits are right."""
    r, want = warm_through(daemon, 10, short=1)
    assert r.cached_tokens == 192  # the second load brought it all
    assert not torch.isnan(r.logits).any()
    assert torch.allclose(r.logits, want, atol=1e-5, rtol=0)


def test_a_load_that_fails_is_recomputed_and_logged(daemon, monkeypatch, caplog):
    """The copy itself raises (as the CUDA copy did on a thread with no CUDA context, on the
    H200 of 2026-11-30): the prefill recomputes with the right logits, and the failure is a
    warning an operator sees, not a silent miss on every request."""
    from kvstore.client.integrations import hf

    def broken(*args, **kwargs):
        raise RuntimeError("copy path broken")
    monkeypatch.setattr(hf, "_copy_in", broken)  # a fault this machine cannot cause
    with caplog.at_level("WARNING", logger=hf.log.name):
        r, want = warm_through(daemon, 11)
    assert r.cached_tokens == 0 and r.computed_tokens == 200
    assert torch.allclose(r.logits, want, atol=1e-5, rtol=0)
    assert "copy path broken" in caplog.text and "recomputing" in caplog.text


def test_a_load_path_broken_for_good_warns_once_then_summarises(daemon, monkeypatch, caplog):
    """Every load fails (a device fault that stays): each prefill recomputes correctly, the
    first failure is a warning, the rest are counted and summarised once the interval passed,
    not one warning per request."""
    from kvstore.client.integrations import hf

    def broken(*args, **kwargs):
        raise RuntimeError("copy path broken")
    monkeypatch.setattr(hf, "_copy_in", broken)
    model = tiny_llama(torch.float32)
    layout = layout_for_model(model, block_tokens=32)
    ids = torch.randint(0, 512, (1, 200), generator=torch.Generator().manual_seed(12))
    want, _ = reference(model, ids, 0)
    with KVClient(daemon.target, layout) as c:
        engine = CachedPrefill(model, c)
        engine.prefill(ids)  # cold: computes and publishes
        with caplog.at_level("WARNING", logger=hf.log.name):
            for _ in range(4):
                r = engine.prefill(ids, publish=False)
                assert r.cached_tokens == 0
                assert torch.allclose(r.logits, want, atol=1e-5, rtol=0)
            assert engine.load_failures == 4
            assert len(caplog.records) == 1 and "copy path broken" in caplog.text
            engine._failures.every_s = 0.0  # the interval has passed
            engine.prefill(ids, publish=False)
    assert len(caplog.records) == 2
    assert "4 loads failed" in caplog.records[1].getMessage()
    assert "5 in all" in caplog.records[1].getMessage()


def test_reserved_buffers_serve_warm_prefills_and_never_a_held_cache(daemon):
    """`reserve_tokens`: warm prefills load into memory touched up front; a cache the caller
    still holds is never overwritten by the next load (that one gets fresh memory), and a
    prompt larger than the reserve loads as before. Outputs equal recompute throughout."""
    model = tiny_llama(torch.float32)
    layout = layout_for_model(model, block_tokens=32)
    g = torch.Generator().manual_seed(11)
    a, b = (torch.randint(0, 512, (1, 150), generator=g) for _ in range(2))
    big = torch.randint(0, 512, (1, 300), generator=g)
    with KVClient(daemon.target, layout) as c:
        engine = CachedPrefill(model, c, reserve_tokens=200)
        assert engine.buffers is not None
        memory = engine.buffers.take(1)
        assert memory is not None
        start = memory[0][0].data_ptr()
        end = start + engine.buffers.nbytes
        del memory

        def in_reserve(r) -> bool:
            return start <= r.cache.layers[0].keys.data_ptr() < end

        for ids in (a, b, big):
            engine.prefill(ids)  # cold: computes and publishes
        first = engine.prefill(a)
        assert first.cached_tokens == 128 and in_reserve(first)
        held = [layer.keys.clone() for layer in first.cache.layers]
        second = engine.prefill(b)  # the reserve is held by `first`
        assert second.cached_tokens == 128 and not in_reserve(second)
        assert all(torch.equal(layer.keys, k) for layer, k in
                   zip(first.cache.layers, held, strict=True))
        del first
        third = engine.prefill(b)
        assert in_reserve(third)
        larger = engine.prefill(big)
        assert larger.cached_tokens == 288 and not in_reserve(larger)
    for ids, r in ((b, second), (b, third), (big, larger)):
        want, _ = reference(model, ids, 0)
        assert torch.allclose(r.logits, want, atol=1e-5, rtol=0)


def test_second_request_runs_only_its_suffix(daemon):
    model = tiny_llama(torch.float32)
    layout = layout_for_model(model, block_tokens=32)
    g = torch.Generator().manual_seed(5)
    system = torch.randint(0, 512, (1, 128), generator=g)  # a shared 4-block prefix
    a = torch.cat([system, torch.randint(0, 512, (1, 50), generator=g)], dim=1)
    b = torch.cat([system, torch.randint(0, 512, (1, 70), generator=g)], dim=1)
    counter = TokenCounter(model)
    with KVClient(daemon.target, layout) as c:
        engine = CachedPrefill(model, c)
        engine.prefill(a)
        counter.tokens = 0
        r = engine.prefill(b)
    assert r.cached_tokens == 128
    assert counter.tokens == 70
    # Bit-exact against the same split without kvstore: the model's own K/V for the prefix,
    # then the suffix. (A single full prefill differs in the last float bits, ~1e-7: its
    # attention reduces over the 198 queries in another order. That is the engine's split,
    # not the cache: the cached K/V bytes are the ones the prefix pass produced.)
    with torch.inference_mode():
        prefix = run_model(model, b[:, :128])[1]
        split = run_model(model, b[:, 128:], prefix, last_logits_only=True)[0].logits[0, -1].float()
    assert (r.logits - split).abs().max().item() == 0.0
    full, _ = reference(model, b, 0)
    assert torch.allclose(r.logits, full, atol=1e-5, rtol=0)


def test_end_session_marks_the_conversations_own_blocks(daemon):
    model = tiny_llama(torch.float32)
    layout = layout_for_model(model, block_tokens=32)
    g = torch.Generator().manual_seed(6)
    system = torch.randint(0, 512, (1, 128), generator=g)  # 4 blocks both conversations share
    a = torch.cat([system, torch.randint(0, 512, (1, 50), generator=g)], dim=1)  # 5 full
    b = torch.cat([system, torch.randint(0, 512, (1, 70), generator=g)], dim=1)
    with KVClient(daemon.target, layout) as c:
        engine = CachedPrefill(model, c)
        engine.prefill(a)
        engine.prefill(b)
        # a's own block only: the system prompt's blocks are b's too. Counted once in host,
        # and once more if the disk tier holds a copy by then (written in the background).
        marked = engine.end_session(a)
        stats = c.stats()
        assert stats is not None
        assert marked == stats.session_blocks_marked and marked in (1, 2), marked
        with pytest.raises(InvalidArgumentError, match=r"\[1, n\]"):
            engine.end_session(a[0])
        # The hint changes no output: the conversation's blocks still load, identically.
        r = engine.prefill(a, publish=False)
        assert r.cached_tokens == 160
        expected, _ = reference(model, a, 0)
        assert torch.allclose(r.logits, expected, atol=1e-5, rtol=0)


def test_other_weights_are_a_miss(daemon):
    """Blocks of one model revision are never served to another."""
    a, b = tiny_llama(torch.float32, seed=0), tiny_llama(torch.float32, seed=1)
    ids = torch.randint(0, 512, (1, 100), generator=torch.Generator().manual_seed(7))
    with KVClient(daemon.target, layout_for_model(a, 32, revision="v1")) as c:
        CachedPrefill(a, c).prefill(ids)
    with KVClient(daemon.target, layout_for_model(b, 32, revision="v2")) as c:
        r = CachedPrefill(b, c).prefill(ids)
    assert r.cached_tokens == 0
    want, _ = reference(b, ids, 0)
    assert (r.logits - want).abs().max().item() == 0.0


def test_daemon_down_still_generates(tmp_path):
    model = tiny_llama(torch.float32)
    ids = torch.randint(0, 512, (1, 80), generator=torch.Generator().manual_seed(9))
    with KVClient(f"unix://{tmp_path}/none.sock", layout_for_model(model, 32),
                  deadline_s=0.3) as c:
        tokens, r = CachedPrefill(model, c).generate(ids, 8)
    assert r.cached_tokens == 0
    assert tokens == reference(model, ids, 8)[1]


@torch.inference_mode()
def split_logits(model: torch.nn.Module, ids: torch.Tensor, cached: int) -> torch.Tensor:
    """Without kvstore: the K/V of a full pass over `ids` (the pass that published them),
    cut to the first `cached` tokens, then the rest of the prompt over them. A cached prefill
    of `cached` tokens must give exactly these logits."""
    out, cache = run_model(model, ids, last_logits_only=True)
    if cached == 0:
        return out.logits[0, -1].float()
    cache.crop(cached - ids.shape[1])  # a negative count: drop that many tokens at the end
    return run_model(model, ids[:, cached:], cache, last_logits_only=True)[0].logits[0, -1].float()


def test_planner_loads_host_blocks_and_recomputes_slow_disk_ones(daemon_factory):
    """Half the cached prefix in host, half on a stalled disk: the planner loads the host
    half only, and the logits are those of the same split without kvstore."""
    d = daemon_factory("--host-bytes", "8MiB", "--disk-bytes", "32MiB",
                       "--fault-disk-read-delay-s", "0.05").start()
    model = tiny_llama(torch.float32)
    layout = layout_for_model(model, block_tokens=32)
    ids = torch.randint(0, 512, (1, 200), generator=torch.Generator().manual_seed(11))
    with KVClient(d.target, layout) as c:
        assert CachedPrefill(model, c).prefill(ids).published_tokens == 192
    d.stop()  # SIGTERM: every block to disk
    d.start()
    counter = TokenCounter(model)
    with KVClient(d.target, layout) as c:
        assert c.fetch(ids[0], max_blocks=3)[0] == 96  # promoted to host; disk measured
        # 5000 tokens/s: 6.4 ms of compute per 32-token block; the stalled disk (3 blocks of
        # 16 KiB in >= 50 ms) needs >= 16 ms per block, the host tier only the client's copy.
        engine = CachedPrefill(model, c, prefill_tokens_per_s=5000.0)
        counter.tokens = 0
        r = engine.prefill(ids, publish=False)
    assert r.plan is not None
    assert r.plan.tiers == ("host",) * 3
    assert r.cached_tokens == 96
    assert counter.tokens == 200 - 96
    assert (r.logits - split_logits(model, ids, 96)).abs().max().item() == 0.0


def test_planner_recompute_and_online_speed_keep_logits_identical(daemon):
    model = tiny_llama(torch.float32)
    layout = layout_for_model(model, block_tokens=32)
    ids = torch.randint(0, 512, (1, 200), generator=torch.Generator().manual_seed(13))
    want, _ = reference(model, ids, 0)
    with KVClient(daemon.target, layout) as c:
        CachedPrefill(model, c).prefill(ids)  # publish the 6 blocks
        # An engine so fast that no tier beats recomputing: nothing is loaded.
        fast = CachedPrefill(model, c, prefill_tokens_per_s=1e12).prefill(ids, publish=False)
        assert fast.plan is not None and fast.plan.load_blocks == 0
        assert fast.cached_tokens == 0
        assert (fast.logits - want).abs().max().item() == 0.0
        # A slow one loads every block it may.
        slow = CachedPrefill(model, c, prefill_tokens_per_s=1.0).prefill(ids, publish=False)
        assert slow.plan is not None and slow.cached_tokens == 192
        assert (slow.logits - split_logits(model, ids, 192)).abs().max().item() == 0.0
        # "online": no speed until this engine has recomputed a prompt (then: load all)...
        online = CachedPrefill(model, c, prefill_tokens_per_s="online")
        first = online.prefill(ids, publish=False)
        assert first.plan is None and first.cached_tokens == 192
        assert not online.prefill_model.samples  # a cached prefill is not a recompute
        other = torch.randint(0, 512, (1, 150), generator=torch.Generator().manual_seed(14))
        online.prefill(other, publish=False)  # a miss: a full recompute, measured
        assert [n for n, _ in online.prefill_model.samples] == [150]
        r = online.prefill(ids, publish=False)
        assert r.plan is not None  # whatever it chose, the output is the model's own
        assert r.cached_tokens == r.plan.load_tokens
        assert (r.logits - split_logits(model, ids, r.cached_tokens)).abs().max().item() == 0.0
    with pytest.raises(InvalidArgumentError, match="prefill_tokens_per_s"):
        CachedPrefill(model, c, prefill_tokens_per_s=0.0)


@pytest.mark.parametrize("transfer", ["shm", "stream"])
def test_cache_round_trip_is_byte_exact_through_either_transfer(daemon, transfer):
    """`publish_cache` writes a DynamicCache's blocks straight into the daemon, `fetch_cache`
    reads them straight back into a new one: every cached K and V byte-identical, for a hit
    shorter than the prompt too (its tensors are then views of the prompt-sized buffers)."""
    from transformers import DynamicCache

    from kvstore.client.integrations.hf import fetch_cache, publish_cache

    model = tiny_llama(torch.bfloat16)
    layout = layout_for_model(model, block_tokens=32)
    g = torch.Generator().manual_seed(5)
    n = 200  # 6 full blocks and a tail
    kv = [(torch.randn(1, 2, n, 16, generator=g).to(torch.bfloat16),
           torch.randn(1, 2, n, 16, generator=g).to(torch.bfloat16)) for _ in range(2)]
    cache = DynamicCache(ddp_cache_data=kv)
    tokens = torch.arange(n)
    with KVClient(daemon.target, layout, transfer=transfer) as c:
        assert publish_cache(c, tokens[:96], cache) == 96  # 3 blocks first
        longer = torch.cat([tokens, torch.arange(5000, 5100)])
        cached, got = fetch_cache(c, longer)  # asks for 9 blocks, 3 are there
        assert cached == 96
        for (k, v), layer in zip(kv, got.layers, strict=True):
            assert layer.keys.shape == (1, 2, 96, 16)
            assert torch.equal(layer.keys, k[:, :, :96]) and torch.equal(layer.values, v[:, :, :96])
        assert publish_cache(c, tokens[:192], cache) == 192  # the rest of the full blocks
        cached, got = fetch_cache(c, tokens, max_blocks=5)
        assert cached == 160
        assert all(torch.equal(layer.keys, k[:, :, :160]) and torch.equal(layer.values,
                                                                          v[:, :, :160])
                   for (k, v), layer in zip(kv, got.layers, strict=True))
        assert fetch_cache(c, torch.arange(7000, 7100)) == (0, None)  # a miss


def test_warm_prefill_through_a_stream_in_groups_matches_recompute(daemon, monkeypatch):
    """Over TCP (`transfer="stream"`) blocks move in groups (`STREAM_GROUP_BYTES`): a fetch
    hands each to the cache's copy as it arrives, a publish streams each as it is filled. The
    warm prefill through them gives the same logits and greedy tokens, bit for bit."""
    import kvstore.client.aio as aio

    model = tiny_llama(torch.float32)
    layout = layout_for_model(model, block_tokens=32)
    monkeypatch.setattr(aio, "STREAM_GROUP_BYTES", 2 * layout.block_bytes)
    ids = torch.randint(0, 512, (1, 200), generator=torch.Generator().manual_seed(11))
    want_logits, want_tokens = reference(model, ids, 16)
    calls: list[list[int]] = []

    class Counting:
        """The client, its `fetch_with` copies recorded (the blocks of each call)."""

        def __init__(self, client: KVClient) -> None:
            self._client = client

        def __getattr__(self, name: str) -> object:
            return getattr(self._client, name)

        def fetch_with(self, tokens, consume, **kwargs) -> int:
            def counted(indices, views, stop):
                calls.append(list(indices))
                return consume(indices, views, stop)

            return self._client.fetch_with(tokens, counted, **kwargs)

    with KVClient(daemon.target, layout, transfer="stream") as c:
        cold_tokens, cold = CachedPrefill(model, c).generate(ids, 16)
        assert cold.published_tokens == 192
        warm_tokens, warm = CachedPrefill(model, Counting(c)).generate(ids, 16)  # type: ignore[arg-type]
        assert warm.cached_tokens == 192
    assert calls == [[0, 1], [2, 3], [4, 5]]
    assert (warm.logits - want_logits).abs().max().item() == 0.0
    assert warm_tokens == want_tokens == cold_tokens
