"""The C copy routine of vLLM CPU caches (`client/integrations/vllm_cpu_copy.c`) against an
index-by-index reference and against its torch twin: every element size it vectorises (4, 2
and 1 byte: fp8 caches), odd shapes that
take its element-by-element path, partial pages, block views with arena strides, bounds."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from kvstore.client.integrations import paged
from kvstore.client.integrations.paged import PagedCache

needs_native = pytest.mark.skipif(paged.native_copy() is None,
                                  reason="no C compiler: the torch copy is used instead")


def reference_pages(kv: torch.Tensor, pages: list[int], num_pages: int, ps: int,
                    count: int | None = None, fill: float = 7.0) -> list[torch.Tensor]:
    """vLLM "vec" caches holding `kv`'s tokens in `pages`: per (page, head), K as
    `[head_dim, ps]` then V as `[ps, head_dim]`; other slots hold `fill`."""
    layers, _, tokens, heads, dim = kv.shape
    count = tokens if count is None else count
    out = []
    for layer in range(layers):
        t = torch.full((num_pages, heads, 2, ps * dim), fill, dtype=kv.dtype)
        for token in range(count):
            page, slot = pages[token // ps], token % ps
            k = t[page, :, 0].view(heads, dim, ps)
            v = t[page, :, 1].view(heads, ps, dim)
            k[:, :, slot] = kv[layer, 0, token]
            v[:, slot, :] = kv[layer, 1, token]
        out.append(t.view(num_pages, heads, ps, 2 * dim))
    return out


def random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:  # an fp8 cache's bytes, as vLLM allocates it: every value
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    return torch.randn(shape, generator=g).to(dtype)


CASES = [  # (dtype, layers, heads, head_dim, page size): SSE tiles, and odd shapes
    (torch.bfloat16, 3, 2, 128, 32),
    (torch.float16, 2, 3, 64, 16),
    (torch.float32, 2, 2, 16, 8),
    (torch.float32, 2, 1, 6, 5),  # no whole tile: element by element
    (torch.bfloat16, 1, 2, 12, 12),  # tiles plus remainders
    (torch.float32, 2, 3, 12, 40),  # 16-token strips, the last one short (5 tokens when partial)
    (torch.bfloat16, 1, 2, 64, 48),  # 32-token strips: one whole, one short
    (torch.float32, 2, 2, 6, 32),  # a load's streamed K strips, columns past the tiles
    (torch.bfloat16, 1, 2, 20, 64),  # the same in 16-bit
    (torch.float32, 1, 2, 8, 18),  # whole strips, page rows of 72 bytes: not streamed
    (torch.float16, 1, 1, 16, 36),  # the same in 16-bit
    (torch.uint8, 2, 2, 64, 128),  # bytes (fp8 caches): 16x16 tiles, 64-token strips
    (torch.uint8, 1, 3, 40, 24),  # bytes: tiles plus remainders, a short strip
    (torch.uint8, 1, 2, 16, 72),  # bytes: one whole strip, page rows of 72 bytes
]


@needs_native
@pytest.mark.parametrize(("dtype", "layers", "heads", "dim", "ps"), CASES)
@pytest.mark.parametrize("native", [True, False])
def test_scatter_then_gather_matches_reference(dtype, layers, heads, dim, ps, native,
                                               monkeypatch) -> None:
    if not native:
        monkeypatch.setenv(paged.NATIVE_ENV, "0")
    pages = [5, 0, 3]
    kv = random((layers, 2, len(pages) * ps, heads, dim), dtype, seed=1)
    want = reference_pages(kv, pages, 7, ps)
    got = [torch.full_like(t, 7.0) for t in want]
    cache = PagedCache.vllm_cpu(got, "vec")
    cache.scatter(kv, pages, 0)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert torch.equal(cache.gather(pages), kv)


@needs_native
@pytest.mark.parametrize(("dtype", "layers", "heads", "dim", "ps"), CASES)
def test_partial_last_page_writes_only_its_first_slots(dtype, layers, heads, dim, ps,
                                                       monkeypatch) -> None:
    pages = [2, 4]
    count = ps + ps // 2 + 1 if ps > 2 else ps + 1
    kv = random((layers, 2, 2 * ps, heads, dim), dtype, seed=2)
    want = reference_pages(kv, pages, 6, ps, count=count)
    for native in ("1", "0"):
        monkeypatch.setenv(paged.NATIVE_ENV, native)
        got = [torch.full_like(t, 7.0) for t in want]
        cache = PagedCache.vllm_cpu(got, "vec")
        cache.scatter_views([(kv, 0, pages, count)])
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), f"native={native}"
        back = torch.zeros_like(kv)
        cache.gather_views([(back, 0, pages, count)])
        assert torch.equal(back[:, :, :count], kv[:, :, :count])
        assert not back[:, :, count:].any()


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_layers_off_16_byte_alignment(dtype) -> None:
    """Cache layers, and a KV tensor, that start one element past an aligned address (views
    into a larger buffer): no streaming stores there (they need 16-byte alignment), and both
    directions still copy every element."""
    layers, heads, dim, ps = 2, 2, 16, 64
    pages = [2, 0]
    kv = random((layers, 2, 2 * ps, heads, dim), dtype, seed=6)
    want = reference_pages(kv, pages, 3, ps)
    got = []
    for w in want:
        backing = torch.full((w.numel() + 1,), 7.0, dtype=dtype)
        got.append(backing[1:].view(w.shape))
        assert got[-1].data_ptr() % 16 != 0
    cache = PagedCache.vllm_cpu(got, "vec")
    cache.scatter(kv, pages, 0)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    back = torch.zeros(kv.numel() + 1, dtype=dtype)[1:].view(kv.shape)
    cache.gather_views([(back, 0, pages)])
    assert torch.equal(back, kv)


@needs_native
def test_block_views_with_arena_strides_and_offsets() -> None:
    """Blocks as the daemon's arena holds them (`[layers, kv, block_tokens, heads, dim]`
    each, contiguous), a load that starts inside the first block, mixed with a prompt-major
    tensor (other layer and kv strides) in one call."""
    layers, heads, dim, ps, bt = 2, 2, 16, 8, 16
    arena = random((3, layers, 2, bt, heads, dim), torch.bfloat16, seed=3)
    prompt = torch.cat([arena[i] for i in range(3)], dim=2)  # [layers, 2, 48, heads, dim]
    pages = [9, 1, 4, 6, 2, 0]  # the request's pages, 8 tokens each
    want = reference_pages(prompt, pages, 10, ps)
    got = [torch.zeros_like(t) for t in want]
    cache = PagedCache.vllm_cpu(got, "vec")
    # tokens [8, 48): block 0 from its second page on, block 1 whole, block 2 from `prompt`
    cache.scatter_views([(arena[0], 8, pages[1:2]), (arena[1], 0, pages[2:4]),
                         (prompt, 32, pages[4:6])])
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g[pages[1:]], w[pages[1:]])
        assert not g[pages[0]].any()  # a page the engine computed itself: untouched
    out = torch.zeros_like(arena)
    cache.gather_views([(out[i], 0, pages[2 * i : 2 * i + 2]) for i in range(1, 3)])
    assert torch.equal(out[1:], arena[1:])


def test_views_are_checked_before_any_copy() -> None:
    ps, dim = 4, 8
    layers = [torch.zeros(3, 2, ps, 2 * dim) for _ in range(2)]
    cache = PagedCache.vllm_cpu(layers, "vec")
    kv = torch.zeros(2, 2, 8, 2, dim)
    with pytest.raises(ValueError, match="outside the cache"):
        cache.scatter_views([(kv, 0, [1, 3])])
    with pytest.raises(ValueError, match="outside the KV"):
        cache.scatter_views([(kv, 4, [0, 1])])
    with pytest.raises(ValueError, match="do not fill"):
        cache.scatter_views([(kv, 0, [0, 1], 4)])
    with pytest.raises(ValueError, match="does not match"):
        cache.scatter_views([(kv.to(torch.float16), 0, [0])])


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize(("dtype", "layers", "heads", "dim", "ps"), CASES[:3])
def test_head_slices_copy_only_their_heads(dtype, layers, heads, dim, ps, native,
                                           monkeypatch) -> None:
    """Blocks stored one KV head each (shared across tensor-parallel degrees) are copied
    through `head_slice`: each slice writes its head's bytes exactly where the whole cache's
    copy puts them and no other head's, partial last page included, and reads them back."""
    if native == "1" and paged.native_copy() is None:
        pytest.skip("no C compiler: the torch copy is used instead")
    monkeypatch.setenv(paged.NATIVE_ENV, native)
    pages, count = [3, 0], ps + ps // 2 + 1
    kv = random((layers, 2, 2 * ps, heads, dim), dtype, seed=4)
    want = reference_pages(kv, pages, 5, ps, count=count)
    got = [torch.full_like(t, 7.0) for t in want]
    cache = PagedCache.vllm_cpu(got, "vec")
    for h in reversed(range(heads)):  # any order: each slice leaves the others alone
        one = cache.head_slice(h, 1)
        assert (one.heads, one.page_heads) == (1, heads)
        one.scatter_views([(kv[:, :, :, h : h + 1].contiguous(), 0, pages, count)])
        for g, w in zip(got, want, strict=True):  # heads past h: still the fill
            assert torch.equal(g[:, h:], w[:, h:])
            assert (g[:, :h] == 7.0).all()
    for h in range(heads):
        back = torch.zeros(layers, 2, 2 * ps, 1, dim, dtype=dtype)
        cache.head_slice(h, 1).gather_views([(back, 0, pages, count)])
        assert torch.equal(back[:, :, :count], kv[:, :, :count, h : h + 1])
    rest = cache.head_slice(1, heads - 1) if heads > 1 else cache
    assert rest.head_slice(0, 1).head0 == (1 if heads > 1 else 0)
    with pytest.raises(ValueError, match="outside the cache"):
        cache.head_slice(heads - 1, 2)


