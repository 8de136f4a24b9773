"""kv_copy.cu, compiled as C++ under the host shim (ASan + UBSan), equals the torch oracle.

The same source NVRTC compiles for the GPU runs here on the CPU, one simulated
thread at a time, with the launch parameters ``plan_launch`` would use on an
H100 (132 SMs). Every byte of every storage the launch touches, including
pages and slots it must not touch, is compared with ``reference.run``.
"""

from __future__ import annotations

import dataclasses
import random
import re
import zlib
from pathlib import Path

import pytest
import torch

from kvstore.kernels import EngineKV, EngineLayout, reference
from kvstore.kernels.plan import (
    KERNEL_NAMES,
    VEC_WIDTHS,
    Direction,
    KernelLaunch,
    plan_launch,
    prepare,
)
from tests.kernels.cases import (
    CacheSpec,
    assert_same_bytes,
    make_engine,
    make_staging,
    num_pages,
    random_ids,
)
from tests.kernels.shim import ShimRunner, storage_bytes

H100_SMS = 132
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# vLLM's per-layer [B, H, N, 2*D] views: NHD (its default) and HND memory order.
PACKED_ORDERS = [(0, 2, 1, 3), (0, 1, 2, 3)]


def run_and_compare(
    shim: ShimRunner,
    engine: EngineKV,
    staging: torch.Tensor,
    direction: Direction,
    page_ids: torch.Tensor,
    slot_ids: torch.Tensor,
    *,
    tiny_launch: bool = False,
    reverse: bool = False,
    max_ctas: int | None = None,
) -> KernelLaunch:
    """Run the kernel in the shim and the oracle in torch; compare every byte."""
    req = prepare(direction, engine, staging, page_ids, slot_ids)
    plan = plan_launch(req, sm_count=H100_SMS, max_ctas=max_ctas)
    if tiny_launch:
        # One CTA of one warp per unit: every thread walks the grid-stride loop.
        plan = dataclasses.replace(plan, grid=(plan.grid[0], 1, 1), block=(32, 1, 1))
    tensors = [*engine.all_tensors(), staging]
    result = shim.run(plan, tensors, req.page_ids, req.slot_ids, reverse=reverse)
    reference.run(req)  # the oracle, in place on the original tensors
    seen: set[int] = set()
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        what = "staging" if t is staging else "engine cache"
        assert_same_bytes(storage_bytes(st), result.after[st.data_ptr()], f"{plan.kernel} {what}")
    return plan


def random_spec(layout: EngineLayout, dtype: torch.dtype, rng: random.Random) -> CacheSpec:
    page_size = rng.choice([1, 2, 4, 8])
    heads = 1 if layout is EngineLayout.MLA else rng.choice([1, 2, 3, 4])
    head_dim = (
        rng.choice([16, 36, 72]) if layout is EngineLayout.MLA else rng.choice([4, 8, 12, 64])
    )
    return CacheSpec(
        layout=layout,
        dtype=dtype,
        num_layers=rng.choice([1, 2, 3]),
        num_pages=rng.choice([11, 17]),
        page_size=page_size,
        heads=heads,
        head_dim=head_dim,
        block_tokens=page_size * rng.choice([1, 2, 3]),
        strided=rng.random() < 0.5,
        misalign=rng.random() < 0.3,
        shared_storage=rng.random() < 0.3,
        physical=rng.choice(PACKED_ORDERS) if layout is EngineLayout.VLLM_PACKED else None,
    )


