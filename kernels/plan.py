"""Validate one gather/scatter call, and describe it to the CUDA kernel.

``prepare`` checks every argument once and normalises ids (shared by the torch
reference and the kernel path, so both accept exactly the same calls).
``plan_launch`` turns a prepared request into the kernel's arguments: plane
addresses, byte strides, the widest vector that alignment allows, and the grid.
It needs no GPU, which is what lets the host-shim tests drive the real kernel
with the real launch parameters.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.kernels.errors import BlockIdError, DTypeError, ShapeError, StrideError
from kvstore.kernels.layouts import EngineKV

VEC_WIDTHS: tuple[int, ...] = (16, 8, 4, 2, 1)
"""Bytes per load/store, widest first; 16 is one ``uint4``."""
KERNEL_NAMES: tuple[str, ...] = tuple(
    f"kv_{d}_v{w}" for d in ("gather", "scatter") for w in VEC_WIDTHS
)
THREADS_PER_BLOCK = 256
UNROLL = 4
"""Must equal ``KV_UNROLL`` in kv_copy.cu (a test checks)."""
CTAS_PER_SM = 4
"""Target resident CTAs per SM when splitting small requests across blocks."""
_MAX_PLANE_BYTES = 1 << 30  # keeps the kernel's 32-bit vector index from overflowing
_MAX_GRID_X = (1 << 31) - 1
_MAX_GRID_Y = 65535

IdsLike = Sequence[int] | Sequence[Sequence[int]] | torch.Tensor

POINTER_PARAMS: tuple[str, ...] = ("planes", "page_ids", "slot_ids", "staging")
"""The kernel's leading pointer parameters, in order."""
SCALAR_PARAMS: tuple[tuple[str, str], ...] = (
    ("num_planes", "i32"),
    ("block_tokens", "i32"),
    ("page_size", "i32"),
    ("num_heads", "i32"),
    ("row_bytes", "i32"),
    ("page_stride", "i64"),
    ("token_stride", "i64"),
    ("head_stride", "i64"),
    ("slot_stride", "i64"),
    ("num_units", "i32"),
)
"""The kernel's scalar parameters after the pointers: (name, C type). A test
checks this against the signature in kv_copy.cu."""


class Direction(enum.Enum):
    GATHER = "gather"  # engine pages -> staging slots
    SCATTER = "scatter"  # staging slots -> engine pages


@dataclass(frozen=True)
class CopyRequest:
    """A validated copy: planes, staging and ids, with all shapes checked."""

    direction: Direction
    planes: tuple[torch.Tensor, ...]
    """Per (layer, kv): ``[num_pages, page_size, heads, head_dim]`` views of the engine."""
    staging: torch.Tensor
    """``[num_slots, layers, kv, block_tokens, heads, head_dim]``, each slot contiguous."""
    page_ids: torch.Tensor
    """int64 on the CPU, ``[num_blocks, pages_per_block]``."""
    slot_ids: torch.Tensor
    """int64 on the CPU, ``[num_blocks]``."""
    block_tokens: int
    page_size: int

    @property
    def num_blocks(self) -> int:
        return int(self.slot_ids.numel())

    @property
    def num_kv(self) -> int:
        return int(self.staging.shape[2])


@dataclass(frozen=True)
class KernelLaunch:
    """Everything one launch of kv_copy.cu needs, in bytes and raw addresses."""

    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    plane_ptrs: tuple[int, ...]
    staging_ptr: int
    num_planes: int
    block_tokens: int
    page_size: int
    num_heads: int
    row_bytes: int
    page_stride: int
    token_stride: int
    head_stride: int
    slot_stride: int
    num_units: int  # (block, plane) units: more than the grid's x when its CTAs are capped
    vec_bytes: int


def effective_strides(t: torch.Tensor) -> tuple[int, ...]:
    """Strides in elements, 0 for dims of size 1: those are never stepped over,
    and torch leaves their stride arbitrary, so they must not veto anything."""
    return tuple(s if n > 1 else 0 for s, n in zip(t.stride(), t.shape, strict=True))


