"""The public API: clear, typed errors for bad calls, and launch planning."""

from __future__ import annotations

import sys

import pytest
import torch

from kvstore import kernels
from kvstore.kernels import EngineKV, EngineLayout
from kvstore.kernels.plan import Direction, launch_shape, plan_launch, prepare, vector_bytes


def nhd(num_layers: int = 2, pages: int = 6, dtype: torch.dtype = torch.float16) -> EngineKV:
    return EngineKV.paged(
        EngineLayout.VLLM_NHD,
        [torch.zeros(2, pages, 4, 2, 8, dtype=dtype) for _ in range(num_layers)],
    )


def staging_for(engine: EngineKV, slots: int = 2, block_tokens: int = 8) -> torch.Tensor:
    return torch.zeros(kernels.staging_shape(engine, slots, block_tokens), dtype=engine.dtype)


def test_errors_are_value_errors() -> None:
    for err in (
        kernels.ShapeError,
        kernels.DTypeError,
        kernels.DeviceError,
        kernels.StrideError,
        kernels.BlockIdError,
    ):
        assert issubclass(err, kernels.KernelArgumentError)
        assert issubclass(err, ValueError)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: EngineKV.paged(EngineLayout.VLLM_NHD, []), kernels.ShapeError, "at least one"),
        (
            lambda: EngineKV.paged(EngineLayout.VLLM_NHD, [torch.zeros(2, 3, 4, 5)]),
            kernels.ShapeError,
            "rank-5",
        ),
        (
            lambda: EngineKV.paged(EngineLayout.VLLM_NHD, [torch.zeros(3, 3, 4, 2, 8)]),
            kernels.ShapeError,
            "leading K/V dim of 2",
        ),
        (
            lambda: EngineKV.paged(EngineLayout.MLA, [torch.zeros(3, 4, 8), torch.zeros(3, 4, 16)]),
            kernels.ShapeError,
            "share one shape",
        ),
        (
            lambda: EngineKV.paged(
                EngineLayout.MLA, [torch.zeros(3, 4, 8), torch.zeros(3, 4, 8, dtype=torch.half)]
            ),
            kernels.DTypeError,
            "tensor 1 is torch.float16",
        ),
        (
            lambda: EngineKV.paged(EngineLayout.MLA, [torch.zeros(3, 4, 8, dtype=torch.int32)]),
            kernels.DTypeError,
            "unsupported KV dtype",
        ),
        (
            lambda: EngineKV.paged(EngineLayout.HF, [torch.zeros(1, 2, 8, 4)]),
            kernels.ShapeError,
            "EngineKV.transformers",
        ),
        (
            lambda: EngineKV.transformers([torch.zeros(1, 2, 8, 4)], []),
            kernels.ShapeError,
            "one V per K",
        ),
        (
            lambda: EngineKV.transformers(
                [torch.zeros(1, 2, 8, 4)], [torch.zeros(1, 2, 8, 4)], batch_index=1
            ),
            kernels.ShapeError,
            "batch_index 1",
        ),
        (
            lambda: EngineKV.paged(EngineLayout.VLLM_CPU, [torch.zeros(3, 2, 4, 7)]),
            kernels.ShapeError,
            "even last dim",
        ),
    ],
)
def test_engine_validation(make, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        make()


def test_vllm_cpu_needs_dense_token_rows() -> None:
    padded = torch.zeros(3, 2, 4, 20)[..., :16]  # rows of 2*head_dim not contiguous
    engine = EngineKV.paged(EngineLayout.VLLM_CPU, [padded])
    with pytest.raises(kernels.StrideError, match="must be contiguous"):
        kernels.gather(engine, torch.zeros(1, 1, 2, 4, 2, 8), [0])


@pytest.mark.parametrize(
    ("staging", "page_ids", "slot_ids", "error", "message"),
    [
        (torch.zeros(2, 8), [[0, 1]], None, kernels.ShapeError, "staging must be"),
        (
            torch.zeros(2, 2, 2, 8, 2, 8, dtype=torch.float32),
            [[0, 1]],
            None,
            kernels.DTypeError,
            "staging is torch.float32",
        ),
        (
            torch.zeros(2, 2, 2, 6, 2, 8, dtype=torch.half),
            [[0]],
            None,
            kernels.ShapeError,
            "divide",
        ),
        (
            torch.zeros(2, 3, 2, 8, 2, 8, dtype=torch.half),
            [[0, 1]],
            None,
            kernels.ShapeError,
            "expected",
        ),
        (None, [[0, 1, 2]], None, kernels.ShapeError, r"page_ids must be \[num_blocks, 2\]"),
        (None, [0, 1, 2], None, kernels.ShapeError, "page_ids must be"),
        (None, [[0, 6]], None, kernels.BlockIdError, "contains 6, outside the 6 engine pages"),
        (None, [[-1, 0]], None, kernels.BlockIdError, "contains -1"),
        (None, [[0, 1]], [2], kernels.BlockIdError, "outside the 2 staging slots"),
        (None, [[0, 1], [2, 3]], [0], kernels.ShapeError, "1 slot_ids for 2 blocks"),
        (None, [[0, 1], [2, 3]], [1, 1], kernels.BlockIdError, "slot_ids repeat"),
        (None, torch.tensor([[0.0, 1.0]]), None, kernels.DTypeError, "must be integers"),
        (None, ["a", "b"], None, kernels.DTypeError, "sequence of ints"),
    ],
)
def test_gather_validation(staging, page_ids, slot_ids, error, message) -> None:
    engine = nhd()
    staging = staging_for(engine) if staging is None else staging
    with pytest.raises(error, match=message):
        kernels.gather(engine, staging, page_ids, slot_ids)


def test_scatter_rejects_repeated_pages_but_not_slots() -> None:
    engine = nhd()
    staging = staging_for(engine)
    with pytest.raises(kernels.BlockIdError, match="page_ids repeat"):
        kernels.scatter(staging, engine, [[0, 1], [1, 2]])
    kernels.scatter(staging, engine, [[0, 1], [2, 3]], slot_ids=[1, 1])  # one slot, two places


def test_staging_slots_must_not_overlap_and_be_dense() -> None:
    engine = nhd()
    base = torch.zeros(kernels.staging_shape(engine, 2, 8), dtype=torch.half)
    with pytest.raises(kernels.StrideError, match="each staging slot must be contiguous"):
        kernels.gather(engine, base.transpose(3, 4).contiguous().transpose(3, 4), [[0, 1]])
    overlapping = base.as_strided(base.shape, (16, *base.stride()[1:]))
    with pytest.raises(kernels.StrideError, match="overlap"):
        kernels.gather(engine, overlapping, [[0, 1]])


def test_device_errors() -> None:
    engine = nhd()
    meta_staging = torch.empty(kernels.staging_shape(engine, 2, 8), dtype=torch.half, device="meta")
    with pytest.raises(kernels.DeviceError, match="staging on meta"):
        kernels.gather(engine, meta_staging, [[0, 1]])
    meta_engine = EngineKV.paged(
        EngineLayout.VLLM_NHD, [torch.empty(2, 6, 4, 2, 8, dtype=torch.half, device="meta")]
    )
    with pytest.raises(kernels.DeviceError, match="no copy path"):
        kernels.gather(meta_engine, meta_staging[:, :1], [[0, 1]])


def test_empty_request_is_a_no_op() -> None:
    engine = nhd()
    staging = staging_for(engine)
    kernels.gather(engine, staging, torch.zeros(0, 2, dtype=torch.int64))
    kernels.scatter(staging, engine, [])


def test_ids_from_any_integer_tensor() -> None:
    engine = nhd()
    for layer in engine.layers:
        layer.copy_(torch.arange(layer.numel()).reshape(layer.shape).half())
    a, b = staging_for(engine), staging_for(engine)
    kernels.gather(
        engine, a, torch.tensor([[4, 5]], dtype=torch.int32), torch.tensor([1], dtype=torch.uint8)
    )
    kernels.gather(engine, b, [4, 5], [1])
    assert torch.equal(a, b)
    assert a[1].any()
    assert not a[0].any()


def test_vector_width_follows_alignment() -> None:
    assert vector_bytes(256, [0x1000, 0x2000], [4096, 256]) == 16
    assert vector_bytes(256, [0x1008], [4096]) == 8
    assert vector_bytes(24, [0x1000], [48]) == 8
    assert vector_bytes(256, [0x1002], [4096]) == 2
    assert vector_bytes(6, [0x1000], [12]) == 2
    assert vector_bytes(7, [0x1000], [14]) == 1


def test_launch_shape_fills_the_gpu_for_small_requests() -> None:
    # Few units with big planes: y-splits add CTAs until every SM has work.
    grid, block = launch_shape(num_units=4, vecs_per_unit=1 << 20, sm_count=132)
    assert block == (256, 1, 1)
    assert grid[0] == 4
    assert grid[0] * grid[1] >= 4 * 132
    # ...but never more CTAs than a unit has chunks of THREADS * UNROLL vectors.
    assert launch_shape(4, 32768, 132)[0] == (4, 32, 1)
    # Plenty of units: no split; a tiny unit gets a warp-sized CTA.
    assert launch_shape(10_000, 64, 132) == ((10_000, 1, 1), (64, 1, 1))
    assert launch_shape(3, 1, 132)[1] == (32, 1, 1)


def test_max_ctas_caps_the_grid_and_is_checked_on_every_device() -> None:
    # Capped: at most max_ctas CTAs, no y-split (each CTA loops over units in x).
    assert launch_shape(10_000, 1 << 20, 132, max_ctas=32) == ((32, 1, 1), (256, 1, 1))
    assert launch_shape(4, 1 << 20, 132, max_ctas=32)[0] == (4, 1, 1)  # never more than units
    engine = nhd()
    staging = staging_for(engine)
    req = prepare(Direction.GATHER, engine, staging, [[0, 1], [2, 3]])
    plan = plan_launch(req, 132, max_ctas=3)
    assert plan.grid == (3, 1, 1) and plan.num_units == 2 * 2 * 2  # blocks x layers x (K, V)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="max_ctas must be >= 1"):
            kernels.gather(engine, staging, [[0, 1]], max_ctas=bad)  # the CPU path checks too
    kernels.gather(engine, staging, [[0, 1]], max_ctas=1)  # and runs it as any other


def test_plan_describes_strides_in_bytes() -> None:
    engine = nhd(num_layers=3, dtype=torch.bfloat16)
    staging = staging_for(engine, slots=3)
    req = prepare(Direction.GATHER, engine, staging, [[0, 1], [2, 3]], [2, 0])
    plan = plan_launch(req, sm_count=132)
    assert plan.kernel == "kv_gather_v16"
    assert (plan.page_stride, plan.token_stride, plan.head_stride) == (4 * 2 * 8 * 2, 2 * 8 * 2, 16)
    assert plan.row_bytes == 16
    assert plan.num_planes == 6
    assert plan.grid[0] == 2 * 6
    assert plan.slot_stride == staging[0].numel() * 2
    k0, v0 = engine.layers[0][0], engine.layers[0][1]
    assert plan.plane_ptrs[:2] == (k0.data_ptr(), v0.data_ptr())


def test_kernel_arguments_point_at_the_metadata() -> None:
    # What kernels.cuda.launch hands to cupy, checked without a GPU: each
    # pointer lands on the array the kernel expects, each scalar has its C type.
    import ctypes

    import numpy as np

    from kvstore.kernels.cuda import kernel_arguments, metadata
    from kvstore.kernels.plan import scalar_args

    engine = nhd(num_layers=2)
    staging = staging_for(engine, slots=3)
    req = prepare(Direction.SCATTER, engine, staging, [[4, 5], [0, 1]], [2, 1])
    plan = plan_launch(req, sm_count=132)
    meta = metadata(plan, req.page_ids, req.slot_ids)
    args = kernel_arguments(plan, meta.data_ptr(), req.page_ids.numel())

    def read(address: np.uint64, n: int) -> list[int]:
        return list((ctypes.c_int64 * n).from_address(int(address)))

    assert read(args[0], 4) == list(plan.plane_ptrs)
    assert read(args[1], 4) == [4, 5, 0, 1]
    assert read(args[2], 2) == [2, 1]
    assert int(args[3]) == staging.data_ptr()
    assert [type(a) for a in args[4:]] == [np.int32] * 5 + [np.int64] * 4 + [np.int32]
    assert tuple(int(a) for a in args[4:]) == scalar_args(plan)


def test_plane_strides_must_agree() -> None:
    keys = [torch.zeros(1, 2, 8, 4)]
    values = [torch.zeros(1, 8, 2, 4).transpose(1, 2)]  # same shape, other strides
    engine = EngineKV.transformers(keys, values)
    with pytest.raises(kernels.StrideError, match="differ from plane 0"):
        kernels.gather(engine, torch.zeros(1, 1, 2, 8, 2, 4), [0])
    columns = [torch.zeros(1, 2, 4, 8).transpose(2, 3)]  # head_dim strided
    engine = EngineKV.transformers(columns, columns)
    with pytest.raises(kernels.StrideError, match="head_dim must be contiguous"):
        kernels.gather(engine, torch.zeros(1, 1, 2, 4, 2, 4), [0])


def test_cuda_path_errors_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore.kernels import cuda

    with pytest.raises(kernels.DeviceError, match="must be pinned"):
        cuda.mapped_device_pointer(torch.zeros(4))  # pageable: unreachable from a GPU
    monkeypatch.setitem(sys.modules, "cupy", None)  # as if cupy were not installed
    with pytest.raises(kernels.KernelUnavailableError, match="needs cupy"):
        cuda._cupy()
