"""Engine KV-cache layouts, and how each maps onto kvstore's canonical block.

An engine stores, per layer, K and V (or one MLA latent) in pages of
``page_size`` tokens. Whatever the tensor shape, every layout keeps one head's
``head_dim`` elements of one token contiguous. So each layout reduces to
*planes* (one per layer and K/V), each viewed as ``[num_pages, page_size,
num_heads, head_dim]`` with ``head_dim`` contiguous; the kernel only needs the
planes' base addresses and their three outer strides.

Layouts, per layer:

- ``VLLM_NHD``: vLLM flash-attention ``[2, num_pages, page_size, heads, head_dim]``.
- ``VLLM_HND``: ``[2, num_pages, heads, page_size, head_dim]``.
- ``FLASHINFER_NHD``: ``[num_pages, 2, page_size, heads, head_dim]``.
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

The views are built with torch's own indexing, so a view that cannot exist
(say a CPU cache whose last two dims are not contiguous) fails here, loudly.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.errors import DeviceError, DTypeError, ShapeError, StrideError

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
        if self.layout is EngineLayout.VLLM_CPU and first.shape[3] % 2:
            raise ShapeError(
                f"vllm_cpu expects an even last dim (2*head_dim), got {first.shape[3]}"
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