def _ids_tensor(ids: IdsLike, what: str) -> torch.Tensor:
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise DTypeError(f"{what} must be integers, got {ids.dtype}")
        # A CUDA tensor costs one device sync here; the ids are needed on the
        # host anyway to validate them before any kernel can touch memory.
        return ids.detach().to("cpu", torch.int64)
    try:
        return torch.as_tensor(list(ids), dtype=torch.int64)
    except (TypeError, ValueError, RuntimeError) as e:
        raise DTypeError(f"{what} must be a sequence of ints: {e}") from e


def prepare(
    direction: Direction,
    engine: EngineKV,
    staging: torch.Tensor,
    page_ids: IdsLike,
    slot_ids: IdsLike | None = None,
) -> CopyRequest:
    """Check a call's arguments against each other; raise a ``KernelArgumentError``."""
    if staging.dim() != 6:
        raise ShapeError(
            "staging must be [num_slots, layers, kv, block_tokens, heads, head_dim], "
            f"got shape {tuple(staging.shape)}"
        )
    if staging.dtype != engine.dtype:
        raise DTypeError(f"staging is {staging.dtype} but the engine cache is {engine.dtype}")
    block_tokens = int(staging.shape[3])
    if block_tokens <= 0:
        raise ShapeError("block_tokens (staging dim 3) must be positive")
    page_size = engine.page_size(block_tokens)
    if page_size <= 0 or block_tokens % page_size:
        raise ShapeError(f"engine page size {page_size} must divide block_tokens {block_tokens}")
    planes = tuple(engine.planes(block_tokens))
    num_pages, _, heads, head_dim = (int(x) for x in planes[0].shape)
    expected = (engine.num_layers, engine.layout.num_kv, block_tokens, heads, head_dim)
    if tuple(staging.shape[1:]) != expected:
        raise ShapeError(
            f"staging slot shape {tuple(staging.shape[1:])} does not match the engine "
            f"cache: expected {expected} (layers, kv, block_tokens, heads, head_dim)"
        )
    strides = effective_strides(planes[0])
    if strides[3] not in (0, 1):
        raise StrideError(f"head_dim must be contiguous, plane strides are {strides}")
    for i, p in enumerate(planes):
        if effective_strides(p) != strides:
            raise StrideError(
                f"plane {i} strides {effective_strides(p)} differ from plane 0 {strides}: "
                "the kernel takes one set of strides for all layers"
            )
    block_numel = staging[0].numel() if staging.shape[0] else 0
    if staging.shape[0] and not staging[0].is_contiguous():
        raise StrideError(f"each staging slot must be contiguous, strides {staging.stride()}")
    if staging.shape[0] > 1 and staging.stride(0) < block_numel:
        raise StrideError(f"staging slots overlap: stride {staging.stride(0)} < {block_numel}")

    pages_per_block = block_tokens // page_size
    pids = _ids_tensor(page_ids, "page_ids")
    if pids.dim() == 1 and pids.numel() % pages_per_block == 0:
        pids = pids.reshape(-1, pages_per_block)
    if pids.dim() != 2 or pids.shape[1] != pages_per_block:
        raise ShapeError(
            f"page_ids must be [num_blocks, {pages_per_block}] (or flat, a multiple of "
            f"{pages_per_block}: block_tokens {block_tokens} / page size {page_size}), "
            f"got shape {tuple(pids.shape)}"
        )
    num_blocks = int(pids.shape[0])
    sids = (
        torch.arange(num_blocks, dtype=torch.int64)
        if slot_ids is None
        else _ids_tensor(slot_ids, "slot_ids").reshape(-1)
    )
    if sids.numel() != num_blocks:
        raise ShapeError(f"{sids.numel()} slot_ids for {num_blocks} blocks")
    if num_blocks:
        _check_range(pids, num_pages, "page_ids", "engine pages")
        _check_range(sids, int(staging.shape[0]), "slot_ids", "staging slots")
        written, name = (sids, "slot_ids") if direction is Direction.GATHER else (pids, "page_ids")
        if torch.unique(written).numel() != written.numel():
            raise BlockIdError(
                f"{name} repeat an id on the written side of a {direction.value}: "
                "the result would depend on thread timing"
            )
    plane_bytes = block_tokens * heads * head_dim * staging.element_size()
    if plane_bytes > _MAX_PLANE_BYTES:
        raise ShapeError(f"one block's plane is {plane_bytes} bytes; at most {_MAX_PLANE_BYTES}")
    if num_blocks * len(planes) > _MAX_GRID_X:
        raise ShapeError(f"{num_blocks} blocks x {len(planes)} planes exceed one launch")
    return CopyRequest(direction, planes, staging, pids, sids, block_tokens, page_size)


