"""The shared-memory arena file: created by the daemon's host tier, mapped by same-node clients.

Data between an engine and the daemon on one machine crosses no socket: the client copies
into or out of the mapping at offsets the daemon hands out under a lease.

The daemon reserves the whole file at creation (`posix_fallocate`): a sparse file on a tmpfs
that runs out would kill whoever touches an unbacked page with SIGBUS, a same-node engine
included. It also holds an exclusive `flock` on the file for its lifetime, which is how other
daemons tell a live arena from a stale one (a pid is reused, or belongs to another pid
namespace sharing the same /dev/shm; a lock is released by the kernel when its holder dies).

At a clean shutdown with no client writing into it, a daemon may hand the arena's memory (not
its blocks) to the next daemon in the same directory (`retire`, `adopt`): a restart then neither
zeroes nor faults 4 GiB of pages again, and clients keep their mapping. A marker file beside
the arena (`<arena>.handover`) says it was left on purpose; `kvstore/arena_keeper.py` frees it
if no daemon takes it within `host_handover_s`.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import queue
import secrets
import stat
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

_MADV_POPULATE_WRITE = 23  # Linux 5.14+: back pages as a write would, writing nothing
log = logging.getLogger("kvstore.arena")
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_libc.fallocate.restype = ctypes.c_int
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
HANDOVER = ".handover"  # suffix of the marker of an arena left for the next daemon
_populate_unsupported = False  # the kernel refused MADV_POPULATE_WRITE once: read-touch instead

# Mappings of arenas nobody references any more, unmapped by `_reaper`.
_graveyard: queue.SimpleQueue[tuple[object, ...] | None] = queue.SimpleQueue()
_reaper: threading.Thread | None = None
_reaper_lock = threading.Lock()
_exiting = False  # `_stop_reaper` ran: mappings are dropped where they are let go of


def run_at_lowest_priority() -> None:
    """Put the calling thread at nice 19 (where allowed): background page touching (the
    daemon's and the clients' arena prefaults) then takes only CPU nothing else wants."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _start_reaper() -> None:
    """Start `_reap` (once per process) when an arena is mapped: a thread started later, in
    `Arena.__del__`, would hang at interpreter shutdown, where new threads never run."""
    global _reaper
    with _reaper_lock:
        if _reaper is None and not _exiting:
            _reaper = threading.Thread(target=_reap, name="kvstore-arena-unmap", daemon=True)
            _reaper.start()


@atexit.register
def _stop_reaper() -> None:
    """At exit, before the interpreter finalizes: end `_reap` once it has unmapped what it
    holds. A daemon thread still freeing a torch tensor over a mapping while the interpreter
    finalizes is ended by a forced unwind through torch's noexcept deleter (it takes the GIL
    back), which aborts the process: "terminate called without an active exception", after
    an engine's work was done (tests/unit/test_arena_exit.py)."""
    global _reaper, _exiting
    with _reaper_lock:
        reaper, _reaper, _exiting = _reaper, None, True
    if reaper is not None and reaper.is_alive():
        _graveyard.put(None)
        reaper.join(timeout=10.0)


def _forget_reaper() -> None:
    """In a forked child: the parent's reaper thread does not exist here."""
    global _reaper, _graveyard
    _reaper, _graveyard = None, queue.SimpleQueue()


os.register_at_fork(after_in_child=_forget_reaper)


def _reap() -> None:
    while True:
        held = _graveyard.get()
        if held is None:  # `_stop_reaper`
            return
        # The caller's own reference goes as it returns: wait for it, so that the last one,
        # and the unmap with it, is this thread's (else it is the caller's, as without this).
        deadline = time.monotonic() + 1.0
        while sys.getrefcount(held) > 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        _unpin(held[-1] if isinstance(held[-1], int) else 0)
        tensor, array, mapping = held[:3]
        del held
        # The tensor first, the mapping last: the unmap releases the GIL, and a daemon thread
        # taking it back while the interpreter exits is ended by a forced unwind, which aborts
        # the process if it runs through torch's deleter of a tensor over numpy memory
        # ("terminate called without an active exception", after an engine's work was done).
        # Dropped in this order the unmap happens under none of torch's frames.
        del tensor
        del array
        del mapping


