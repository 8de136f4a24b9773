"""GPU HBM tier: one device slab of page-aligned block runs.

The same code runs with `device="cpu"` in tests. In the daemon's chain (`gpu_bytes`) it sits
above host. A same-node client that maps the slab (`share`: CUDA IPC on a GPU; on the CPU a
file in the shared-memory directory, the same protocol) reads the blocks only this tier holds
straight from it; for any other client such a hit is copied into host memory for its fetch
(`read_into`). A promotion copies host bytes up (`write_from`). torch is imported here only
when a `GpuTier` is built: the daemon without a gpu level never imports it.
"""

from __future__ import annotations

import logging
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstore.arena import Arena
from kvstore.tiers.base import BlockEntry
from kvstore.tiers.slab import SlabTier

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class GpuTier(SlabTier):
    name = "gpu"

    def __init__(self, capacity_bytes: int, device: str | torch.device = "cuda",
                 shm_dir: str | Path | None = None) -> None:
        """`shm_dir`: on the CPU, hold the slab in a shared file there so that clients can map
        it (`share`), as they map the host arena; None: private memory, not shared."""
        import torch

        self._torch = torch
        self.device = torch.device(device)
        self.arena: Arena | None = None
        size = max(capacity_bytes, 0)
        if self.device.type == "cpu" and shm_dir is not None:
            self.arena = Arena.create(shm_dir, size)
            buf = self.arena.tensor
        else:
            buf = torch.empty(size, dtype=torch.uint8, device=self.device)
        self.slab_id = self.arena.path.name if self.arena is not None else secrets.token_hex(8)
        self._shared: dict[str, Any] | None = None  # `share`'s fields, made once
        self._unshareable = False  # `share` failed once: never tried again
        super().__init__(capacity_bytes, buf)

    def share(self) -> dict[str, Any] | None:
        """What a same-node client needs to map the slab (`kvstore.proto` `Slab`'s fields), or
        None where it cannot be shared. On CUDA the IPC reference is made once (torch's
        `_share_cuda_`) and given to every client: one per Info call would leave a reference
        count in shared memory for each call whose client never maps it (a health check)."""
        if self._shared is not None or self._unshareable:
            return self._shared
        try:
            self._shared = self._share()
        except Exception as e:  # e.g. an allocator whose memory CUDA IPC cannot export
            self._unshareable = True
            log.warning("the gpu tier's slab cannot be shared with clients (%s): its blocks "
                        "reach them through host memory", e)
        return self._shared

    def _share(self) -> dict[str, Any] | None:
        size = int(self.buffer.shape[0])
        base: dict[str, Any] = {"id": self.slab_id, "size": size}
        if self.arena is not None:
            return {**base, "device": "cpu", "path": str(self.arena.path)}
        if self.device.type == "cuda" and size:
            (_, handle, storage_bytes, storage_offset, counter_handle, counter_offset,
             event_handle, event_sync) = self.buffer.untyped_storage()._share_cuda_()
            props = self._torch.cuda.get_device_properties(self.device)
            return {
                **base, "device": "cuda", "device_uuid": str(props.uuid),
                "ipc_handle": handle, "ipc_storage_bytes": storage_bytes,
                "ipc_storage_offset": storage_offset, "ipc_ref_counter_handle": counter_handle,
                "ipc_ref_counter_offset": counter_offset, "ipc_event_handle": event_handle or b"",
                "ipc_event_sync_required": bool(event_sync)}
        return None

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
        if self.arena is not None:  # a client still mapping it reads holes (as the host arena)
            self.arena.free_pages()
            self.arena.unlink()
