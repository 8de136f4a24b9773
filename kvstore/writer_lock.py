"""A client process's liveness as the daemon sees it: a file it holds locked in the arena's
directory.

A same-node client writes a publish straight into the daemon's arena. If its process freezes
mid-copy (SIGSTOP, swapped out, a debugger) for longer than `lease_timeout_s`, the daemon
reclaims the reservation, and when the process resumes, the rest of that copy would land in
slots another block owns by then. So the daemon keeps an expired reservation's space out of use
while its writer lives (`server.store`, "fenced"), and it learns whether the writer lives the
way daemons tell a live arena from a stale one: by a lock the kernel drops when its holder dies,
whatever its pid or pid namespace (a sidecar container shares the directory, not the pids).

Each process makes one lock file per directory, `kvstore-writer-<pid>-<random>.lock`, created
under a hidden name, locked, then renamed (so it is never seen unlocked while its writer
lives), and names it in every Reserve. It is removed at exit, or by the daemon once unlocked.
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import re
import secrets
import threading
from pathlib import Path

from kvstore.arena import remove_if_unlocked

log = logging.getLogger(__name__)

_NAME = re.compile(r"kvstore-writer-[0-9]+-[0-9a-f]{12}\.lock")
# (pid, directory) -> (fd, path), or (-1, None) where it could not be made
_held: dict[tuple[int, str], tuple[int, Path | None]] = {}
_lock = threading.Lock()


def writer_lock(directory: str | Path) -> str:
    """This process's lock file in `directory` (made once per process): its name, to send with
    a Reserve; "" when it cannot be made (logged once; the daemon then fences nothing for us)."""
    d = Path(directory)
    held_key = (os.getpid(), str(d))  # a forked child makes its own
    with _lock:
        if held_key not in _held:
            if not _held:
                atexit.register(_remove_all)
            _held[held_key] = _make(d)
        path = _held[held_key][1]
        return path.name if path is not None else ""


def _make(d: Path) -> tuple[int, Path | None]:
    path = d / f"kvstore-writer-{os.getpid()}-{secrets.token_hex(6)}.lock"
    made = path.with_name(f".{path.name}.new")
    try:
        fd = os.open(made, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        log.warning("cannot make a writer lock in %s (%s): a publish frozen past its lease "
                    "is not fenced", d, e)
        return -1, None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(made, path)
    except OSError as e:
        os.close(fd)
        made.unlink(missing_ok=True)
        log.warning("cannot lock a writer file in %s (%s): a publish frozen past its lease "
                    "is not fenced", d, e)
        return -1, None
    return fd, path


def _remove_all() -> None:
    for (pid, _), (fd, path) in list(_held.items()):
        if pid == os.getpid() and path is not None:
            path.unlink(missing_ok=True)
            os.close(fd)
    _held.clear()


def writer_alive(directory: str | Path, name: str) -> bool:
    """Whether the process that made lock file `name` in `directory` still lives. A name that
    is not a writer lock's never names a live writer; a dead writer's file is removed."""
    if not _NAME.fullmatch(name):
        return False
    # Removed at its exit (or by us before): gone, hence dead.
    return remove_if_unlocked(Path(directory) / name) is False


def remove_stale(directory: str | Path) -> int:
    """Remove the lock files of writers that died without removing theirs (SIGKILL), or while
    making one."""
    d = Path(directory)
    return sum(remove_if_unlocked(path) is True for path in
               [*d.glob("kvstore-writer-*.lock"), *d.glob(".kvstore-writer-*.lock.new")])
