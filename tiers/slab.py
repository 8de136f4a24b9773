"""A memory tier over one flat byte buffer (host shared memory or a device slab)."""

from __future__ import annotations

import torch

from tiers.base import BlockEntry, Tier


class SlabTier(Tier):
    """Blocks as page-aligned runs of one `uint8` tensor; readers copy through `view`."""

    def __init__(self, capacity_bytes: int, buffer: torch.Tensor) -> None:
        super().__init__(capacity_bytes)
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < self.capacity_bytes:
            raise ValueError("slab buffer must be a 1-D uint8 tensor of at least the capacity")
        self.buffer = buffer

    def view(self, entry: BlockEntry) -> torch.Tensor:
        """The block's payload bytes (a view: writes land in the tier)."""
        return self.buffer[entry.offset : entry.offset + entry.length]

    def close(self) -> None:
        self.entries.clear()
