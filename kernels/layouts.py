"""Engine KV-cache layouts, and how each maps onto kvstore's canonical block.

An engine stores, per layer, K and V (or one MLA latent) in pages of
``page_size`` tokens. Whatever the tensor shape, every layout keeps one head's
``head_dim`` elements of one token contiguous. So each layout reduces to
*planes* (one per layer and K/V), each viewed as ``[num_pages, page_size,
num_heads, head_dim]`` with ``head_dim`` contiguous; the kernel only needs the
planes' base addresses and their three outer strides.

Layouts, per layer:

- ``VLLM_NHD``: vLLM flash-attention up to 0.22 ``[2, num_pages, page_size, heads, head_dim]``.
- ``VLLM_HND``: ``[2, num_pages, heads, page_size, head_dim]``.
- ``FLASHINFER_NHD``: ``[num_pages, 2, page_size, heads, head_dim]`` (FlashInfer and Triton
  up to vLLM 0.25, flash-attention 0.23-0.25).
- ``VLLM_PACKED``: vLLM >= 0.26 ``[num_pages, heads, page_size, 2*head_dim]``, K and V side
  by side in the last dim (``kv.transpose(1, 2).split(head_dim, -1)``, as vLLM's backends
  split it), with any strides on the first three dims (vLLM's NHD/HND stride orders and,
  from 0.29, the ``KVCacheLayout`` permutations, cross-layer ones included).
- ``VLLM_CPU``: vLLM's CPU backend ``[num_pages, heads, page_size, 2*head_dim]``.
  This is *not* K and V side by side in the last dim: inside one (page, head)
  the ``page_size * 2*head_dim`` elements are all K rows, then all V rows.
  vLLM's own CPU attention test views it as ``[num_pages, heads, 2*page_size,
  head_dim]`` and splits dim 2 in halves (K first). So it is
  ``[num_pages, heads, 2, page_size, head_dim]`` in memory. Caveat: vLLM 0.32's
  ``reshape_and_cache`` for its "vec"/"vec16" ISAs stores K of a (page, head) column-major
  (``[head_dim, page_size]``; only V is row-major), which this stride model cannot express
  (``head_dim`` is not contiguous). The vLLM connector therefore copies CPU caches itself
  (``client/integrations/paged.py``); this layout is exact only where K rows are stored.
- ``MLA``: ``[num_pages, page_size, latent_dim]`` (one plane, one "head").
- ``HF``: transformers' per-layer K and V tensors ``[batch, heads, seq, head_dim]``.
  There are no pages: a "page" is one kvstore block of the sequence, so page
  id ``i`` is tokens ``[i*block_tokens, (i+1)*block_tokens)`` of one batch row.

Which of these a vLLM backend of a given version hands a connector is ``vllm_layout`` /
``vllm_engine_kv`` below: a backend or version not read from vLLM's source is refused.

The views are built with torch's own indexing, so a view that cannot exist
(say a CPU cache whose last two dims are not contiguous) fails here, loudly.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.kernels.errors import DeviceError, DTypeError, LayoutError, ShapeError, StrideError

SUPPORTED_DTYPES: frozenset[torch.dtype] = frozenset(
    {
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.uint8,
        torch.int8,
    }
)


class EngineLayout(enum.Enum):
    """How one engine lays out one layer of its KV cache (see module docstring)."""

    VLLM_NHD = "vllm_nhd"
    VLLM_HND = "vllm_hnd"
    FLASHINFER_NHD = "flashinfer_nhd"
    VLLM_CPU = "vllm_cpu"
    VLLM_PACKED = "vllm_packed"
    MLA = "mla"
    HF = "hf"

    @property
    def num_kv(self) -> int:
        """Planes per layer: 2 (K, V) or 1 (MLA latent)."""
        return 1 if self is EngineLayout.MLA else 2


_RANK = {
    EngineLayout.VLLM_NHD: 5,
    EngineLayout.VLLM_HND: 5,
    EngineLayout.FLASHINFER_NHD: 5,
    EngineLayout.VLLM_CPU: 4,
    EngineLayout.VLLM_PACKED: 4,
    EngineLayout.MLA: 3,
    EngineLayout.HF: 4,
}


@dataclass(frozen=True)
class EngineKV:
    """An engine's KV cache for all layers, as the copy kernels see it.

    Build it with ``EngineKV.paged`` (vLLM, FlashInfer, vLLM CPU, MLA) or
    ``EngineKV.transformers``; the constructors check ranks, dtypes, devices.
    """

    layout: EngineLayout
    layers: tuple[torch.Tensor, ...]
    """One tensor per layer (the K tensors for ``HF``)."""
    values: tuple[torch.Tensor, ...] | None = None
    """``HF`` only: the V tensor of each layer."""
    batch_index: int = 0
    """``HF`` only: which batch row holds the request."""

    @classmethod
    def paged(cls, layout: EngineLayout, layers: Sequence[torch.Tensor]) -> EngineKV:
        """A paged engine cache: one tensor per layer, in ``layout``."""
        if layout is EngineLayout.HF:
            raise ShapeError("use EngineKV.transformers for transformers' K/V tensors")
        kv = cls(layout=layout, layers=tuple(layers))
        kv._check()
        return kv

    @classmethod
    def transformers(
        cls, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], batch_index: int = 0
    ) -> EngineKV:
        """transformers' per-layer ``[batch, heads, seq, head_dim]`` K and V tensors."""
        kv = cls(EngineLayout.HF, tuple(keys), tuple(values), batch_index)
        kv._check()
        return kv

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    def all_tensors(self) -> tuple[torch.Tensor, ...]:
        return self.layers + (self.values or ())

    def _check(self) -> None:
        if not self.layers:
            raise ShapeError("an engine cache needs at least one layer")
        tensors = self.all_tensors()
        if self.layout is EngineLayout.HF:
            if self.values is None or len(self.values) != len(self.layers):
                n_values = 0 if self.values is None else len(self.values)
                raise ShapeError(
                    f"transformers cache needs one V per K: got {len(self.layers)} K "
                    f"and {n_values} V tensors"
                )
            batch = self.layers[0].shape[0] if self.layers[0].dim() == 4 else 0
            if not 0 <= self.batch_index < batch:
                raise ShapeError(f"batch_index {self.batch_index} outside batch of size {batch}")
        rank = _RANK[self.layout]
        first = tensors[0]
        for i, t in enumerate(tensors):
            if t.dim() != rank:
                raise ShapeError(
                    f"{self.layout.value} expects rank-{rank} tensors per layer, "
                    f"tensor {i} has shape {tuple(t.shape)}"
                )
            if t.shape != first.shape:
                raise ShapeError(
                    f"all layers must share one shape: tensor {i} is {tuple(t.shape)}, "
                    f"tensor 0 is {tuple(first.shape)}"
                )
            if t.dtype != first.dtype:
                raise DTypeError(f"tensor {i} is {t.dtype}, tensor 0 is {first.dtype}")
            if t.device != first.device:
                raise DeviceError(f"tensor {i} is on {t.device}, tensor 0 on {first.device}")
        if first.dtype not in SUPPORTED_DTYPES:
            raise DTypeError(
                f"unsupported KV dtype {first.dtype}; supported: "
                + ", ".join(sorted(str(d) for d in SUPPORTED_DTYPES))
            )
        if self.layout in (EngineLayout.VLLM_NHD, EngineLayout.VLLM_HND) and first.shape[0] != 2:
            raise ShapeError(
                f"{self.layout.value} expects a leading K/V dim of 2, got {first.shape[0]}"
            )
        if self.layout is EngineLayout.FLASHINFER_NHD and first.shape[1] != 2:
            raise ShapeError(f"flashinfer_nhd expects dim 1 of size 2, got {first.shape[1]}")
        packed = (EngineLayout.VLLM_CPU, EngineLayout.VLLM_PACKED)
        if self.layout in packed and first.shape[3] % 2:
            raise ShapeError(
                f"{self.layout.value} expects an even last dim (2*head_dim), got {first.shape[3]}"
            )

    def page_size(self, block_tokens: int) -> int:
        """Tokens per engine page (``HF`` has none: a page is one block)."""
        shape = self.layers[0].shape
        if self.layout is EngineLayout.HF:
            return block_tokens
        index = {
            EngineLayout.VLLM_NHD: 2,
            EngineLayout.VLLM_HND: 3,
            EngineLayout.FLASHINFER_NHD: 2,
            EngineLayout.VLLM_CPU: 2,
            EngineLayout.VLLM_PACKED: 2,
            EngineLayout.MLA: 1,
        }[self.layout]
        return int(shape[index])

    def planes(self, block_tokens: int) -> list[torch.Tensor]:
        """Views ``[num_pages, page_size, heads, head_dim]``, ordered (layer, kv)."""
        out: list[torch.Tensor] = []
        for i, t in enumerate(self.layers):
            if self.layout is EngineLayout.VLLM_NHD:
                out += [t[0], t[1]]
            elif self.layout is EngineLayout.VLLM_HND:
                out += [t[0].transpose(1, 2), t[1].transpose(1, 2)]
            elif self.layout is EngineLayout.FLASHINFER_NHD:
                out += [t[:, 0], t[:, 1]]
            elif self.layout is EngineLayout.VLLM_CPU:
                pages, heads, page_size, two_dim = t.shape
                try:
                    kv = t.view(pages, heads, 2, page_size, two_dim // 2)
                except RuntimeError as e:
                    raise StrideError(
                        f"vllm_cpu layer {i}: the (page_size, 2*head_dim) plane must be "
                        f"contiguous, strides are {t.stride()}"
                    ) from e
                out += [kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)]
            elif self.layout is EngineLayout.VLLM_PACKED:
                rows = t.transpose(1, 2)  # [pages, page_size, heads, 2*head_dim]
                head_dim = rows.shape[3] // 2
                out += [rows[..., :head_dim], rows[..., head_dim:]]
            elif self.layout is EngineLayout.MLA:
                out.append(t.unsqueeze(2))
            else:
                if self.values is None:  # _check forbids it; this narrows the type
                    raise ShapeError("transformers cache without V tensors")
                for x in (t, self.values[i]):
                    row = x[self.batch_index]  # [heads, seq, head_dim]
                    pages = row.shape[1] // block_tokens
                    paged = torch.unflatten(
                        row[:, : pages * block_tokens], 1, (pages, block_tokens)
                    )
                    out.append(paged.permute(1, 2, 0, 3))
        return out