def test_head_slices_of_a_kernels_cache_keep_the_other_heads() -> None:
    """The kernels copy whole pages: a slice gathers every head and keeps the heads it does
    not own when it scatters (read, then written back)."""
    from kvstore.kernels.layouts import EngineKV, EngineLayout

    layers, pages_n, ps, heads, dim = 2, 4, 8, 2, 16
    planes = [torch.zeros(2, pages_n, ps, heads, dim) for _ in range(layers)]
    cache = PagedCache.kernels(EngineKV.paged(EngineLayout.VLLM_NHD, planes))
    kv = random((layers, 2, 2 * ps, heads, dim), torch.float32, seed=5)
    cache.head_slice(1, 1).scatter_views([(kv[:, :, :, 1:2].contiguous(), 0, [3, 1])])
    cache.head_slice(0, 1).scatter_views([(kv[:, :, :, 0:1].contiguous(), 0, [3, 1])])
    assert torch.equal(cache.gather([3, 1]), kv)
    one = torch.zeros(layers, 2, 2 * ps, 1, dim)
    cache.head_slice(1, 1).gather_views([(one, 0, [3, 1])])
    assert torch.equal(one, kv[:, :, :, 1:2])


@needs_native
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to bind to")
def test_a_copy_spreads_over_its_callers_cpus(monkeypatch) -> None:
    """The layers split over one thread per CPU the caller is bound to (vLLM's synchronous
    load binds itself to the compute and side CPUs), and the pool's threads copy there too,
    wherever they were started: bound to one CPU, one thread; to two, two threads, each bound
    to those two."""
    real = paged.native_copy()
    seen: list[tuple[int, frozenset[int]]] = []

    def recording(*args):  # the C routine, recording which thread ran it, bound where
        seen.append((threading.get_native_id(), frozenset(os.sched_getaffinity(0))))
        return real(*args)

    monkeypatch.setattr(paged, "_native_fn", recording)
    layers, heads, dim, ps = 4, 2, 16, 8
    kv = random((layers, 2, 2 * ps, heads, dim), torch.float32, seed=5)
    want = reference_pages(kv, [1, 0], 3, ps)
    two = set(sorted(os.sched_getaffinity(0))[:2])

    def start_pool_on_one_cpu() -> None:  # its threads inherit this binding
        os.sched_setaffinity(0, {min(two)})
        started = threading.Barrier(5)
        futures = [paged._thread_pool().submit(started.wait, 10) for _ in range(4)]
        started.wait(10)
        for f in futures:
            f.result()

    starter = threading.Thread(target=start_pool_on_one_cpu)
    starter.start()
    starter.join(30)
    for cpus in ({min(two)}, two):
        seen.clear()

        def copy(cpus=cpus) -> None:
            os.sched_setaffinity(0, cpus)
            got = [torch.full_like(t, 7.0) for t in want]
            PagedCache.vllm_cpu(got, "vec").scatter(kv, [1, 0], 0)
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))

        caller = threading.Thread(target=copy)
        caller.start()
        caller.join(30)
        assert len({tid for tid, _ in seen}) == len(cpus)
        assert {bound for _, bound in seen} == {frozenset(cpus)}


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize(("dtype", "layers", "heads", "dim", "ps"), CASES[:2])
def test_a_layer_range_copies_only_those_layers(dtype, layers, heads, dim, ps, native,
                                                monkeypatch) -> None:
    """A layer-by-layer load (`scatter_views(views, (l, l + 1))`, vLLM's `layerwise_load`)
    writes exactly the layer it names, a partial last page included; one call per layer
    builds the same cache as one call for all."""
    monkeypatch.setenv(paged.NATIVE_ENV, native)
    pages, count = [3, 1], ps + ps // 2
    kv = random((layers + 1, 2, 2 * ps, heads, dim), dtype, seed=6)[:layers]
    want = reference_pages(kv, pages, 4, ps, count=count)
    got = [torch.full_like(t, 7.0) for t in want]
    cache = PagedCache.vllm_cpu(got, "vec")
    last = layers - 1
    cache.scatter_views([(kv, 0, pages, count)], (last, last + 1))
    assert torch.equal(got[last], want[last])
    assert all(torch.equal(g, torch.full_like(g, 7.0)) for g in got[:last])
    for layer in range(last):
        cache.scatter_views([(kv, 0, pages, count)], (layer, layer + 1))
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    with pytest.raises(ValueError, match="outside the cache's"):
        cache.scatter_views([(kv, 0, pages, count)], (0, layers + 1))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to bind to")
