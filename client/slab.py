"""A same-node client's mapping of the daemon's gpu slab (`InfoReply.slab`).

With the slab mapped, a fetch may be served blocks that only the daemon's gpu level holds
where they lie (`BlockRef.in_slab`, pinned by the fetch's lease): on a GPU a device-to-device
copy into the engine's cache, instead of the daemon copying them to host scratch space and
the client copying them back across the bus. On a CUDA device the slab is shared by CUDA IPC
(torch's own `_share_cuda_` / `_new_shared_cuda`, the fields `kvstore.proto`'s `Slab`
carries); on the CPU (`--gpu-device cpu`) it is a file in the shared-memory directory, so the
same protocol runs and is tested without a GPU. A client that cannot map it (another node, no
CUDA, a device this process does not see, `KVCLIENT_SLAB=0`) just does not ask for slab blocks.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from dataclasses import dataclass

import torch

from kvstore.arena import Arena
from kvstore.proto import kvstore_pb2 as pb

log = logging.getLogger("kvstore.client")

SLAB_ENV = "KVCLIENT_SLAB"  # "0": never map the daemon's gpu slab (blocks come via host)


@dataclass
class MappedSlab:
    """The daemon's slab as a flat `uint8` tensor on its device, and what keeps it mapped."""

    tensor: torch.Tensor
    # The CPU slab's file: unmapped through `Arena`'s own path (never under a tensor's
    # deleter, which would abort a process exiting meanwhile: kvstore/arena.py `_reap`).
    arena: Arena | None = None


# One mapping per slab per process: CUDA refuses to open one IPC handle twice in a process,
# and clients of several namespaces share the mapping as they share the arena's.
_slabs: weakref.WeakValueDictionary[str, MappedSlab] = weakref.WeakValueDictionary()
_lock = threading.Lock()


def map_slab(slab: pb.Slab) -> MappedSlab | None:
    """The daemon's slab mapped in this process, or None where this process cannot map it
    (logged at debug level: not an error, the host path serves)."""
    if not slab.id or not slab.size or os.environ.get(SLAB_ENV, "1") == "0":
        return None
    with _lock:
        mapped = _slabs.get(slab.id)
        if mapped is not None:
            return mapped
        try:
            mapped = _open(slab)
        except Exception as e:  # a failed IPC open, a file gone: the host path still serves
            log.debug("cannot map the daemon's gpu slab %s (%s); its blocks come via host",
                      slab.id, e)
            return None
        if mapped is not None:
            _slabs[slab.id] = mapped
        return mapped


def _open(slab: pb.Slab) -> MappedSlab | None:
    if slab.device == "cpu":
        arena = Arena.attach(slab.path, slab.size)
        return MappedSlab(arena.tensor, arena)
    if slab.device != "cuda" or not torch.cuda.is_available():
        return None
    index = cuda_index(slab.device_uuid)
    if index is None:
        return None
    storage = torch.UntypedStorage._new_shared_cuda(  # CUDA is initialised by `cuda_index`
        index, slab.ipc_handle, slab.ipc_storage_bytes, slab.ipc_storage_offset,
        slab.ipc_ref_counter_handle, slab.ipc_ref_counter_offset,
        slab.ipc_event_handle if slab.ipc_event_sync_required else None,
        slab.ipc_event_sync_required)
    tensor = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}")
    return MappedSlab(tensor.set_(storage, 0, (slab.size,), (1,)))


def cuda_index(uuid: str) -> int | None:
    """This process's index of the CUDA device whose UUID is `uuid` (its numbering may differ
    from the daemon's: `CUDA_VISIBLE_DEVICES`), or None where it does not see it."""
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    return None