def staging_shape(engine: EngineKV, num_slots: int, block_tokens: int) -> tuple[int, ...]:
    """Shape of a staging tensor of ``num_slots`` canonical blocks for ``engine``."""
    plane = engine.planes(block_tokens)[0]
    return (
        num_slots,
        engine.num_layers,
        engine.layout.num_kv,
        block_tokens,
        int(plane.shape[2]),
        int(plane.shape[3]),
    )


# ---- vLLM: the layout each attention backend hands a connector, by vLLM version.
#
# Read from vLLM's own source (each release's wheel): the backends' `get_kv_cache_shape` and
# `get_kv_cache_stride_order` up to 0.28; from 0.29 on, `vllm/v1/kv_cache_layout.py`
# (`KVCacheLayout`) and `create_kv_cache_views` in `vllm/v1/kv_cache_interface.py`, which give
# every layer a `[B, H, N, C]` view, and each backend's own split of it. `register_kv_caches`
# receives those logical shapes; the physical order is in the tensors' strides, which the
# kernels read, so one entry covers every stride order of its shape. See docs/KERNELS.md.

VllmVersion = tuple[int, int]
"""(major, minor): layouts change with minor releases."""

_VLLM_ATTN = frozenset({"FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"})
_VLLM_MLA = frozenset({"TRITON_MLA", "FLASHMLA", "FLASH_ATTN_MLA", "CUTLASS_MLA", "FLASHINFER_MLA"})


