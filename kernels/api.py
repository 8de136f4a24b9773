"""The one entry point for block copies: ``gather`` and ``scatter``.

The path follows the engine cache's device: a CUDA cache runs the NVRTC-compiled
kernel (kv_copy.cu) on the caller's stream; a CPU cache runs the torch twin
(reference.py). Both validate the call identically (plan.prepare), so a call
that works on the CPU works on the GPU and the other way round.
"""

from __future__ import annotations

import torch

from kvstore.kernels import reference
from kvstore.kernels.errors import DeviceError
from kvstore.kernels.layouts import EngineKV
from kvstore.kernels.plan import CopyRequest, Direction, IdsLike, plan_launch, prepare


def gather(
    engine: EngineKV,
    staging: torch.Tensor,
    page_ids: IdsLike,
    slot_ids: IdsLike | None = None,
    *,
    stream: torch.cuda.Stream | None = None,
    max_ctas: int | None = None,
) -> None:
    """Copy blocks out of ``engine`` into ``staging`` slots, all layers at once.

    ``staging`` is ``[num_slots, layers, kv, block_tokens, heads, head_dim]``
    (``kernels.staging_shape``); block ``i`` is made of the engine pages
    ``page_ids[i]`` (``block_tokens / page_size`` of them) and goes to slot
    ``slot_ids[i]`` (default ``i``). On CUDA the copy is queued on ``stream``
    (default: the current stream) and this returns before it finishes; ``max_ctas``
    caps its grid (``plan.launch_shape``: a copy beside other kernels leaves them SMs).
    """
    _run(prepare(Direction.GATHER, engine, staging, page_ids, slot_ids), engine, stream,
         max_ctas)


def scatter(
    staging: torch.Tensor,
    engine: EngineKV,
    page_ids: IdsLike,
    slot_ids: IdsLike | None = None,
    *,
    stream: torch.cuda.Stream | None = None,
    max_ctas: int | None = None,
) -> None:
    """Copy staging slots back into engine pages: the inverse of ``gather``."""
    _run(prepare(Direction.SCATTER, engine, staging, page_ids, slot_ids), engine, stream,
         max_ctas)


def _run(req: CopyRequest, engine: EngineKV, stream: torch.cuda.Stream | None,
         max_ctas: int | None = None) -> None:
    if max_ctas is not None and max_ctas < 1:  # checked on the CPU too: the same calls work
        raise ValueError(f"max_ctas must be >= 1, got {max_ctas}")
    device = engine.device
    if device.type == "cpu":
        if req.staging.device.type != "cpu":
            raise DeviceError(
                f"engine cache on the CPU but staging on {req.staging.device}: "
                "the CPU path copies between host tensors only"
            )
        reference.run(req)
        return
    if device.type != "cuda":
        raise DeviceError(f"no copy path for engine tensors on {device}")
    # Imported here: the CUDA path pulls in cupy, which CPU-only users lack.
    from kvstore.kernels import cuda

    if req.staging.device == device:
        staging_ptr = req.staging.data_ptr()
    elif req.staging.device.type == "cpu":
        staging_ptr = cuda.mapped_device_pointer(req.staging, device)
    else:
        raise DeviceError(f"engine cache on {device} but staging on {req.staging.device}")
    if req.num_blocks == 0:
        return
    plan = plan_launch(req, cuda.sm_count(device), staging_ptr=staging_ptr, max_ctas=max_ctas)
    cuda.launch(
        plan,
        req.page_ids,
        req.slot_ids,
        device,
        stream if stream is not None else torch.cuda.current_stream(device),
    )
