"""Host RAM tier: one shared-memory arena that the daemon owns and same-node clients map.

When CUDA exists the arena is registered as pinned memory (`cudaHostRegister`) so device copies
run at full bus speed; without a GPU, pinning is skipped (`pin_memory` raises there).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

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
        super().__init__(capacity_bytes, self.arena.array)
        self.pinned = self._register_pinned()

    def _register_pinned(self) -> bool:
        # Import torch only where a GPU driver exists: the CPU daemon starts without torch.
        if self.arena.size == 0 or not os.path.exists("/proc/driver/nvidia"):
            return False
        import torch

        if not torch.cuda.is_available():
            return False
        rc = torch.cuda.cudart().cudaHostRegister(self.buffer.ctypes.data, self.arena.size, 0)
        if int(rc) != 0:
            log.warning("cudaHostRegister of the host arena failed (%s); copies will be pageable",
                        rc)
            return False
        return True

    def close(self) -> None:
        if self.pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.buffer.ctypes.data)
            self.pinned = False
        self.arena.unlink()
        super().close()