@dataclass(frozen=True)
class VllmLayout:
    """One per-layer KV-cache layout of vLLM, as `register_kv_caches` hands it to a connector."""

    name: str
    backends: frozenset[str]
    """`AttentionBackend.get_name()` of the backends that use it."""
    first: VllmVersion
    last: VllmVersion
    shape: tuple[str, ...]
    """The logical per-layer shape, in vLLM's names; `num_blocks` and `block_size` are free."""
    engine: EngineLayout
    read_in: str
    """The vLLM releases it was read from."""

    def expected(self, num_kv_heads: int, head_size: int) -> tuple[int | None, ...]:
        sizes = {
            "num_kv_heads": num_kv_heads,
            "head_size": head_size,
            "2*head_size": 2 * head_size,
            "2": 2,
            "1": 1,
        }
        return tuple(sizes.get(name) for name in self.shape)

    def versions(self) -> str:
        first, last = (f"{v[0]}.{v[1]}" for v in (self.first, self.last))
        return first if first == last else f"{first}-{last}"


VLLM_LAYOUTS: tuple[VllmLayout, ...] = (
    VllmLayout(
        "kv_first",
        frozenset({"FLASH_ATTN", "FLEX_ATTENTION"}),
        (0, 22),
        (0, 22),
        ("2", "num_blocks", "block_size", "num_kv_heads", "head_size"),
        EngineLayout.VLLM_NHD,
        "0.22.1",
    ),
    VllmLayout(
        "blocks_first",
        frozenset({"FLASHINFER", "TRITON_ATTN"}),
        (0, 22),
        (0, 25),
        ("num_blocks", "2", "block_size", "num_kv_heads", "head_size"),
        EngineLayout.FLASHINFER_NHD,
        "0.22.1, 0.23.0, 0.25.1",
    ),
    VllmLayout(
        "blocks_first",
        frozenset({"FLASH_ATTN", "FLEX_ATTENTION"}),
        (0, 23),
        (0, 25),
        ("num_blocks", "2", "block_size", "num_kv_heads", "head_size"),
        EngineLayout.FLASHINFER_NHD,
        "0.23.0, 0.25.1",
    ),
    VllmLayout(
        "packed_kv",
        _VLLM_ATTN,
        (0, 26),
        (0, 33),
        ("num_blocks", "num_kv_heads", "block_size", "2*head_size"),
        EngineLayout.VLLM_PACKED,
        "0.26.0, 0.28.0, 0.29.0, 0.32.0, 0.33.0",
    ),
    VllmLayout(
        "mla_latent",
        _VLLM_MLA,
        (0, 22),
        (0, 28),
        ("num_blocks", "block_size", "head_size"),
        EngineLayout.MLA,
        "0.22.1, 0.28.0",
    ),
    VllmLayout(
        "mla_latent",
        frozenset({"CPU_MLA"}),
        (0, 28),
        (0, 28),
        ("num_blocks", "block_size", "head_size"),
        EngineLayout.MLA,
        "0.28.0",
    ),
    VllmLayout(
        "mla_latent_4d",
        _VLLM_MLA | {"CPU_MLA"},
        (0, 29),
        (0, 33),
        ("num_blocks", "1", "block_size", "head_size"),
        EngineLayout.MLA,
        "0.29.0, 0.32.0, 0.33.0",
    ),
    # CPUs with AMX, bf16: `amx_mla_concat_and_cache` writes the plain latent row of slot
    # `page * block_size + offset`, and the decode reads the cache as `view(-1, 1, head_size)`
    # (tests/vllm/test_cpu_isa.py checks both against vLLM 0.32's ops).
    VllmLayout(
        "mla_latent_4d",
        frozenset({"AMX_MLA"}),
        (0, 32),
        (0, 32),
        ("num_blocks", "1", "block_size", "head_size"),
        EngineLayout.MLA,
        "0.32.0",
    ),
)
"""Every vLLM layout the kernels know. MLA's `head_size` is `kv_lora_rank + qk_rope_head_dim`
(one latent row per token: `kv_c_normed`, then `k_pe`)."""