def _unpin(address: int) -> None:
    """Unregister a mapping `Arena.pin` registered with CUDA, before it is unmapped (pages
    left registered would stay locked, and a later mapping at that address fail to pin)."""
    if address:
        import torch

        torch.cuda.cudart().cudaHostUnregister(address)  # type: ignore[no-untyped-call]


def _punch(fd: int, size: int) -> bool:
    """Free every page of the file behind `fd` now, even where processes still map it."""
    return size == 0 or _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0,
                                        size) == 0


def _ours(st: os.stat_result) -> bool:
    """A regular file of this user that no one else may read or write, as `Arena.create`
    and `retire` make them: /dev/shm is writable by every user, and an arena planted there,
    or opened up, would let its owner read and write every block."""
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o077


def _read_marker(marker: Path) -> list[str]:
    """A hand-over marker's fields; [] unless it is a small regular file of ours (a link or
    a FIFO planted under its name must not hang or mislead the daemon reading it)."""
    try:
        fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return []
    try:
        return os.read(fd, 256).decode("ascii", "replace").split() if _ours(os.fstat(fd)) \
            else []
    finally:
        os.close(fd)


def remove_if_unlocked(path: Path, *, free: bool = False) -> bool | None:
    """Remove a file whose creator held an exclusive `flock` on it for its life (an arena, a
    client's writer lock) if that lock is free: its creator is dead. True: removed now; False:
    locked (its creator lives); None: nothing to judge (gone, a link, another user's, or
    replaced under the same name meanwhile). `free`: punch its pages first, so that a client
    still mapping it does not keep them (an arena)."""
    try:
        fd = os.open(path, (os.O_RDWR if free else os.O_RDONLY) | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # Still the file we locked (not replaced by a new one under the same name).
        st = os.fstat(fd)
        if not os.path.samestat(st, os.lstat(path)):
            return None
        if free:
            _punch(fd, st.st_size)
        path.unlink()
        return True
    except BlockingIOError:
        return False
    except OSError:  # removed meanwhile by another daemon
        return None
    finally:
        os.close(fd)


class Arena:
    """A file-backed shared mapping exposed as a flat `uint8` tensor."""

    def __init__(self, path: Path, size: int, *, create: bool, locked_fd: int = -1) -> None:
        """`locked_fd`: the file at `path`, opened and locked by `adopt` (the caller's now)."""
        self.path = path
        self.size = size
        self._lock_fd = -1  # the creator's locked descriptor, held until `unlink` or `retire`
        # The creator makes the file under a hidden name, locks it, then renames it: another
        # daemon's `remove_stale` never sees an arena that is not locked yet.
        made = path.with_name(f".{path.name}.new") if create else path
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = locked_fd if locked_fd >= 0 else os.open(made, flags, 0o600)
        try:
            if create:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.ftruncate(fd, size)
                if size:
                    os.posix_fallocate(fd, 0, size)  # every page backed now, or ENOSPC now
                os.rename(made, path)
            elif os.fstat(fd).st_size < size:
                raise ValueError(f"arena {path} is smaller than the {size} bytes announced")
            st = os.fstat(fd)
            self.ident = (st.st_dev, st.st_ino)  # which file: a name may be reused
            # mmap refuses an empty mapping; a zero-byte arena is a valid (useless) tier.
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED,
                                   mmap.PROT_READ | mmap.PROT_WRITE) if size else None
        except BaseException:
            os.close(fd)
            if create:  # do not leave a stray file in /dev/shm
                made.unlink(missing_ok=True)
                path.unlink(missing_ok=True)
            raise
        if create or locked_fd >= 0:
            self._lock_fd = fd
        else:
            os.close(fd)
        self.array = (np.frombuffer(self._mmap, dtype=np.uint8) if self._mmap is not None
                      else np.zeros(0, dtype=np.uint8))
        self._tensor: torch.Tensor | None = None
        self._pinned_at = 0  # the address `pin` registered with CUDA; 0: not registered
        self._pin_lock = threading.Lock()
        if self._mmap is not None:
            _start_reaper()

    def is_file(self, path: str | Path) -> bool:
        """Whether `path` names the file this arena maps now (not one made since under it)."""
        try:
            st = os.stat(path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.ident

    def __del__(self) -> None:
        """Have `_reap` drop the last references to the mapping. Unmapping the last mapping of
        a file its daemon has unlinked frees every page of it: 0.67 s for 4 GiB here. A
        client lets go of a restarted daemon's old arena inside its next call (a 0.7 s first
        load in vLLM after a restart), which must not wait for that."""
        mapping = (getattr(self, "_tensor", None), getattr(self, "array", None),
                   getattr(self, "_mmap", None), getattr(self, "_pinned_at", 0))
        if mapping[2] is not None and _reaper is not None and not sys.is_finalizing():
            self._tensor = self.array = self._mmap = None  # type: ignore[assignment]
            _graveyard.put(mapping)
        elif mapping[3] and not sys.is_finalizing():
            _unpin(mapping[3])  # unmapped here, as the references go: unregistered first

    def pin(self) -> bool:
        """Register the mapping with CUDA as page-locked memory (`cudaHostRegister`), once: a
        GPU then copies to and from it by DMA at the bus rate, asynchronously (53 GB/s on an
        H100's host, against 6-8 GB/s for the same copy out of pageable memory: docs/GPU.md).
        It locks every page of the mapping (the daemon's arena is all resident anyway): 1.5 s
        for 16 GiB on the H100's host, 0.23 s to unregister (`benchmarks.gpu_copy --pin-gib`).
        False where there is no CUDA or it was refused. torch is imported only where a GPU
        driver exists: a CPU-only daemon starts without it."""
        with self._pin_lock:
            if self._pinned_at or self._mmap is None or self.size == 0 \
                    or not os.path.exists("/proc/driver/nvidia"):
                return bool(self._pinned_at)
            import torch

            if not torch.cuda.is_available():
                return False
            address = self.array.ctypes.data
            rc = torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
                address, self.size, 0)
            if int(rc) != 0:
                log.warning("cudaHostRegister of arena %s failed (%s): GPU copies out of it "
                            "run from pageable memory", self.path, rc)
                return False
            self._pinned_at = address
            return True

    def unpin(self) -> None:
        """Unregister what `pin` registered (no-op otherwise): before the pages are freed."""
        with self._pin_lock:
            _unpin(self._pinned_at)
            self._pinned_at = 0

    @property
    def pinned(self) -> bool:
        return bool(self._pinned_at)

    @property
    def tensor(self) -> torch.Tensor:
        """The mapping as a torch `uint8` tensor (clients copy with torch; the daemon doesn't
        need torch at all and uses `array`)."""
        if self._tensor is None:
            import torch

            self._tensor = torch.from_numpy(self.array)
        return self._tensor

    def populate(self, offset: int, length: int) -> None:
        """Back the pages of `[offset, offset + length)` now, changing no byte: the kernel's
        first touch of a shared page (allocating and zeroing it: `posix_fallocate` does not)
        then happens here rather than inside a copy or a disk read into it. On this VM a
        fresh page was written at 2.4 GB/s against 11.6 GB/s for one touched before, and
        `madvise(MADV_POPULATE_WRITE)` backed fresh pages at 4.2 GB/s. Where the kernel lacks
        it (before 5.14), one byte per page is read, which backs a shared page too."""
        global _populate_unsupported
        if self._mmap is None or length <= 0:
            return
        start = offset - offset % mmap.PAGESIZE
        end = min(offset + length, self.size)
        if end <= start:  # past the arena's end: nothing to back (and no madvise to misread)
            return
        if not _populate_unsupported:
            addr = self.array.ctypes.data + start
            if _libc.madvise(addr, end - start, _MADV_POPULATE_WRITE) == 0:
                return
            err = ctypes.get_errno()
            if err != errno.EINVAL:
                raise OSError(err, f"madvise(MADV_POPULATE_WRITE): {os.strerror(err)}")
            _populate_unsupported = True
        int(self.array[start:end:mmap.PAGESIZE].sum())

    @classmethod
    def create(cls, directory: str | Path, size: int) -> Arena:
        path = Path(directory) / f"kvstore-{os.getpid()}-{secrets.token_hex(6)}.arena"
        return cls(path, size, create=True)

    @classmethod
    def attach(cls, path: str | Path, size: int) -> Arena:
        return cls(Path(path), size, create=False)

    @staticmethod
    def remove_stale(directory: str | Path) -> int:
        """Delete arena files left by daemons that died without cleaning up (SIGKILL, OOM).

        An arena is stale iff its lock can be taken: a live daemon holds it, whatever its pid
        or pid namespace. (The pid in the name is informative only.) That includes one left
        for the next daemon (`retire`) that the caller did not `adopt`. Its pages are freed
        first: a client still mapping it would keep them."""
        d = Path(directory)
        removed = sum(remove_if_unlocked(path, free=True) is True for path in
                      [*d.glob("kvstore-*-*.arena"), *d.glob(".kvstore-*-*.arena.new")])
        for marker in d.glob(f"kvstore-*-*.arena{HANDOVER}"):  # of arenas gone
            if not marker.with_name(marker.name.removesuffix(HANDOVER)).exists():
                marker.unlink(missing_ok=True)
        return removed

    def free_pages(self) -> bool:
        """The creator's: free every page of the arena now (punch the whole file), even where
        clients still map it; their next reads find zeros. For a daemon that has stopped
        serving: no client can have a copy out of it confirmed any more (a fetch's copy counts
        only once its lease's Release answered), and freeing here, at shutdown, keeps the
        free from running beside the next daemon's prefault. Backing a fresh arena beside
        another process's free of one ran at half the rate here
        (`python -m benchmarks.arena_zeroing`). False where it could not."""
        if self._lock_fd < 0 or self.size == 0:
            return False
        if not _punch(self._lock_fd, self.size):
            log.warning("freeing the pages of arena %s failed: %s", self.path,
                        os.strerror(ctypes.get_errno()))
            return False
        return True

    def unlink(self) -> None:
        """Remove the file and drop the lock; existing mappings stay valid until released."""
        self.path.unlink(missing_ok=True)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def retire(self) -> str:
        """The creator's, at a clean shutdown once nothing writes into the arena any more:
        leave the file and its pages for the next daemon in its directory (`adopt`), marked
        as left on purpose. The lock goes with the last descriptor of the file: the mapping
        holds one (Python's mmap keeps a duplicate), so it is released when the mapping is,
        at the daemon's exit at the latest; no thread of this process can still write into
        the arena once another takes it. Returns this hand-over's token, which its keeper
        (`kvstore/arena_keeper.py`) names: the arena may be taken over and left again under
        the same name before the keeper looks. "" where the marker could not be written (the
        caller then frees the arena as usual)."""
        if self._lock_fd < 0:
            return ""
        marker = self.path.with_name(self.path.name + HANDOVER)
        token = secrets.token_hex(8)
        try:
            # Written before the lock goes: an unlocked arena without its marker is a dead
            # daemon's, and any daemon may remove it.
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(f"{self.ident[0]} {self.ident[1]} {self.size} {token}\n")
        except OSError as e:
            log.warning("cannot leave arena %s for the next daemon: %s", self.path, e)
            with contextlib.suppress(OSError):  # a partial marker of ours; not another file
                marker.unlink(missing_ok=True)
            return ""
        os.close(self._lock_fd)
        self._lock_fd = -1
        return token

    @classmethod
    def adopt(cls, directory: str | Path, size: int) -> Arena | None:
        """An arena of `size` bytes a daemon left in `directory` at its clean shutdown
        (`retire`), now this caller's: locked, its marker removed, every page it had backed
        still backed. None when there is none. A daemon's blocks do not survive it: the
        bytes inside are garbage to the new one."""
        for marker in sorted(Path(directory).glob(f"kvstore-*-*.arena{HANDOVER}")):
            path = marker.with_name(marker.name.removesuffix(HANDOVER))
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                st = os.fstat(fd)
                left = (os.path.samestat(st, os.lstat(path)) and st.st_size == size
                        and _ours(st) and _read_marker(marker)[:3]
                        == [str(st.st_dev), str(st.st_ino), str(size)])
                if left:
                    marker.unlink()
            except OSError:  # locked (taken, or its keeper freeing it), gone
                left = False
            if left:  # ours now: locked, unmarked (a failure below closes `fd`)
                return cls(path, size, create=False, locked_fd=fd)
            os.close(fd)
        return None
