"""GPU HBM tier: one device slab of page-aligned block runs.

The same code runs with `device="cpu"` in tests. In the daemon's chain (`gpu_bytes`) it sits
above host: clients still read blocks from the host arena, so a gpu hit is copied into host
memory for its fetch (`read_into`) and a promotion copies host bytes up (`write_from`).
Same-node engines reading the slab directly through CUDA IPC is not done yet (see
docs/ARCHITECTURE.md). torch is imported here only when a `GpuTier` is built: the daemon
without a gpu level never imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.tiers.base import BlockEntry
from kvstore.tiers.slab import SlabTier

if TYPE_CHECKING:
    import torch


class GpuTier(SlabTier):
    name = "gpu"

    def __init__(self, capacity_bytes: int, device: str | torch.device = "cuda") -> None:
        import torch

        self._torch = torch
        self.device = torch.device(device)
        buf = torch.empty(max(capacity_bytes, 0), dtype=torch.uint8, device=self.device)
        super().__init__(capacity_bytes, buf)

    def _host(self, mem: memoryview) -> torch.Tensor:
        return self._torch.frombuffer(mem, dtype=self._torch.uint8)

    def read_into(self, entry: BlockEntry, dst: memoryview) -> None:
        """Copy a block (pinned by the caller) into host memory `dst` (runs in a worker)."""
        self._host(dst).copy_(self.view(entry))

    def write_from(self, entry: BlockEntry, src: memoryview) -> None:
        """Copy host memory `src` into a reserved block (runs in a worker)."""
        self.view(entry).copy_(self._host(src))

    def close(self) -> None:
        super().close()
        self.buffer = self._torch.empty(0, dtype=self._torch.uint8, device=self.device)