_VLLM_REFUSED = {
    "CPU_ATTN": "its K rows are column-major inside a page for the vec ISAs and tiled for AMX; "
    "the connector copies CPU caches itself (client/integrations/paged.py)",
    "B12X": "it stores K and V as two head slots, [num_blocks, 2, block_size, heads*head_size]",
    "FLASH_ATTN_DIFFKV": "its K and V have different head sizes",
    "TRITON_ATTN_DIFFKV": "its K and V have different head sizes",
}


_VLLM_OTHERWISE = {  # what to run instead, where a backend's layout was read for some versions
    "AMX_MLA": "; start vLLM with --attention-backend CPU_MLA",
}


def _parse_version(version: str) -> VllmVersion | None:
    parts = version.split(".")
    if len(parts) < 2 or not parts[0].isdigit():
        return None
    minor = "".join(c for c in parts[1][:3] if c.isdigit())
    return (int(parts[0]), int(minor)) if minor else None


def vllm_layout(
    backend: str,
    version: str,
    shape: Sequence[int],
    stride: Sequence[int],
    *,
    num_kv_heads: int,
    head_size: int,
) -> VllmLayout:
    """The layout of one layer's cache of vLLM `version`'s attention `backend` (its
    `get_name()`), checked against the tensor's `shape` and `stride`; `LayoutError` naming the
    backend, version, shape and strides for anything not read from vLLM's source."""
    shape, stride = tuple(int(x) for x in shape), tuple(int(x) for x in stride)
    what = f"vLLM {version} attention backend {backend!r} "
    what += f"(KV cache shape {shape}, strides {stride})"
    parsed = _parse_version(version)
    if torch.version.hip is not None:
        raise LayoutError(f"{what}: ROCm caches are not supported (their backends were not read)")
    if backend in _VLLM_REFUSED:
        raise LayoutError(f"{what}: refused, {_VLLM_REFUSED[backend]}")
    candidates = [lay for lay in VLLM_LAYOUTS if backend in lay.backends]
    if not candidates:
        known = sorted(set().union(*(lay.backends for lay in VLLM_LAYOUTS)))
        raise LayoutError(f"{what}: no known cache layout for this backend (known: {known})")
    found = [lay for lay in candidates if parsed and lay.first <= parsed <= lay.last]
    if not found:
        read = ", ".join(f"{lay.versions()} ({lay.name})" for lay in candidates)
        hint = _VLLM_OTHERWISE.get(backend, "")
        raise LayoutError(f"{what}: its layout was read for vLLM {read} only{hint}")
    lay = found[0]
    want = lay.expected(num_kv_heads, head_size)
    fits = len(shape) == len(want) and all(
        w is None or w == n for w, n in zip(want, shape, strict=True)
    )
    if not fits:
        dims = ", ".join(
            n if w is None else f"{n}={w}" for n, w in zip(lay.shape, want, strict=True)
        )
        raise LayoutError(
            f"{what}: expected the {lay.name} layout [{dims}] (num_kv_heads={num_kv_heads}, "
            f"head_size={head_size}); a quantized or repacked cache is not supported"
        )
    if shape[-1] > 1 and stride[-1] != 1:
        raise LayoutError(f"{what}: the last dim must be contiguous")
    return lay


def vllm_engine_kv(
    backend: str,
    version: str,
    layers: Sequence[torch.Tensor],
    *,
    num_kv_heads: int,
    head_size: int,
) -> EngineKV:
    """`EngineKV` for the per-layer caches `register_kv_caches` received from vLLM `version`'s
    attention `backend`, or `LayoutError` (see `vllm_layout`). Every layer must have the
    first's shape and strides."""
    if not layers:
        raise ShapeError("an engine cache needs at least one layer")
    first = layers[0]
    lay = vllm_layout(
        backend,
        version,
        first.shape,
        first.stride(),
        num_kv_heads=num_kv_heads,
        head_size=head_size,
    )
    for i, t in enumerate(layers):
        if t.shape != first.shape or t.stride() != first.stride():
            raise StrideError(
                f"vLLM {backend} layer {i}: shape {tuple(t.shape)} strides {t.stride()}, layer 0: "
                f"{tuple(first.shape)} {first.stride()}; the kernels take one layout for all"
            )
    if len(lay.shape) == 4 and lay.engine is EngineLayout.MLA:
        layers = [t.select(1, 0) for t in layers]  # [B, 1, N, C] -> [B, N, C], as vLLM's MLA
    return EngineKV.paged(lay.engine, layers)