def test_saves_copy_off_the_compute_cpus_and_loads_on_all_of_them() -> None:
    """vLLM's worker thread is bound to its compute CPUs. Its background saves copy on the
    others (`side_cpus`), off the forward's; a synchronous load, which stalls the forward
    anyway, on both (`load_cpus`), with a copy thread per CPU. A thread that may run anywhere
    chooses neither."""
    every = set(range(os.cpu_count() or 1))
    mine = os.sched_getaffinity(0)
    got: dict[str, tuple] = {}

    def worker() -> None:
        got["as started"] = (paged.side_cpus(), paged.load_cpus())
        os.sched_setaffinity(0, {min(mine)})  # this thread only
        side, load = paged.side_cpus(), paged.load_cpus()
        got["bound"] = (side, load, paged.copy_threads(load))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    others = every - mine or None  # CI may run the tests bound to some CPUs already
    assert got["as started"] == (others, mine | others if others else None)
    side, load, threads = got["bound"]
    assert side == every - {min(mine)}
    assert load == every
    assert threads == min(4, len(every))
    assert os.sched_getaffinity(0) == mine  # the test's own thread was left alone


# ---- vLLM's "amx" ISA: its own C routine (kvs_vllm_amx_copy) and torch twin.


def reference_amx_pages(kv: torch.Tensor, pages: list[int], num_pages: int, ps: int,
                        count: int | None = None, fill: float = 7.0) -> list[torch.Tensor]:
    """vLLM "amx" caches holding `kv`'s tokens in `pages`, element by element from the
    layout's index formulas: per (page, head), K `[ps/16, dim/2, 16, 2]`, then V `[dim/16,
    ps/2, 16, 2]`; other slots hold `fill`."""
    layers, _, tokens, heads, dim = kv.shape
    count = tokens if count is None else count
    d = torch.arange(dim)
    out = []
    for layer in range(layers):
        t = torch.full((num_pages, heads, 2, ps * dim), fill, dtype=kv.dtype)
        for token in range(count):
            page, slot = pages[token // ps], token % ps
            k_at = (slot // 16) * 16 * dim + (d // 2) * 32 + (slot % 16) * 2 + d % 2
            v_at = (d // 16) * (ps // 2) * 32 + (slot // 2) * 32 + (d % 16) * 2 + slot % 2
            t[page, :, 0, k_at] = kv[layer, 0, token]
            t[page, :, 1, v_at] = kv[layer, 1, token]
        out.append(t.view(num_pages, heads, ps, 2 * dim))
    return out


needs_native_amx = pytest.mark.skipif(paged.native_copy("amx") is None,
                                      reason="no C compiler: the torch copy is used instead")
AMX_CASES = [  # (layers, heads, head_dim, page size, tokens of the last page)
    (2, 2, 128, 32, 32),  # the engine's shape family, whole pages
    (1, 3, 64, 64, 37),  # a partial last page: an odd token alone, a short 16-token block
    (2, 1, 16, 16, 15),  # dims of one line of V; a K row of one line
    (1, 2, 48, 48, 1),  # dims not a multiple of 32: K's rows not whole lines on a save
    (1, 2, 32, 32, 18),
    (1, 1, 528, 16, 16),  # dims past the C routine's row buffer: copied by torch instead
]


@needs_native_amx
@pytest.mark.parametrize(("layers", "heads", "dim", "ps", "last"), AMX_CASES)
@pytest.mark.parametrize("native", ["1", "0"])
def test_amx_copies_match_the_layout_element_by_element(layers, heads, dim, ps, last, native,
                                                        monkeypatch) -> None:
    """Both directions, C and torch, against the layout's formulas: a partial last page
    writes only its first slots and reads back only them; the other pages are untouched."""
    monkeypatch.setenv(paged.NATIVE_ENV, native)
    pages, count = [3, 0], ps + last
    kv = random((layers, 2, 2 * ps, heads, dim), torch.bfloat16, seed=8)
    want = reference_amx_pages(kv, pages, 5, ps, count=count)
    got = [torch.full_like(t, 7.0) for t in want]
    cache = PagedCache.vllm_cpu(got, "amx")
    cache.scatter_views([(kv, 0, pages, count)])
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    back = torch.zeros_like(kv)
    cache.gather_views([(back, 0, pages, count)])
    assert torch.equal(back[:, :, :count], kv[:, :, :count])
    assert not back[:, :, count:].any()


@needs_native_amx
def test_amx_native_routine_runs_for_amx_caches(monkeypatch) -> None:
    """An AMX cache is copied by the AMX routine, not by the "vec" one nor by torch."""
    calls: list[str] = []
    real = paged.native_copy("amx")

    def recording(*args):
        calls.append("amx")
        return real(*args)

    monkeypatch.setattr(paged, "_native_amx", recording)
    kv = random((1, 2, 32, 2, 32), torch.bfloat16, seed=9)
    cache = PagedCache.vllm_cpu([torch.zeros(2, 2, 32, 64, dtype=torch.bfloat16)], "amx")
    cache.scatter(kv, [1], 0)
    assert torch.equal(cache.gather([1]), kv)
    assert calls == ["amx", "amx"]


@needs_native_amx
def test_amx_head_slices_offsets_and_arena_views() -> None:
    """A head slice writes its head's bytes and no other's; cache layers and KV one element
    off 16-byte alignment (no streaming stores there); blocks as the daemon's arena holds
    them, a load starting inside the first one: all as the layout's formulas say."""
    layers, heads, dim, ps = 2, 2, 32, 32
    arena = random((3, layers, 2, ps, heads, dim), torch.bfloat16, seed=10)
    prompt = torch.cat([arena[i] for i in range(3)], dim=2)
    pages = [4, 1, 3]
    want = reference_amx_pages(prompt, pages, 5, ps)
    got = []
    for w in want:  # one element past an aligned address
        got.append(torch.full((w.numel() + 1,), 7.0, dtype=w.dtype)[1:].view(w.shape))
        assert got[-1].data_ptr() % 16 != 0
    cache = PagedCache.vllm_cpu(got, "amx")
    cache.scatter_views([(arena[1], 0, pages[1:2]), (prompt, 2 * ps, pages[2:])])
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g[pages[1:]], w[pages[1:]])
        assert bool((g[pages[0]] == 7.0).all())
    for h in range(heads):  # page 4 one head at a time, from separate head tensors
        cache.head_slice(h, 1).scatter(prompt[..., h : h + 1, :].contiguous(), pages[:1], 0)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g[pages[0], : h + 1], w[pages[0], : h + 1])
            assert bool((g[pages[0], h + 1 :] == 7.0).all())
    back = torch.zeros(prompt.numel() + 1, dtype=prompt.dtype)[1:].view(prompt.shape)
    cache.gather_views([(back, 0, pages)])
    assert torch.equal(back, prompt)
    one = torch.zeros(layers, 2, 3 * ps, 1, dim, dtype=prompt.dtype)
    cache.head_slice(1, 1).gather_views([(one, 0, pages)])
    assert torch.equal(one, prompt[..., 1:2, :])
