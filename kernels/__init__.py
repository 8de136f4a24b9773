"""Block copies between an engine's paged KV cache and kvstore's staging buffers.

``gather``/``scatter`` move whole kvstore blocks, all layers in one launch, in
the canonical layout ``[layers, kv, block_tokens, heads, head_dim]`` per block.
CUDA tensors go through a kernel compiled at run time (kv_copy.cu, NVRTC via
cupy); CPU tensors through its pure-torch twin (reference.py).
"""

from kvstore.kernels.api import gather, scatter
from kvstore.kernels.errors import (
    BlockIdError,
    DeviceError,
    DTypeError,
    KernelArgumentError,
    KernelUnavailableError,
    LayoutError,
    ShapeError,
    StrideError,
)
from kvstore.kernels.layouts import (
    VLLM_LAYOUTS,
    EngineKV,
    EngineLayout,
    VllmLayout,
    staging_shape,
    vllm_engine_kv,
    vllm_layout,
)

__all__ = [
    "VLLM_LAYOUTS",
    "BlockIdError",
    "DTypeError",
    "DeviceError",
    "EngineKV",
    "EngineLayout",
    "KernelArgumentError",
    "KernelUnavailableError",
    "LayoutError",
    "ShapeError",
    "StrideError",
    "VllmLayout",
    "gather",
    "scatter",
    "staging_shape",
    "vllm_engine_kv",
    "vllm_layout",
]