def _check_range(ids: torch.Tensor, limit: int, name: str, what: str) -> None:
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= limit:
        bad = lo if lo < 0 else hi
        raise BlockIdError(f"{name} contains {bad}, outside the {limit} {what}")


def vector_bytes(row_bytes: int, addresses: Sequence[int], strides: Sequence[int]) -> int:
    """Widest load/store that every row start can use: each must be a multiple."""
    for width in VEC_WIDTHS:
        if row_bytes % width == 0 and all(x % width == 0 for x in (*addresses, *strides)):
            return width
    return 1


def launch_shape(
    num_units: int, vecs_per_unit: int, sm_count: int, max_ctas: int | None = None
) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, block): x walks (block, plane) units, y splits a unit across CTAs. `max_ctas`
    caps the grid (x loops over the units): a copy beside a forward then holds a few SMs
    only, instead of one CTA per unit queued on every SM ahead of the forward's kernels."""
    threads = min(THREADS_PER_BLOCK, max(32, -(-vecs_per_unit // 32) * 32))
    if max_ctas is not None:
        if max_ctas < 1:
            raise ValueError(f"max_ctas must be >= 1, got {max_ctas}")
        return (min(num_units, max_ctas), 1, 1), (threads, 1, 1)
    chunks = max(1, -(-vecs_per_unit // (threads * UNROLL)))
    # Enough CTAs to fill every SM even when a request has few units.
    wanted = max(1, -(-(CTAS_PER_SM * sm_count) // max(1, num_units)))
    grid_y = min(chunks, wanted, _MAX_GRID_Y)
    return (num_units, grid_y, 1), (threads, 1, 1)


def plan_launch(req: CopyRequest, sm_count: int, staging_ptr: int | None = None,
                max_ctas: int | None = None) -> KernelLaunch:
    """Kernel arguments for ``req``; ``staging_ptr`` overrides the staging address
    (the device alias of mapped pinned host memory); ``max_ctas`` caps the grid
    (``launch_shape``)."""
    elem = req.staging.element_size()
    plane0 = req.planes[0]
    heads, head_dim = int(plane0.shape[2]), int(plane0.shape[3])
    row_bytes = head_dim * elem
    page_stride, token_stride, head_stride = (s * elem for s in effective_strides(plane0)[:3])
    slot_stride = req.staging.stride(0) * elem if req.staging.shape[0] > 1 else 0
    plane_ptrs = tuple(p.data_ptr() for p in req.planes)
    base = req.staging.data_ptr() if staging_ptr is None else staging_ptr
    vec = vector_bytes(
        row_bytes, (*plane_ptrs, base), (page_stride, token_stride, head_stride, slot_stride)
    )
    num_units = req.num_blocks * len(req.planes)
    vecs_per_unit = req.block_tokens * heads * row_bytes // vec
    grid, block = launch_shape(num_units, vecs_per_unit, sm_count, max_ctas)
    return KernelLaunch(
        kernel=f"kv_{req.direction.value}_v{vec}",
        grid=grid,
        block=block,
        plane_ptrs=plane_ptrs,
        staging_ptr=base,
        num_planes=len(req.planes),
        block_tokens=req.block_tokens,
        page_size=req.page_size,
        num_heads=heads,
        row_bytes=row_bytes,
        page_stride=page_stride,
        token_stride=token_stride,
        head_stride=head_stride,
        slot_stride=slot_stride,
        num_units=num_units,
        vec_bytes=vec,
    )


def scalar_args(plan: KernelLaunch) -> tuple[int, ...]:
    """The kernel's scalar arguments, in ``SCALAR_PARAMS`` order."""
    return tuple(int(getattr(plan, name)) for name, _ in SCALAR_PARAMS)
