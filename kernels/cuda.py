"""The CUDA path: compile kv_copy.cu at run time with NVRTC (through cupy) and launch it.

Nothing is compiled at install: cupy's ``RawModule`` compiles the source the
first time a device needs it and caches the binary on disk, so there is no
extension built against one torch or CUDA version. cupy is imported lazily,
so CPU-only installs never need it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kvstore.kernels.errors import DeviceError, KernelUnavailableError
from kvstore.kernels.plan import SCALAR_PARAMS, KernelLaunch, scalar_args

SOURCE_DIR = Path(__file__).resolve().parent
KV_COPY_SOURCE = SOURCE_DIR / "kv_copy.cu"
NVRTC_OPTIONS: tuple[str, ...] = ("-std=c++17",)


def cuda_sources() -> list[Path]:
    """Every CUDA source of the package (the tests compile each one)."""
    return sorted(SOURCE_DIR.glob("*.cu"))


def _cupy() -> Any:
    try:
        import cupy  # optional: only the CUDA path needs it
    except ImportError as e:
        raise KernelUnavailableError(
            f"the CUDA copy path needs cupy (pip install cupy-cuda12x); import failed: {e}"
        ) from e
    return cupy


@contextlib.contextmanager
def _on_device(index: int) -> Iterator[None]:
    """Make device `index`'s primary context current on this thread for the calls inside.

    A thread that has made no CUDA runtime call yet has no current context (a client's
    loading thread): there, `cudaPointerGetAttributes` does not know pinned memory and the
    driver calls behind a module's kernels fail. `cupy.cuda.Device` skips `cudaSetDevice`
    when the device is already the thread's (0 by default), so it is called here always:
    since CUDA 12 it makes the primary context current."""
    runtime = _cupy().cuda.runtime
    previous = runtime.getDevice()
    runtime.setDevice(index)
    try:
        yield
    finally:
        if previous != index:
            runtime.setDevice(previous)


def _index(device: torch.device | None) -> int:
    if device is not None and device.index is not None:
        return device.index
    return torch.cuda.current_device()


@functools.cache
def _module(device_index: int) -> Any:
    cupy = _cupy()
    with cupy.cuda.Device(device_index):
        return cupy.RawModule(
            code=KV_COPY_SOURCE.read_text(), options=NVRTC_OPTIONS, backend="nvrtc"
        )


def sm_count(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def mapped_device_pointer(host: torch.Tensor, device: torch.device | None = None) -> int:
    """Device address of pinned host memory, for zero-copy access from a kernel on `device`
    (default: the current one), from any thread."""
    if not host.is_pinned():
        raise DeviceError(
            "CPU staging for a CUDA engine cache must be pinned (tensor.pin_memory(), or "
            "cudaHostRegister with cudaHostRegisterMapped): pageable memory is not "
            "reachable from the GPU"
        )
    cupy = _cupy()
    runtime = cupy.cuda.runtime
    storage = host.untyped_storage().data_ptr()
    try:
        with _on_device(_index(device)):
            attrs = runtime.pointerGetAttributes(storage)
    except runtime.CUDARuntimeError as e:
        raise DeviceError(f"cannot query the staging memory: {e}") from e
    base = int(attrs.devicePointer)
    if attrs.type != runtime.memoryTypeHost or base == 0:
        raise DeviceError(
            "pinned staging is not mapped into the device address space "
            "(register it with cudaHostRegisterMapped)"
        )
    return base + (host.data_ptr() - storage)


def metadata(plan: KernelLaunch, page_ids: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
    """The kernel's three id arrays in one int64 host tensor: planes, pages, slots."""
    planes = torch.tensor(plan.plane_ptrs, dtype=torch.int64)
    return torch.cat([planes, page_ids.reshape(-1), slot_ids.reshape(-1)])


def kernel_arguments(plan: KernelLaunch, meta_ptr: int, num_page_ids: int) -> tuple[Any, ...]:
    """The launch's argument tuple, typed as the kernel declares it.

    ``meta_ptr`` is where ``metadata()`` was copied to (device memory)."""
    import numpy as np

    n_planes = len(plan.plane_ptrs)
    pointers = (
        meta_ptr,  # planes
        meta_ptr + 8 * n_planes,  # page_ids
        meta_ptr + 8 * (n_planes + num_page_ids),  # slot_ids
        plan.staging_ptr,
    )
    c_types = {"i32": np.int32, "i64": np.int64}
    scalars = tuple(
        c_types[c_type](value)
        for (_, c_type), value in zip(SCALAR_PARAMS, scalar_args(plan), strict=True)
    )
    return tuple(np.uint64(p) for p in pointers) + scalars


def launch(
    plan: KernelLaunch,
    page_ids: torch.Tensor,
    slot_ids: torch.Tensor,
    device: torch.device,
    stream: torch.cuda.Stream,
) -> None:
    """Launch ``plan`` on ``stream``; returns without waiting for the copy."""
    cupy = _cupy()
    index = _index(device)
    with _on_device(index):  # from any thread: a loading thread may have no context yet
        kernel = _module(index).get_function(plan.kernel)
        host_meta = metadata(plan, page_ids, slot_ids)
        with torch.cuda.stream(stream):
            # One async upload for all ids (pinned, so the caller's stream is never
            # synchronised). Allocated while ``stream`` is current, so the caching
            # allocator cannot give the memory to other work before the kernel
            # queued behind the upload on this stream has read it.
            meta = host_meta.pin_memory().to(device, non_blocking=True)
        args = kernel_arguments(plan, meta.data_ptr(), page_ids.numel())
        # The caller's stream through the CUDA stream protocol (torch streams implement
        # it), passed explicitly (cupy's ExternalStream is deprecated).
        kernel(plan.grid, plan.block, args, stream=cupy.cuda.Stream.from_external(stream))
