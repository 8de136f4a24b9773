"""Copies between a paged engine KV cache and kvstore's prompt-major KV, page by page.

kvstore's client speaks prompt-major KV, `[layers, kv, tokens, heads, head_dim]`. A paged engine
keeps each layer's K and V in pages of `page_size` tokens. `PagedCache` copies any subset of a
request's pages: a load must leave alone the pages the engine computed itself, since those may
be prefix-cache pages that other requests are reading.

vLLM's CPU attention (`cpu_attn.py`, ISAs "vec" and "vec16") allocates `[num_pages, heads,
page_size, 2 * head_dim]` per layer, but inside one (page, head) the first `page_size * head_dim`
elements are K *column-major*, `[head_dim, page_size]` (the QK kernel's B operand), and the rest
V row-major, `[page_size, head_dim]`: see `reshape_and_cache` in vLLM's
`csrc/cpu/cpu_attn_vec.hpp`. Its AMX ISA (bf16, pages of a multiple of 32 tokens, on a CPU with
AMX) packs both into VNNI tiles inside the (page, head): K as `[page_size / 16, head_dim / 2,
16, 2]` (16-token tiles of dim pairs), V as `[head_dim / 16, page_size / 2, 16, 2]` (16-dim
tiles of token pairs), read off vLLM's own `cpu_attn_reshape_and_cache` (`_planes`;
tests/vllm/test_cpu_isa.py checks it against that op). K is then not head_dim-contiguous,
which the copy kernels require, so CPU caches are copied here: by a small C routine
(`vllm_cpu_copy.c`, built at first use with the system's C compiler and cached, one pass over
the bytes with K transposed in SSE2 registers, layers split over a few threads), or with torch
ops where no compiler is found (also one pass each way, but 2-3x slower to save and 3-7x to
load: torch moves a strided transpose element by element). AMX caches have their own C routine
(`kvs_vllm_amx_copy`, one pass: K's pairs transposed as 32-bit elements, V's token pairs
interleaved in SSE2 registers) and a torch twin (`_amx_scatter`/`_amx_gather`).
CUDA caches go through `kernels.gather`/`kernels.scatter`.

`scatter_views`/`gather_views` copy between pages and any token-major views, e.g. the daemon's
shared-memory blocks that `KVClient.fetch_with` and `publish_with` hand out: one copy from
the store into the engine's cache, none through an intermediate tensor.

Nothing here imports an engine, so the page arithmetic and the copies are tested without one.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvstore import kernels
from kvstore.kernels.layouts import EngineKV

log = logging.getLogger("kvstore.paged")

VLLM_CPU_ISAS = frozenset({"vec", "vec16", "amx"})
"""vLLM CPU attention ISAs whose cache layout `PagedCache.vllm_cpu` decodes."""

NATIVE_SOURCE = Path(__file__).with_name("vllm_cpu_copy.c")
NATIVE_ENV = "KVSTORE_NATIVE_COPY"
"""Set to 0 to copy CPU caches with torch ops only (the C routine is used when it builds)."""

View = tuple[torch.Tensor, int, Sequence[int]] | tuple[torch.Tensor, int, Sequence[int], int]
"""`(kv, first, page_ids[, count])`: `count` tokens (default `len(page_ids) * page_size`; the
last page may be partial) of `kv` (token-major, `[layers, kv, tokens, heads, head_dim]`) from
token `first` on, and the engine pages that hold them."""
_View = tuple[torch.Tensor, int, Sequence[int], int]  # checked, count explicit

_native_lock = threading.Lock()
# None: not tried yet; False: unavailable; else the ctypes function. One per layout family.
_native_fn: object = None  # "vec"/"vec16": kvs_vllm_cpu_copy
_native_amx: object = None  # "amx": kvs_vllm_amx_copy
NATIVE_SYMBOLS = {"vec": "kvs_vllm_cpu_copy", "amx": "kvs_vllm_amx_copy"}
AMX_MAX_DIM = 512  # the C routine's row buffer (vllm_cpu_copy.c)
_pool: ThreadPoolExecutor | None = None


def _cache_dir() -> Path:
    if os.environ.get("KVSTORE_CACHE_DIR"):
        return Path(os.environ["KVSTORE_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvstore"


def native_copy(isa: str = "vec") -> object | None:
    """The C copy routine (`vllm_cpu_copy.c`) for a cache laid out by vLLM's `isa` ("vec" or
    "amx") as a ctypes function, built on first use into `$KVSTORE_CACHE_DIR` (default
    `~/.cache/kvstore`) under a name that hashes the source and the compiler; None where it
    cannot be built (no compiler, or `KVSTORE_NATIVE_COPY=0`)."""
    global _native_fn, _native_amx
    if os.environ.get(NATIVE_ENV, "1") == "0":
        return None
    amx = isa == "amx"
    with _native_lock:
        if amx and _native_amx is None:
            _native_amx = _build_native(NATIVE_SYMBOLS["amx"]) or False
        elif not amx and _native_fn is None:
            _native_fn = _build_native() or False
        return (_native_amx if amx else _native_fn) or None


def _build_native(symbol: str = NATIVE_SYMBOLS["vec"]) -> object | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") \
        or shutil.which("clang")
    if cc is None or not NATIVE_SOURCE.exists():
        log.warning("no C compiler or %s: vLLM CPU caches are copied with torch ops "
                    "(slower)", NATIVE_SOURCE.name)
        return None
    flags = ["-O3", "-shared", "-fPIC", "-fno-strict-aliasing"]
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
        digest = hashlib.sha256(NATIVE_SOURCE.read_bytes() + version.encode()
                                + " ".join(flags).encode() + os.uname().machine.encode())
        lib = _cache_dir() / f"vllm_cpu_copy-{digest.hexdigest()[:16]}.so"
        if not lib.exists():
            lib.parent.mkdir(parents=True, exist_ok=True)
            # Built under a temporary name and renamed: processes that build at once (vLLM
            # workers, test runs) never load a half-written library.
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
            os.close(fd)
            try:
                subprocess.run([cc, *flags, "-o", tmp, str(NATIVE_SOURCE)], check=True,
                               capture_output=True, text=True, timeout=120)
                os.replace(tmp, lib)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        fn = ctypes.CDLL(str(lib))[symbol]  # CDLL: calls release the GIL
    except (OSError, AttributeError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("cannot build %s (%s): vLLM CPU caches are copied with torch ops "
                    "(slower)", NATIVE_SOURCE.name, detail)
        return None
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    fn.restype = None
    fn.argtypes = [i32, i32, i32, ptr, ptr, ptr, ptr, i32, i32, i64, i64, i32, i32, i32, i32,
                   i32]
    return fn


def adjacent_runs(views: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, slice]]:
    """Contiguous tensors of one shape (stored blocks in the daemon's arena or gpu slab)
    grouped into runs lying back to back in memory, each as one `[n, *shape]` tensor over the
    same bytes, with the slice of `views` it covers: one copy-kernel launch per run instead of
    one per block (each launch costs ~1 ms of planning in Python on the H100: docs/GPU.md)."""
    runs: list[tuple[torch.Tensor, slice]] = []
    start = 0
    for k in range(1, len(views) + 1):
        if k < len(views) and views[k].shape == views[k - 1].shape \
                and _same_storage(views[k], views[k - 1]) \
                and views[k].data_ptr() == views[k - 1].data_ptr() + views[k - 1].nbytes:
            continue
        first = views[start]
        runs.append((first.as_strided((k - start, *first.shape),
                                      (first.numel(), *first.stride())), slice(start, k)))
        start = k
    return runs


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """One memory (the arena, or the gpu slab): two mappings may lie back to back in the
    address space, and a run must not stride from one into the other."""
    return a.device == b.device and \
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def caller_cpus() -> set[int] | None:
    """The CPUs the calling thread may run on (None where the platform does not say)."""
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return None


def side_cpus() -> set[int] | None:
    """CPUs the calling thread (vLLM's worker, bound to its compute CPUs) is not bound to:
    where a background save should copy, so it does not take turns with the forward pass on
    the compute CPUs. None where the thread may run anywhere (nothing to move away from)."""
    bound = caller_cpus()
    if bound is None:
        return None
    return set(range(os.cpu_count() or 1)) - bound or None


def load_cpus() -> set[int] | None:
    """CPUs a synchronous load should copy on, for a caller bound to its compute CPUs (vLLM's
    worker): those, which the load stalls anyway, and the side ones (`side_cpus`). None where
    the caller is not bound (it may copy anywhere already)."""
    bound, side = caller_cpus(), side_cpus()
    return bound | side if bound and side else None


def run_on(cpus: set[int] | None) -> None:
    """Bind the calling thread to `cpus` (no-op for None, or where that is refused)."""
    if cpus:
        try:
            if os.sched_getaffinity(0) != cpus:
                os.sched_setaffinity(0, cpus)
        except (AttributeError, OSError):
            pass


def copy_threads(cpus: set[int] | None) -> int:
    """Threads one copy spreads its layers over: the CPUs its caller may run on (`cpus`,
    `caller_cpus()`), at most 4 (memory bandwidth, not compute, bounds a copy). A caller
    chooses them by binding itself: vLLM's synchronous load runs on the compute CPUs it
    stalls and the idle side ones."""
    return max(1, min(4, len(cpus) if cpus else torch.get_num_threads()))


def _thread_pool() -> ThreadPoolExecutor:
    global _pool
    with _native_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(4, thread_name_prefix="kvstore-copy")
        return _pool


def token_pages(block_ids: Sequence[int], block_size: int, page_size: int, start: int,
                end: int) -> list[int]:
    """Engine page ids holding tokens `[start, end)` of one request, in token order.

    `block_ids[i]` is the scheduler's block of tokens `[i*block_size, (i+1)*block_size)`. An
    attention backend may split each scheduler block into `block_size // page_size` pages of
    its cache tensor (vLLM's "kernel block size"); page `j` of block `b` is then page
    `b * ratio + j`. `start` and `end` must be page aligned.
    """
    if page_size < 1 or block_size % page_size:
        raise ValueError(f"page size {page_size} must divide the block size {block_size}")
    if start % page_size or end % page_size or not 0 <= start <= end:
        raise ValueError(f"token range [{start}, {end}) is not aligned to pages of {page_size}")
    ratio = block_size // page_size
    pages: list[int] = []
    for page in range(start // page_size, end // page_size):
        block, part = divmod(page, ratio)
        if block >= len(block_ids):
            raise ValueError(f"token {page * page_size} lies past the request's "
                             f"{len(block_ids)} blocks")
        pages.append(block_ids[block] * ratio + part)
    return pages


@dataclass(frozen=True)
class PagedCache:
    """A paged KV cache: vLLM's CPU layer tensors, or an `EngineKV` for the copy kernels."""

    page_size: int
    num_layers: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    layers: tuple[torch.Tensor, ...] = ()
    """vLLM CPU caches: one `[num_pages, heads, page_size, 2 * head_dim]` tensor per layer."""
    engine: EngineKV | None = None
    """CUDA caches and MLA latent caches: copied by the kernels."""
    head0: int = 0
    """A head slice (`head_slice`): the first of the `heads` heads copied, of the cache's
    `cache_heads`."""
    cache_heads: int = 0
    """Heads in each of the cache's pages (0: `heads`, no slice)."""
    isa: str = "vec"
    """vLLM CPU caches: the attention ISA that laid out the pages ("vec"/"vec16" alike)."""

    @property
    def page_heads(self) -> int:
        """Heads in each of the cache's pages (`heads` unless this is a slice)."""
        return self.cache_heads or self.heads

    def head_slice(self, first: int, count: int) -> PagedCache:
        """The same cache, copying only heads `[first, first + count)` of this one's: views
        are then `[layers, kv, tokens, count, head_dim]`. Blocks stored one KV head each (shared
        across tensor-parallel degrees) are copied through slices. The kernels copy whole
        pages, so a slice of a kernels cache gathers every head and scatters by reading the
        pages first (twice the bytes)."""
        if first < 0 or count < 1 or first + count > self.heads:
            raise ValueError(f"heads [{first}, {first + count}) outside the cache's "
                             f"{self.heads}")
        if (first, count) == (0, self.heads):
            return self
        return replace(self, heads=count, head0=self.head0 + first,
                       cache_heads=self.page_heads)

    @property
    def planes(self) -> int:
        """Planes per layer: 2 (K and V), or 1 for an MLA latent."""
        return self.engine.layout.num_kv if self.engine is not None else 2

    @classmethod
    def vllm_cpu(cls, layers: Sequence[torch.Tensor], isa: str) -> PagedCache:
        """vLLM's CPU cache: one `[num_pages, heads, page_size, 2 * head_dim]` tensor per layer
        (see the module docstring for the order inside a page)."""
        if isa not in VLLM_CPU_ISAS:
            raise ValueError(f"vLLM CPU attention ISA {isa!r} packs its cache in a layout this "
                             f"connector does not decode (supported: {sorted(VLLM_CPU_ISAS)})")
        first = layers[0]
        for i, t in enumerate(layers):
            if t.dim() != 4 or t.shape != first.shape or t.dtype != first.dtype \
                    or not t.is_contiguous() or t.device.type != "cpu" or t.shape[3] % 2:
                raise ValueError(f"layer {i}: expected a contiguous CPU tensor [pages, heads, "
                                 f"page_size, 2*head_dim] like layer 0, got {tuple(t.shape)} "
                                 f"strides {t.stride()} on {t.device}")
        _, heads, page_size, two_dim = first.shape
        if isa == "amx" and (first.element_size() != 2 or page_size % 16 or two_dim % 32):
            raise ValueError(f"an AMX cache holds 2-byte elements in pages of a multiple of 16 "
                             f"tokens and heads of a multiple of 16 dims, got {first.dtype}, "
                             f"{page_size} tokens, {two_dim // 2} dims")
        return cls(page_size=page_size, num_layers=len(layers), heads=heads,
                   head_dim=two_dim // 2, dtype=first.dtype, layers=tuple(layers),
                   isa="amx" if isa == "amx" else "vec")

    @classmethod
    def kernels(cls, engine: EngineKV) -> PagedCache:
        """A cache the copy kernels know (`kernels.layouts`), e.g. vLLM's CUDA layouts."""
        plane = engine.planes(1 << 30)[0]  # paged layouts ignore the block size
        return cls(page_size=int(plane.shape[1]), num_layers=engine.num_layers,
                   heads=int(plane.shape[2]), head_dim=int(plane.shape[3]),
                   dtype=engine.dtype, engine=engine)

    def scatter(self, kv: torch.Tensor, page_ids: Sequence[int], first_token: int) -> None:
        """Write `kv[:, :, first_token : first_token + len(page_ids) * page_size]` (prompt-major,
        on the CPU) into `page_ids`."""
        n, ps = len(page_ids), self.page_size
        if n == 0:
            return
        if kv.shape[2] < first_token + n * ps:
            raise ValueError(f"kv holds {kv.shape[2]} tokens, fewer than the {n} pages from "
                             f"token {first_token} need")
        self.scatter_views([(kv, first_token, page_ids)])

    def gather(self, page_ids: Sequence[int]) -> torch.Tensor:
        """Read `page_ids` into new prompt-major KV `[layers, planes, len(page_ids) * page_size,
        heads, head_dim]` on the CPU."""
        n, ps = len(page_ids), self.page_size
        if self.engine is not None:
            return self._engine_gather(self.engine, page_ids)
        out = torch.empty((self.num_layers, 2, n * ps, self.heads, self.head_dim),
                          dtype=self.dtype)
        if n:
            self.gather_views([(out, 0, page_ids)])
        return out

    def scatter_views(self, views: Sequence[View], layers: tuple[int, int] | None = None,
                      ) -> None:
        """Write each `(kv, first, page_ids[, count])`: `count` tokens of the token-major `kv`
        (`[layers, kv, tokens, heads, head_dim]`, any layer and kv strides, e.g. a block in the
        daemon's shared memory) from token `first` on, into `page_ids` (only the first `count -
        (len(page_ids) - 1) * page_size` slots of a partial last page). `layers`: only the
        layers `[start, end)` (a layer-by-layer load; not for the kernels' engine caches)."""
        self._copy_views(views, gather=False, layers=layers)

    def gather_views(self, views: Sequence[View]) -> None:
        """Read `page_ids` into `count` tokens of each `(kv, first, page_ids[, count])` from
        token `first` on (the inverse of `scatter_views`)."""
        self._copy_views(views, gather=True)

    def _copy_views(self, views: Sequence[View], gather: bool,
                    layers: tuple[int, int] | None = None) -> None:
        """Both directions of `scatter_views` / `gather_views`: the copy kernels for an engine
        cache, else the native routine, else torch; `layers` `[start, end)` (None: all)."""
        checked = self._check_views(views)
        span = (0, self.num_layers) if layers is None else layers
        if not 0 <= span[0] <= span[1] <= self.num_layers:
            raise ValueError(f"layers {span} outside the cache's {self.num_layers}")
        if not checked or span[0] == span[1]:
            return
        if self.engine is not None:
            if span != (0, self.num_layers):
                raise ValueError("the kernels copy every layer of an engine cache at once")
            if not gather and not self.cache_heads:
                checked = self._scatter_whole_blocks(self.engine, checked)
            for kv, first, pages, count in checked:
                whole = len(pages) * self.page_size
                # The kernels copy whole pages. A load may end inside its last page (a prompt
                # of whole blocks loads all but its last token); its source is a full stored
                # block, so the page is written whole: the slots past `count` get that block's
                # own tokens, which the engine recomputes or masks.
                if count != whole and (gather or kv.shape[2] < first + whole):
                    raise ValueError("the kernels copy whole pages: a partial last page is "
                                     "loaded only from a source that holds all of it")
                if gather:
                    kv[:, :, first : first + count].copy_(self._engine_gather(self.engine, pages))
                elif self.cache_heads:  # a slice: the other heads' bytes are written back
                    whole_kv = self._engine_gather(self.engine, pages, all_heads=True)
                    whole_kv[..., self.head0 : self.head0 + self.heads, :] = \
                        kv[:, :, first : first + len(pages) * self.page_size]
                    self._engine_scatter(self.engine, whole_kv, pages, 0)
                else:
                    self._engine_scatter(self.engine, kv, pages, first)
        elif not self._native(checked, gather=gather, span=span):
            for item in checked:
                self._torch_copy(*item, gather=gather, layers=span)

    # ---- copies
    def _check_views(self, views: Sequence[View]) -> list[_View]:
        """The non-empty views with explicit counts, each checked against this cache (bounds
        included: the C routine trusts them)."""
        out: list[_View] = []
        num_pages = self.layers[0].shape[0] if self.layers else None
        want = (self.num_layers, self.planes, self.heads, self.head_dim)
        ps = self.page_size
        for view in views:
            kv, first, pages = view[0], view[1], view[2]
            count = view[3] if len(view) > 3 else len(pages) * ps
            if not len(pages):
                continue
            got = (kv.shape[0], kv.shape[1], kv.shape[3], kv.shape[4]) if kv.dim() == 5 else ()
            if got != want or kv.dtype != self.dtype:
                raise ValueError(f"KV {tuple(kv.shape)} {kv.dtype} does not match the cache: "
                                 f"[{want[0]}, {want[1]}, tokens, {want[2]}, {want[3]}] "
                                 f"{self.dtype}")
            if not (len(pages) - 1) * ps < count <= len(pages) * ps:
                raise ValueError(f"{count} tokens do not fill the last of {len(pages)} pages "
                                 f"of {ps}")
            if not 0 <= first <= first + count <= kv.shape[2]:
                raise ValueError(f"tokens [{first}, {first + count}) lie outside the KV's "
                                 f"{kv.shape[2]}")
            if num_pages is not None and not all(0 <= p < num_pages for p in pages):
                raise ValueError(f"page ids {list(pages)} outside the cache's {num_pages}")
            out.append((kv, first, pages, count))
        return out

    def _native(self, views: list[_View], *, gather: bool, span: tuple[int, int]) -> bool:
        """Copy with the C routine; False where it is unavailable or a view's strides are not
        the token-major ones it walks (the caller then copies with torch)."""
        fn = native_copy(self.isa)
        if fn is None or self.dtype.itemsize not in (1, 2, 4):
            return False
        if self.isa == "amx" and (self.dtype.itemsize != 2 or self.head_dim > AMX_MAX_DIM):
            return False
        hd, ps = self.heads * self.head_dim, self.page_size
        groups: dict[tuple[int, int], tuple[list[int], list[int], list[int]]] = {}
        for kv, first, pages, count in views:
            if kv.device.type != "cpu" or kv.stride()[2:] != (hd, self.head_dim, 1):
                return False
            src, ids, counts = groups.setdefault((kv.stride(0), kv.stride(1)), ([], [], []))
            step = ps * hd * kv.element_size()
            base = kv.data_ptr() + first * hd * kv.element_size()
            src.extend(base + j * step for j in range(len(pages)))
            ids.extend(int(p) for p in pages)
            counts.extend(min(ps, count - j * ps) for j in range(len(pages)))
        layers = torch.tensor([t.data_ptr() for t in self.layers], dtype=torch.int64)
        cpus = caller_cpus()  # the pool's threads copy where the caller may
        first, count = span[0], span[1] - span[0]
        threads = min(copy_threads(cpus), count)
        bounds = [first + count * i // threads for i in range(threads + 1)]
        for (layer_stride, kv_stride), (src, ids, counts) in groups.items():
            args = (torch.tensor(src, dtype=torch.int64), torch.tensor(ids, dtype=torch.int64),
                    torch.tensor(counts, dtype=torch.int32))

            def run(l0: int, l1: int, args: tuple[torch.Tensor, ...] = args,
                    strides: tuple[int, int] = (layer_stride, kv_stride),
                    pooled: bool = False) -> None:
                if pooled:
                    run_on(cpus)
                src_t, ids_t, counts_t = args
                fn(int(gather), self.dtype.itemsize, len(ids_t),  # type: ignore[operator]
                   src_t.data_ptr(), ids_t.data_ptr(), counts_t.data_ptr(), layers.data_ptr(),
                   l0, l1, strides[0], strides[1], self.heads, self.head_dim, ps,
                   self.page_heads, self.head0)

            if threads == 1:
                run(*span)
            else:
                pool = _thread_pool()
                futures = [pool.submit(run, bounds[i], bounds[i + 1], pooled=True)
                           for i in range(1, threads)]
                run(bounds[0], bounds[1])
                for f in futures:
                    f.result()
        return True

    def _torch_copy(self, kv: torch.Tensor, first: int, page_ids: Sequence[int], count: int,
                    *, gather: bool, layers: tuple[int, int]) -> None:
        """The torch twin of the C routine: whole pages at once, then a partial last page."""
        ps = self.page_size
        full = count // ps
        if full:
            copy = self._torch_gather if gather else self._torch_scatter
            copy(kv, page_ids[:full], first, layers)
        rest = count - full * ps
        if not rest:
            return
        page, at = int(page_ids[full]), first + full * ps
        heads, dim = self.heads, self.head_dim
        if self.isa == "amx":  # tokens lie in tiles: through the page in token order
            for layer in range(*layers):
                for plane, view in enumerate(self._planes(self.layers[layer][page : page + 1])):
                    tokens = torch.empty((ps, heads, dim), dtype=self.dtype)
                    split = self._split(tokens, plane, 1)
                    split.copy_(view)
                    part = kv[layer, plane, at : at + rest]
                    if gather:
                        part.copy_(tokens[:rest])
                    else:
                        tokens[:rest] = part
                        view.copy_(split)
            return
        for layer in range(*layers):
            halves = self._halves(self.layers[layer][page])
            k = halves[:, 0].view(heads, dim, ps)[:, :, :rest].permute(2, 0, 1)
            v = halves[:, 1].view(heads, ps, dim)[:, :rest].permute(1, 0, 2)
            src_k, src_v = kv[layer, 0, at : at + rest], kv[layer, 1, at : at + rest]
            if gather:
                src_k.copy_(k)
                src_v.copy_(v)
            else:
                k.copy_(src_k)
                v.copy_(src_v)

    def _halves(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (a layer's pages, or one page) as `[..., heads, 2, page_size * head_dim]`, only
        this cache's heads (a view: writes land in the cache)."""
        whole = t.view(*t.shape[:-3], self.page_heads, 2, -1)
        return whole[..., self.head0 : self.head0 + self.heads, :, :]

    def _planes(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `pages` (a layer's, `[num_pages, heads, page_size, 2 * head_dim]`) as
        views `[num_pages, ...]` whose other dims are those of token-major `[page_size, heads,
        head_dim]` split as `_split` splits them (a view: writes land in the cache)."""
        halves = self._halves(pages)
        heads, dim, ps = self.heads, self.head_dim, self.page_size
        if self.isa == "amx":  # K [ps/16, dim/2, 16, 2], V [dim/16, ps/2, 16, 2]
            k = halves[:, :, 0].view(-1, heads, ps // 16, dim // 2, 16, 2)
            v = halves[:, :, 1].view(-1, heads, dim // 16, ps // 2, 16, 2)
            return k.permute(0, 2, 4, 1, 3, 5), v.permute(0, 3, 5, 1, 2, 4)
        k = halves[:, :, 0].view(-1, heads, dim, ps).permute(0, 3, 1, 2)  # K: [dim, ps]
        v = halves[:, :, 1].view(-1, heads, ps, dim).permute(0, 2, 1, 3)  # V: [ps, dim]
        return k, v

    def _split(self, tokens: torch.Tensor, plane: int, n: int) -> torch.Tensor:
        """`n` pages of token-major `tokens` (`[n * page_size, heads, head_dim]`) as a view
        shaped like `_planes`' plane."""
        ps, dim = self.page_size, self.head_dim
        if self.isa != "amx":
            return torch.unflatten(tokens, 0, (n, ps))
        if plane == 0:  # tokens in tiles of 16, dims in pairs
            return torch.unflatten(torch.unflatten(tokens, 0, (n, ps // 16, 16)), -1,
                                   (dim // 2, 2))
        return torch.unflatten(torch.unflatten(tokens, 0, (n, ps // 2, 2)), -1, (dim // 16, 16))

    def _torch_scatter(self, kv: torch.Tensor, page_ids: Sequence[int], first: int,
                       layers: tuple[int, int]) -> None:
        n, ps = len(page_ids), self.page_size
        part = kv[:, :, first : first + n * ps]
        index = torch.as_tensor(list(page_ids), dtype=torch.long)
        if self.isa == "amx" and part.stride(-1) == 1:  # else through `_planes`, any strides
            for layer in range(*layers):
                self._amx_scatter(self.layers[layer], part[layer], index)
            return
        for layer in range(*layers):
            # index_put_ through the strided views writes the engine's storage in place; on a
            # 2-core machine it beat staging whole pages and index_copy_ (120 vs 157 ms for
            # 2048 tokens of an 8B-shaped model).
            for plane, view in enumerate(self._planes(self.layers[layer])):
                view[index] = self._split(part[layer, plane], plane, n)

    def _amx_tiles(self, part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-major `part` (`[2, pages * page_size, heads, head_dim]`, last dim contiguous)
        as views in the AMX tile order of whole (page, head) planes: K `[pages, heads, ps/16,
        dim/2, 16]` of int32 (a pair of 2-byte values each), V `[pages, heads, dim/16, ps/2,
        16, 2]`."""
        ps, dim = self.page_size, self.head_dim
        k = torch.unflatten(part[0].view(torch.int32), 0, (-1, ps // 16, 16))
        v = torch.unflatten(torch.unflatten(part[1], 0, (-1, ps // 2, 2)), -1, (dim // 16, 16))
        return k.permute(0, 3, 1, 4, 2), v.permute(0, 3, 4, 1, 5, 2)

    def _amx_scatter(self, pages: torch.Tensor, part: torch.Tensor,
                     index: torch.Tensor) -> None:
        """One layer's whole pages (`part`: `[2, len(index) * page_size, heads, head_dim]`)
        into `index` of `pages` (the layer's AMX cache): each plane put in tile order first
        (one transposing copy), then copied into the pages whole (page, head) planes at a
        time. 3.5-4.7x faster than `index_put_` through `_planes`' 6-D views (256 MiB, 2
        threads: 0.18-0.24 against 0.84 s)."""
        n, heads = len(index), self.heads
        k, v = self._amx_tiles(part)
        planes = self._halves(pages).view(torch.int32)  # [pages, heads, 2, ps * dim / 2]
        planes[index, :, 0] = k.contiguous().view(n, heads, -1)
        planes[index, :, 1] = v.contiguous().view(torch.int32).view(n, heads, -1)

    def _amx_gather(self, pages: torch.Tensor, part: torch.Tensor,
                    index: torch.Tensor) -> None:
        """The inverse of `_amx_scatter`: whole (page, head) planes out of the pages, then
        one transposing copy per plane into token order (`part`)."""
        k, v = self._amx_tiles(part)
        planes = self._halves(pages).view(torch.int32)
        k.copy_(planes[index, :, 0].view(k.shape))
        v.copy_(planes[index, :, 1].view(self.dtype).view(v.shape))

    def _torch_gather(self, kv: torch.Tensor, page_ids: Sequence[int], first: int,
                       layers: tuple[int, int]) -> None:
        n, ps = len(page_ids), self.page_size
        part = kv[:, :, first : first + n * ps]
        index = torch.as_tensor(list(page_ids), dtype=torch.long)
        if self.isa == "amx" and part.stride(-1) == 1:  # else through `_planes`, any strides
            for layer in range(*layers):
                self._amx_gather(self.layers[layer], part[layer], index)
            return
        for layer in range(*layers):
            # One pass, from the pages' strided views straight into the destination (any
            # strides: `out` keeps them). Copying whole pages out first, then into token
            # order, read and wrote every byte twice: 1.2-1.7x the time (8B shape, 1 thread).
            for plane, view in enumerate(self._planes(self.layers[layer])):
                torch.index_select(view, 0, index, out=self._split(part[layer, plane], plane, n))

    def _scatter_whole_blocks(self, engine: EngineKV, views: list[_View]) -> list[_View]:
        """Scatter the views that are whole stored blocks (contiguous `[layers, kv, tokens,
        heads, dim]`, every token loaded from the first) with each block as one slot of the
        kernel's staging, and the blocks lying back to back in memory as one launch: no copy
        into page-major staging on the CPU first (`_engine_scatter`). From a pinned arena
        (`KVClient.prepare(pin=True)`) the kernel reads across the bus itself, and this waits
        for it (the fetch's lease ends after); from pageable memory each run crosses in one
        copy. Returns the other views."""
        whole: list[_View] = []
        rest: list[_View] = []
        for item in views:
            kv, first, pages, count = item
            whole_block = first == 0 and count == len(pages) * self.page_size == kv.shape[2]
            (whole if whole_block and kv.is_contiguous() else rest).append(item)
        read_across = False
        for staging, span in adjacent_runs([item[0] for item in whole]):
            if staging.device != engine.device:
                if staging.is_pinned():
                    read_across = True
                else:
                    staging = staging.to(engine.device)
            kernels.scatter(staging, engine, torch.tensor([list(item[2]) for item in whole[span]]))
        if read_across:
            torch.cuda.current_stream(engine.device).synchronize()
        return rest

    def _engine_scatter(self, engine: EngineKV, kv: torch.Tensor, page_ids: Sequence[int],
                        first: int) -> None:
        n, ps = len(page_ids), self.page_size
        part = kv[:, :, first : first + n * ps]
        # Page-major staging, one page per slot (each slot contiguous, as the kernel wants).
        staging = torch.unflatten(part, 2, (n, ps)).permute(2, 0, 1, 3, 4, 5).contiguous()
        kernels.scatter(staging.to(engine.device), engine, list(page_ids))

    def _engine_gather(self, engine: EngineKV, page_ids: Sequence[int], *,
                       all_heads: bool = False) -> torch.Tensor:
        """Pages `page_ids` as prompt-major KV on the CPU: this cache's heads, or with
        `all_heads` every head of the pages (a slice's whole pages)."""
        n, ps = len(page_ids), self.page_size
        shape = kernels.staging_shape(engine, n, ps)
        staging = torch.empty(shape, dtype=self.dtype, device=engine.device)
        if n:
            kernels.gather(engine, staging, list(page_ids))
        # reshape copies (the permuted dims cannot merge): that copy is the result.
        out = staging.permute(1, 2, 0, 3, 4, 5).reshape(
            self.num_layers, engine.layout.num_kv, n * ps, self.page_heads, self.head_dim)
        if self.cache_heads and not all_heads:
            out = out[..., self.head0 : self.head0 + self.heads, :]
        return out.cpu()