@pytest.mark.parametrize("direction", list(Direction), ids=lambda d: d.value)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("layout", list(EngineLayout), ids=lambda x: x.value)
def test_kernel_matches_oracle(
    shim: ShimRunner, layout: EngineLayout, dtype: torch.dtype, direction: Direction
) -> None:
    seed = zlib.crc32(f"{layout.value}-{dtype}-{direction.value}".encode())
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    plain = CacheSpec(
        layout=layout,
        dtype=dtype,
        heads=1 if layout is EngineLayout.MLA else 2,
        physical=PACKED_ORDERS[0] if layout is EngineLayout.VLLM_PACKED else None,
    )
    for case, spec in enumerate(
        [plain, random_spec(layout, dtype, rng), random_spec(layout, dtype, rng)]
    ):
        engine = make_engine(spec, gen)
        bt = spec.block_tokens
        pages = num_pages(engine, bt)
        ppb = bt // engine.page_size(bt)
        num_blocks = min(rng.choice([1, 3, 5]), pages // ppb)
        num_slots = num_blocks + rng.choice([0, 2])
        staging = make_staging(engine, num_slots, bt, gen, misalign=spec.misalign and case % 2 == 0)
        page_ids, slot_ids = random_ids(
            direction is Direction.GATHER, num_blocks, ppb, pages, num_slots, gen
        )
        plan = run_and_compare(
            shim,
            engine,
            staging,
            direction,
            page_ids,
            slot_ids,
            tiny_launch=case == 2,
            reverse=case == 1,
        )
        if case == 0:  # aligned, contiguous rows of 16-byte multiples: the fast path
            assert plan.vec_bytes == 16, plan


@pytest.mark.parametrize("direction", list(Direction), ids=lambda d: d.value)
@pytest.mark.parametrize("width", VEC_WIDTHS)
def test_every_vector_width(shim: ShimRunner, width: int, direction: Direction) -> None:
    # uint8 rows of 3*width bytes: aligned to width, never to 2*width.
    gen = torch.Generator().manual_seed(width)
    spec = CacheSpec(EngineLayout.VLLM_NHD, torch.uint8, head_dim=3 * width, num_pages=12)
    engine = make_engine(spec, gen)
    staging = make_staging(engine, 4, spec.block_tokens, gen, misalign=False)
    page_ids, slot_ids = random_ids(direction is Direction.GATHER, 3, 2, 12, 4, gen)
    plan = run_and_compare(shim, engine, staging, direction, page_ids, slot_ids)
    assert plan.kernel == f"kv_{direction.value}_v{width}"


@pytest.mark.parametrize("layout", [EngineLayout.VLLM_NHD, EngineLayout.MLA], ids=lambda x: x.value)
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_caches(shim: ShimRunner, layout: EngineLayout, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(8)
    heads = 1 if layout is EngineLayout.MLA else 4
    spec = CacheSpec(layout, dtype, heads=heads, head_dim=32)
    for direction in Direction:
        engine = make_engine(spec, gen)
        staging = make_staging(engine, 3, spec.block_tokens, gen, misalign=False)
        page_ids, slot_ids = random_ids(direction is Direction.GATHER, 3, 2, 9, 3, gen)
        run_and_compare(shim, engine, staging, direction, page_ids, slot_ids)


def test_many_blocks_large_rows(shim: ShimRunner) -> None:
    # Llama-like rows (128 x bf16 = 256 B), many blocks: grid.y > 1 and a
    # multi-iteration loop per thread.
    gen = torch.Generator().manual_seed(7)
    spec = CacheSpec(
        EngineLayout.VLLM_HND,
        torch.bfloat16,
        num_layers=2,
        num_pages=40,
        page_size=16,
        heads=4,
        head_dim=128,
        block_tokens=64,
    )
    engine = make_engine(spec, gen)
    staging = make_staging(engine, 9, 64, gen, misalign=False)
    for direction in Direction:
        page_ids, slot_ids = random_ids(direction is Direction.GATHER, 9, 4, 40, 9, gen)
        plan = run_and_compare(shim, engine, staging, direction, page_ids, slot_ids)
        assert plan.vec_bytes == 16, plan
        assert plan.grid[1] > 1, plan


@pytest.mark.parametrize("direction", list(Direction), ids=lambda d: d.value)
@pytest.mark.parametrize("max_ctas", [1, 3, 7])
def test_a_capped_grid_loops_over_every_unit(shim: ShimRunner, max_ctas: int,
                                             direction: Direction) -> None:
    # 3 layers x 2 (K, V) x 5 blocks = 30 units on 1, 3 or 7 CTAs (grouped loads beside a
    # forward, `hf.CUDA_LOAD_CTAS`): each CTA walks several units, the last step uneven.
    gen = torch.Generator().manual_seed(max_ctas)
    spec = CacheSpec(EngineLayout.VLLM_NHD, torch.bfloat16, num_layers=3, num_pages=12,
                     heads=2, head_dim=64)
    engine = make_engine(spec, gen)
    staging = make_staging(engine, 6, spec.block_tokens, gen, misalign=False)
    page_ids, slot_ids = random_ids(direction is Direction.GATHER, 5, 2, 12, 6, gen)
    plan = run_and_compare(shim, engine, staging, direction, page_ids, slot_ids,
                           max_ctas=max_ctas, reverse=max_ctas == 3)
    assert plan.num_units == 30 and plan.grid == (max_ctas, 1, 1), plan


def _aligned_case(gen: torch.Generator) -> tuple[EngineKV, torch.Tensor, KernelLaunch]:
    spec = CacheSpec(EngineLayout.VLLM_NHD, torch.float16, head_dim=16)
    engine = make_engine(spec, gen)
    staging = make_staging(engine, 3, spec.block_tokens, gen, misalign=False)
    req = prepare(Direction.GATHER, engine, staging, [[0, 1], [2, 3]])
    return engine, staging, plan_launch(req, H100_SMS)


def test_sanitizer_catches_out_of_bounds_reads(shim: ShimRunner) -> None:
    # Guards the guard: a plan whose page stride overshoots the cache must be
    # stopped by ASan, or the shim would prove nothing about memory safety.
    engine, staging, plan = _aligned_case(torch.Generator().manual_seed(1))
    bad = dataclasses.replace(plan, page_stride=plan.page_stride * 64)
    ids = torch.tensor([[3, 4], [5, 6]])
    result = shim.run(bad, [*engine.all_tensors(), staging], ids, torch.tensor([0, 1]), check=False)
    assert "AddressSanitizer" in result.stderr, result.stderr[-2000:]


def test_sanitizer_catches_misaligned_vectors(shim: ShimRunner) -> None:
    # Forcing 16-byte vectors onto a cache that starts 2 bytes off alignment
    # must trip UBSan: vector_bytes() exists to never choose that.
    gen = torch.Generator().manual_seed(2)
    spec = CacheSpec(EngineLayout.VLLM_NHD, torch.float16, head_dim=16, misalign=True)
    engine = make_engine(spec, gen)
    staging = make_staging(engine, 3, spec.block_tokens, gen, misalign=False)
    req = prepare(Direction.GATHER, engine, staging, [[0, 1], [2, 3]])
    plan = plan_launch(req, H100_SMS)
    assert plan.vec_bytes == 2
    forced = dataclasses.replace(plan, kernel="kv_gather_v16", vec_bytes=16)
    result = shim.run(
        forced, [*engine.all_tensors(), staging], req.page_ids, req.slot_ids, check=False
    )
    assert "misaligned address" in result.stderr, result.stderr[-2000:]


def test_driver_exercises_every_exported_kernel() -> None:
    root = Path(__file__).resolve().parents[2]
    cu = (root / "kernels" / "kv_copy.cu").read_text()
    driver = (Path(__file__).parent / "host_shim" / "driver.cpp").read_text()
    exported = re.findall(r"^KV_COPY_KERNEL\((\w+),", cu, flags=re.M)
    in_driver = re.findall(r'\{"(kv_\w+)", kv_\w+\}', driver)
    assert sorted(exported) == sorted(KERNEL_NAMES) == sorted(in_driver)
