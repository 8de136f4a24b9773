"""GPU HBM tier: one device slab of page-aligned block runs.

The same code runs with `device="cpu"` in tests; on a GPU, copies into and out of the slab are
device copies, and same-node engines reach it through CUDA IPC (see kernels/).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.tiers.slab import SlabTier

if TYPE_CHECKING:
    import torch


class GpuTier(SlabTier):
    name = "gpu"

    def __init__(self, capacity_bytes: int, device: str | torch.device = "cuda") -> None:
        import torch

        self.device = torch.device(device)
        buf = torch.empty(max(capacity_bytes, 0), dtype=torch.uint8, device=self.device)
        super().__init__(capacity_bytes, buf)

    def close(self) -> None:
        import torch

        super().close()
        self.buffer = torch.empty(0, dtype=torch.uint8, device=self.device)
