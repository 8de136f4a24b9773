"""Host RAM tier: one shared-memory arena that the daemon owns and same-node clients map.

When CUDA exists the arena is registered as pinned memory (`cudaHostRegister`) so device copies
run at full bus speed; without a GPU, pinning is skipped (`pin_memory` raises there).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import threading
import time
from pathlib import Path

from kvstore import writer_lock
from kvstore.arena import Arena, run_at_lowest_priority
from kvstore.errors import ConfigError
from kvstore.tiers.base import BlockEntry
from kvstore.tiers.slab import SlabTier

log = logging.getLogger(__name__)


def _mib(n: int) -> str:
    """A size as an operator writes it: GiB from 1 GiB up, else MiB."""
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def _space_error(shm_dir: Path, size: int, err: OSError) -> ConfigError:
    """What to tell an operator whose shared memory cannot hold the arena."""
    try:
        st = os.statvfs(shm_dir)
        room = (f"it has {_mib(st.f_bavail * st.f_frsize)} free of "
                f"{_mib(st.f_blocks * st.f_frsize)}")
    except OSError:
        room = "its free space is unknown"
    if err.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
        return ConfigError(
            f"host_bytes: {_mib(size)} cannot be reserved in {shm_dir} ({room}); lower "
            "host_bytes or enlarge the shared memory (docker: --shm-size; Kubernetes: the "
            "node's /dev/shm, through a hostPath volume as in deploy/kubernetes)")
    return ConfigError(f"shm_dir: cannot create the host arena in {shm_dir}: "
                       f"{err.strerror or err}")


class HostTier(SlabTier):
    name = "host"

    def __init__(self, capacity_bytes: int, shm_dir: str | Path = "/dev/shm", *,
                 adopt: bool = False) -> None:
        """`adopt`: take the arena a daemon left in `shm_dir` at its clean shutdown
        (`Arena.retire`), where one of this size is there, rather than make a new one."""
        shm_dir = Path(shm_dir)
        size = max(capacity_bytes, 0)
        adopted = None
        if adopt and size:
            with contextlib.suppress(OSError):
                adopted = Arena.adopt(shm_dir, size)
        try:
            # A directory of its own under /dev/shm (several daemons on one host) is made
            # here, as the data directory is: the daemon user's only, as the arena is.
            shm_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            stale = Arena.remove_stale(shm_dir)
            writer_lock.remove_stale(shm_dir)  # lock files of same-node writers that died
        except OSError as e:
            raise ConfigError(f"shm_dir: cannot read {shm_dir}: {e.strerror or e}") from None
        if stale:
            log.info("removed %d arena files of dead daemons from %s", stale, shm_dir)
        if adopted is not None:
            self.arena = adopted
            log.info("host arena %s: %s taken over from the previous daemon (its pages "
                     "already backed; no block of it kept)", self.arena.path, _mib(size))
        else:
            self.arena = self._create(shm_dir, size)
        self.adopted = adopted is not None
        # Changes at every start, though a taken-over arena keeps its name: a client's offsets
        # from the last daemon must not be read as this one's (kvstore.proto `arena_id`).
        self.arena_id = f"{self.arena.path.name}.{secrets.token_hex(6)}"
        # Set at shutdown when nothing writes into the arena any more: `close` leaves it for
        # the next daemon (`Arena.retire`) instead of freeing it.
        self.hand_over = False
        self.handover_token = ""  # `Arena.retire`'s, for its keeper
        super().__init__(capacity_bytes, self.arena.array)
        self.pinned = self.arena.pin()  # where CUDA exists: device copies run by DMA
        self.prefaulted_bytes = self.arena.size if self.pinned else 0  # pinning backs every page
        self._prefault_stop = threading.Event()
        self._prefault_thread: threading.Thread | None = None

    @staticmethod
    def _create(shm_dir: Path, size: int) -> Arena:
        try:  # cheap refusal first; the reservation below is the real test (others race us)
            st = os.statvfs(shm_dir)
            short = st.f_bavail * st.f_frsize < size
        except OSError:
            short = False
        began = time.perf_counter()
        try:
            if short:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            arena = Arena.create(shm_dir, size)
        except OSError as e:
            raise _space_error(shm_dir, size, e) from None
        log.info("host arena %s: %s reserved in %.2f s", arena.path, _mib(size),
                 time.perf_counter() - began)
        return arena

    def start_prefault(self) -> None:
        """Back the arena's pages in a background thread at the lowest CPU priority
        (`host_prefault`): a fresh page's first touch, the kernel zeroing it, otherwise falls
        inside the first disk read, promotion or client save into it. Inside vLLM, disk loads
        right after a restart spent 40-56% of the machine's CPU samples there (perf, 2 cores):
        a daemon started ahead of its traffic pays it before the first request instead."""
        if self._prefault_thread is not None or self.prefaulted_bytes >= self.arena.size:
            return
        self._prefault_thread = threading.Thread(target=self._prefault, daemon=True,
                                                 name="kvstore-arena-prefault")
        self._prefault_thread.start()

    def unbacked(self, entry: BlockEntry) -> bool:
        """Whether `entry`'s pages may not be backed yet (the prefault has not reached them)."""
        return entry.offset + entry.length > self.prefaulted_bytes

    def back(self, entry: BlockEntry) -> None:
        """Back `entry`'s pages now, unless the prefault has reached them: a disk read into
        fresh pages faults them in one at a time (2.4 GB/s here), `Arena.populate` backs them
        at 4.2 GB/s. Best effort: a refusal leaves the read to fault them in."""
        if self.unbacked(entry):
            with contextlib.suppress(OSError):
                self.arena.populate(entry.offset, entry.length)

    def _prefault(self) -> None:
        run_at_lowest_priority()
        began = time.perf_counter()
        step = 32 << 20  # `close` waits for one step at most
        try:
            for off in range(0, self.arena.size, step):
                if self._prefault_stop.is_set():
                    return
                self.arena.populate(off, step)
                self.prefaulted_bytes = min(off + step, self.arena.size)
        except OSError as e:  # e.g. ENOMEM in a memory-limited cgroup: the copies fault instead
            log.warning("host arena prefault stopped at %s: %s", _mib(self.prefaulted_bytes), e)
            return
        log.info("host arena prefaulted (%s) in %.2f s", _mib(self.arena.size),
                 time.perf_counter() - began)

    def close(self) -> None:
        self.arena.unpin()
        self.pinned = False
        self._prefault_stop.set()
        if self._prefault_thread is not None:
            self._prefault_thread.join()  # before the mapping goes: it populates through it
        if self.hand_over and (token := self.arena.retire()):
            self.handover_token = token
            log.info("host arena %s left for the next daemon in %s", self.arena.path,
                     self.arena.path.parent)
        else:
            # The server has stopped: free the pages now, not when the last client lets go
            # of its mapping (that free slowed a restarted daemon's prefault:
            # docs/PERFORMANCE.md).
            self.hand_over = False
            self.arena.free_pages()
            self.arena.unlink()
        super().close()
