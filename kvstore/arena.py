"""The shared-memory arena file: created by the daemon's host tier, mapped by same-node clients.

Data between an engine and the daemon on one machine crosses no socket: the client copies
into or out of the mapping at offsets the daemon hands out under a lease.
"""

from __future__ import annotations

import mmap
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


class Arena:
    """A file-backed shared mapping exposed as a flat `uint8` tensor."""

    def __init__(self, path: Path, size: int, *, create: bool) -> None:
        self.path = path
        self.size = size
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size < size:
                raise ValueError(f"arena {path} is smaller than the {size} bytes announced")
            # mmap refuses an empty mapping; a zero-byte arena is a valid (useless) tier.
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED,
                                   mmap.PROT_READ | mmap.PROT_WRITE) if size else None
        except BaseException:
            if create:  # do not leave a stray file in /dev/shm
                path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self.array = (np.frombuffer(self._mmap, dtype=np.uint8) if self._mmap is not None
                      else np.zeros(0, dtype=np.uint8))
        self._tensor: torch.Tensor | None = None

    @property
    def tensor(self) -> torch.Tensor:
        """The mapping as a torch `uint8` tensor (clients copy with torch; the daemon doesn't
        need torch at all and uses `array`)."""
        if self._tensor is None:
            import torch

            self._tensor = torch.from_numpy(self.array)
        return self._tensor

    @classmethod
    def create(cls, directory: str | Path, size: int) -> Arena:
        path = Path(directory) / f"kvstore-{os.getpid()}-{secrets.token_hex(6)}.arena"
        return cls(path, size, create=True)

    @classmethod
    def attach(cls, path: str | Path, size: int) -> Arena:
        return cls(Path(path), size, create=False)

    @staticmethod
    def remove_stale(directory: str | Path) -> int:
        """Delete arena files left by daemons that died without cleaning up (SIGKILL, OOM)."""
        removed = 0
        for path in Path(directory).glob("kvstore-*-*.arena"):
            try:
                pid = int(path.name.split("-")[1])
                os.kill(pid, 0)
            except ProcessLookupError:
                path.unlink(missing_ok=True)
                removed += 1
            except (ValueError, PermissionError):
                continue  # not ours to judge: malformed name, or another user's live daemon
        return removed

    def unlink(self) -> None:
        """Remove the file; existing mappings stay valid until released."""
        self.path.unlink(missing_ok=True)
