"""Host RAM tier: one shared-memory arena that the daemon owns and same-node clients map.

When CUDA exists the arena is registered as pinned memory (`cudaHostRegister`) so device copies
run at full bus speed; without a GPU, pinning is skipped (`pin_memory` raises there).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from kvstore.arena import Arena
from tiers.slab import SlabTier

log = logging.getLogger(__name__)


class HostTier(SlabTier):
    name = "host"

    def __init__(self, capacity_bytes: int, shm_dir: str | Path = "/dev/shm") -> None:
        stale = Arena.remove_stale(shm_dir)
        if stale:
            log.info("removed %d arena files of dead daemons from %s", stale, shm_dir)
        self.arena = Arena.create(shm_dir, max(capacity_bytes, 0))
        super().__init__(capacity_bytes, self.arena.tensor)
        self.pinned = self._register_pinned()

    def _register_pinned(self) -> bool:
        if not torch.cuda.is_available() or self.arena.size == 0:
            return False
        rc = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), self.arena.size, 0)
        if int(rc) != 0:
            log.warning("cudaHostRegister of the host arena failed (%s); copies will be pageable",
                        rc)
            return False
        return True

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self.pinned = False
        self.arena.unlink()
        super().close()
