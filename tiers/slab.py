"""A memory tier over one flat byte buffer: host shared memory (a numpy view of the arena) or a
device slab (a torch tensor). The daemon's host path never needs torch."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore.tiers.base import BlockEntry, Tier


class SlabTier(Tier):
    """Blocks as page-aligned runs of one flat `uint8` buffer (numpy array or torch tensor)."""

    def __init__(self, capacity_bytes: int, buffer: Any) -> None:
        super().__init__(capacity_bytes)
        if len(buffer.shape) != 1 or buffer.shape[0] < self.capacity_bytes or str(
                buffer.dtype).removeprefix("torch.") != "uint8":
            raise ValueError("slab buffer must be a 1-D uint8 buffer of at least the capacity")
        self.buffer = buffer

    def view(self, entry: BlockEntry) -> Any:
        """The block's payload bytes (a view of the buffer: writes land in the tier)."""
        return self.buffer[entry.offset : entry.offset + entry.length]

    def memview(self, entry: BlockEntry) -> memoryview:
        """The block's bytes as a writable memoryview, for file and socket I/O (host memory)."""
        v = self.view(entry)
        return v.data if isinstance(v, np.ndarray) else v.numpy().data

    def close(self) -> None:
        self._forget_all()
