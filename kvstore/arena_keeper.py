"""Free a host arena a daemon left for its successor (`Arena.retire`) if none takes it in time.

A daemon that stops cleanly leaves its arena's memory in `shm_dir` for the next daemon there
(`host_handover_s`), and starts this, detached, as its last act: once `linger_s` has passed
with the arena's marker still the one its daemon wrote (`TOKEN`: no daemon took it, or one
took it and left it again), it frees the pages and removes the file. A daemon adopting it
holds its lock and has removed the marker, so the two never both act. Run by path with the
standard library only: the daemon's interpreter may not find the `kvstore` package on its own
path, and a keeper must start in milliseconds. It says `ready` on its standard output once it
runs, and closes it: a daemon that does not hear that frees the arena itself (`start`).

    python kvstore/arena_keeper.py ARENA_PATH LINGER_S TOKEN
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import select
import subprocess
import sys
import time

_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
POLL_S = 0.5
GIVE_UP_S = 60.0  # past the deadline: a daemon that has not exited by then is not exiting


def _marked(marker: str, token: str) -> bool:
    """Whether `marker` is still the one of the hand-over named `token`."""
    try:  # not following a link, nor waiting on a FIFO, planted under its name
        fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        return os.read(fd, 256).decode("ascii", "replace").split()[3:] == [token]
    except OSError:
        return False
    finally:
        os.close(fd)


def free_if_left(path: str, token: str, *, lock_held: bool = False) -> bool:
    """Free and remove the arena at `path` if it is still left for a successor by the
    hand-over named `token`: unlocked and marked so. True when freed. `lock_held`: the
    caller is the daemon that left it, whose mapping still holds the arena's lock (no other
    daemon can be taking it over)."""
    marker = path + ".handover"
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        if not lock_held:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        st = os.fstat(fd)
        if not (os.path.samestat(st, os.lstat(path)) and _marked(marker, token)):
            return False  # taken over (and maybe left again since), or replaced
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
        if st.st_size:  # a client still mapping it must not keep the pages
            libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, st.st_size)
        os.unlink(path)
        os.unlink(marker)
        return True
    except OSError:  # locked: a daemon is adopting it
        return False
    finally:
        os.close(fd)


READY = b"ready\n"


def start(path: str, linger_s: float, token: str, *, keeper: str = __file__,
          python: str = sys.executable, wait_s: float = 5.0) -> bool:
    """The daemon's: start the keeper of the arena at `path`, detached (its own session),
    and wait up to `wait_s` for it to say it runs. False where it could not be started, died
    at once (its file gone in an upgrade, say) or stayed silent (then it is killed): nothing
    would free the arena before the next daemon in its directory, so the caller frees it."""
    try:
        proc = subprocess.Popen([python, keeper, path, str(linger_s), token],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError:
        return False
    if proc.stdout is None:  # cannot happen (stdout=PIPE); for the type checker
        return False
    with proc.stdout:
        heard = b""
        deadline = time.monotonic() + wait_s
        while len(heard) < len(READY) and (left := deadline - time.monotonic()) > 0:
            if not select.select([proc.stdout], [], [], left)[0]:
                break
            chunk = os.read(proc.stdout.fileno(), len(READY) - len(heard))
            if not chunk:  # it exited
                break
            heard += chunk
    if heard == READY:
        return True
    proc.kill()
    proc.wait()
    return False


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    path, linger_s, token = argv[0], float(argv[1]), argv[2]
    try:  # to the daemon waiting in `start`; then nothing more is written there
        os.write(1, READY)
        os.close(1)
    except OSError:
        pass
    deadline = time.monotonic() + linger_s
    while _marked(path + ".handover", token):  # else adopted, or removed as stale
        now = time.monotonic()
        # Past the deadline, while still locked (its daemon has not exited yet, or one is
        # taking it over this instant), try again a while.
        if now >= deadline and (free_if_left(path, token) or now >= deadline + GIVE_UP_S):
            return 0
        time.sleep(min(POLL_S, max(deadline - now, 0.01)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
