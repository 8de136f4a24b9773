"""A host arena left by a daemon at its clean shutdown for the next one (`Arena.retire`,
`Arena.adopt`, `kvstore/arena_keeper.py`): taken only where it was left on purpose, at the
same size, by one daemon; freed by its keeper when nobody takes it."""

from __future__ import annotations

import fcntl
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

from kvstore import arena_keeper
from kvstore.arena import HANDOVER, Arena
from kvstore.tiers.host import HostTier
from tests.unit.test_arena_prefault import resident_bytes

MIB = 1 << 20


def _unlocked(path: Path) -> None:
    """Wait until nothing holds `path`'s lock: a retired arena's goes with its mapping (at a
    daemon's exit), here when `kvstore.arena`'s reaper has unmapped it."""
    deadline = time.monotonic() + 10
    fd = os.open(path, os.O_RDONLY)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                assert time.monotonic() < deadline, f"{path} still locked"
                time.sleep(0.01)
    finally:
        os.close(fd)  # (and the lock taken to test it)


LEFT: dict[Path, str] = {}  # each arena `_left` made: its hand-over's token, for a keeper


def _retire(held: list[Arena]) -> Path:
    """The arena in `held` (its only reference) left as a daemon leaves it at its exit:
    retired, then unmapped."""
    a = held.pop()
    path = a.path
    token = a.retire()
    assert token and Path(str(path) + HANDOVER).exists()
    assert Arena.adopt(path.parent, a.size) is None  # not while its creator maps it
    LEFT[path] = token
    del a
    _unlocked(path)
    return path


def _left(tmp_path: Path, size: int = 4 * MIB, fill: int = 0x5A) -> tuple[Path, tuple]:
    """An arena as a daemon leaves it: written, then retired, then unmapped as at its
    exit; returns its path and ident."""
    held = [Arena.create(tmp_path, size)]
    held[0].array[:] = fill
    ident = held[0].ident
    return _retire(held), ident


def _keeper(path: Path, linger_s: float) -> list[str]:
    return [sys.executable, arena_keeper.__file__, str(path), str(linger_s), LEFT[path]]


def test_a_retired_arena_is_taken_whole_by_the_next(tmp_path):
    path, ident = _left(tmp_path)
    b = Arena.adopt(tmp_path, 4 * MIB)
    assert b is not None and b.path == path and b.ident == ident
    assert int(b.array[:: 4096].min()) == 0x5A  # the same pages, still backed
    assert not Path(str(path) + HANDOVER).exists()
    assert Arena.adopt(tmp_path, 4 * MIB) is None  # one daemon takes it: it is locked now
    assert Arena.remove_stale(tmp_path) == 0  # and not stale
    b.free_pages()
    b.unlink()


def test_only_an_arena_left_on_purpose_at_the_same_size_is_taken(tmp_path):
    left, live_dir, dead_dir = (tmp_path / n for n in ("left", "live", "dead"))
    for d in (left, live_dir, dead_dir):
        d.mkdir()
    _left(left)
    assert Arena.adopt(left, 8 * MIB) is None  # another host_bytes
    assert Arena.remove_stale(left) == 1  # so a daemon of that size removes it
    assert list(left.iterdir()) == []  # its marker with it
    live = Arena.create(live_dir, 4 * MIB)  # a live daemon's: locked, no marker
    assert Arena.adopt(live_dir, 4 * MIB) is None
    Path(str(live.path) + HANDOVER).write_text(  # marked, but still locked: its keeper's
        f"{live.ident[0]} {live.ident[1]} {4 * MIB}\n")
    assert Arena.adopt(live_dir, 4 * MIB) is None and Arena.remove_stale(live_dir) == 0
    # A daemon that died (lock free, no marker): not taken; stale.
    dead = Arena.create(dead_dir, 4 * MIB)
    dead_path = dead.path
    os.close(dead._lock_fd)
    dead._lock_fd = -1
    del dead
    _unlocked(dead_path)
    assert Arena.adopt(dead_dir, 4 * MIB) is None
    assert Arena.remove_stale(dead_dir) == 1 and not dead_path.exists()
    live.unlink()


def test_a_marker_of_another_file_under_the_name_is_refused(tmp_path):
    path, _ = _left(tmp_path)
    marker = Path(str(path) + HANDOVER)
    said = marker.read_text().split()
    marker.write_text(f"{said[0]} {int(said[1]) + 1} {said[2]}\n")  # names another inode
    assert Arena.adopt(tmp_path, 4 * MIB) is None
    marker.write_text("garbage")
    assert Arena.adopt(tmp_path, 4 * MIB) is None


def test_stale_arenas_are_freed_even_where_a_client_maps_them(tmp_path):
    """`remove_stale` punches a dead daemon's arena before removing it: a client that kept
    its mapping (it waits to learn whether the next daemon took it over) holds no pages."""
    a = Arena.create(tmp_path, 4 * MIB)
    path = a.path
    client = Arena.attach(path, 4 * MIB)
    client.array[:] = 1
    assert resident_bytes(path) >= 4 * MIB
    os.close(a._lock_fd)  # the daemon dies: its descriptor and mapping go
    a._lock_fd = -1
    del a
    _unlocked(path)
    assert Arena.remove_stale(tmp_path) == 1
    assert resident_bytes(path) == 0 and int(client.array.max()) == 0


def test_the_keeper_frees_an_arena_nobody_took(tmp_path):
    path, _ = _left(tmp_path)
    mapped = Arena.attach(path, 4 * MIB)  # a client that kept its mapping
    assert int(mapped.array[:: 4096].min()) == 0x5A  # (faulted in: the pages it shares)
    assert resident_bytes(path) >= 4 * MIB
    began = time.monotonic()
    subprocess.run(_keeper(path, 0.3), check=True,
                   timeout=30, env={})  # by path, with nothing of kvstore on its path
    assert time.monotonic() - began >= 0.3
    assert not path.exists() and not Path(str(path) + HANDOVER).exists()
    assert resident_bytes(path) == 0  # punched, though mapped
    del mapped


def test_the_keeper_leaves_an_arena_a_daemon_took(tmp_path):
    path, _ = _left(tmp_path)
    keeper = subprocess.Popen(_keeper(path, 30))
    try:
        time.sleep(0.2)
        b = Arena.adopt(tmp_path, 4 * MIB)
        assert b is not None
        assert keeper.wait(5) == 0  # it saw the marker go: done, long before its 30 s
        assert path.exists() and int(b.array[:: 4096].min()) == 0x5A
    finally:
        keeper.kill()
    # At its deadline a keeper frees nothing a daemon holds (locked), marker or not.
    Path(str(path) + HANDOVER).write_text(f"0 0 0 {LEFT[path]}")
    assert not arena_keeper.free_if_left(str(path), LEFT[path])
    assert path.exists()
    b.free_pages()
    b.unlink()


def test_a_keeper_leaves_an_arena_taken_and_left_again_before_it_looked(tmp_path):
    """Taken over and left again under the same name within one of its polls: the arena is
    the next hand-over's now, its own keeper's to free, not the first keeper's."""
    path, _ = _left(tmp_path)
    first = LEFT[path]
    b = Arena.adopt(tmp_path, 4 * MIB)
    assert b is not None
    held = [b]
    del b
    assert _retire(held) == path and LEFT[path] != first
    subprocess.run([sys.executable, arena_keeper.__file__, str(path), "0", first],
                   check=True, timeout=30)
    assert path.exists() and Path(str(path) + HANDOVER).exists()  # still left for the next
    subprocess.run(_keeper(path, 0), check=True, timeout=30)  # the second keeper frees it
    assert not path.exists() and not Path(str(path) + HANDOVER).exists()


def test_the_host_tier_takes_the_arena_only_when_asked(tmp_path):
    path, ident = _left(tmp_path)
    fresh = HostTier(4 * MIB, tmp_path)  # adopt=False: a new arena, the left one removed
    assert not fresh.adopted and fresh.arena.path != path and not path.exists()
    fresh.hand_over = True
    fresh.close()  # left for the next
    left = fresh.arena.path
    del fresh
    _unlocked(left)
    taken = HostTier(4 * MIB, tmp_path, adopt=True)
    assert taken.adopted and taken.arena.path == left
    taken.close()  # hand_over unset: freed and removed as before
    assert list(tmp_path.iterdir()) == []
    assert ident  # (the first arena's identity was read before it went)


def test_an_arena_others_may_touch_is_never_taken(tmp_path):
    """`shm_dir` (/dev/shm) is writable by every user: an arena another user planted there,
    or one opened to others, would let them read and write every block the daemon serves."""
    path, _ = _left(tmp_path)
    os.chmod(path, 0o644)  # opened up
    assert Arena.adopt(tmp_path, 4 * MIB) is None
    os.chmod(path, 0o600)
    marker = Path(str(path) + HANDOVER)
    os.chmod(marker, 0o666)  # a marker others may rewrite
    assert Arena.adopt(tmp_path, 4 * MIB) is None
    os.chmod(marker, 0o600)
    if os.geteuid() == 0:  # another user's file (root can make one here)
        os.chown(path, 4321, -1)
        assert Arena.adopt(tmp_path, 4 * MIB) is None
        os.chown(path, 0, -1)
    taken = Arena.adopt(tmp_path, 4 * MIB)  # as the daemon left it: taken
    assert taken is not None
    assert stat.S_IMODE(os.stat(taken.path).st_mode) == 0o600
    taken.free_pages()
    taken.unlink()


def test_a_marker_that_is_a_link_or_a_fifo_is_refused_without_waiting(tmp_path):
    """A marker replaced by a FIFO (a read would wait forever) or a link to one: refused at
    once, by the daemon and by the keeper."""
    path, _ = _left(tmp_path)
    marker = Path(str(path) + HANDOVER)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    for planted in ("fifo", "link"):
        marker.unlink()
        if planted == "fifo":
            os.mkfifo(marker, 0o600)
        else:
            marker.symlink_to(fifo)
        began = time.monotonic()
        assert Arena.adopt(tmp_path, 4 * MIB) is None
        assert not arena_keeper.free_if_left(str(path), LEFT[path])
        assert time.monotonic() - began < 5
    assert path.exists()


def test_a_tier_that_cannot_mark_its_arena_frees_it(tmp_path):
    """`retire` failing (the marker cannot be written) leaves nothing half-handed-over: the
    arena is freed and removed as without a hand-over."""
    tier = HostTier(4 * MIB, tmp_path)
    path = tier.arena.path
    Path(str(path) + HANDOVER).mkdir()  # the marker's name taken: it cannot be written
    tier.hand_over = True
    tier.close()
    assert not tier.hand_over and tier.handover_token == ""
    assert not path.exists()
    assert Arena.adopt(tmp_path, 4 * MIB) is None


def test_a_keeper_that_does_not_start_leaves_the_arena_to_its_daemon(tmp_path):
    """`arena_keeper.start` says whether a keeper runs; where it does not (the interpreter
    cannot be started, its file is gone after an upgrade, it hangs before saying so), the
    daemon frees the arena itself (`server/app.py`: `_start_keeper`), else 4 GiB would stay
    in /dev/shm until a daemon starts in that directory again, maybe never."""
    silent = tmp_path / "silent_keeper.py"
    silent.write_text("import time\ntime.sleep(60)\n")
    cases = {"no interpreter": dict(python=str(tmp_path / "no-python")),
             "no keeper file": dict(keeper=str(tmp_path / "gone.py")),
             "silent keeper": dict(keeper=str(silent), wait_s=0.5)}
    for what, how in cases.items():
        d = tmp_path / what.replace(" ", "-")
        d.mkdir()
        path, _ = _left(d)
        began = time.monotonic()
        assert not arena_keeper.start(str(path), 0.1, LEFT[path], **how), what
        assert time.monotonic() - began < 5, what  # not the keeper's whole linger
        assert path.exists()  # nothing has freed it: the daemon's turn
        assert arena_keeper.free_if_left(str(path), LEFT[path], lock_held=True), what
        assert not path.exists() and not Path(str(path) + HANDOVER).exists(), what
    # The real keeper says it runs at once, then frees the arena after its linger.
    path, _ = _left(tmp_path)
    began = time.monotonic()
    assert arena_keeper.start(str(path), 0.2, LEFT[path])
    assert time.monotonic() - began < 5
    assert path.exists()  # lingering, for a successor
    deadline = time.monotonic() + 20
    while path.exists():
        assert time.monotonic() < deadline, "the keeper did not free the arena"
        time.sleep(0.05)
    assert not Path(str(path) + HANDOVER).exists()


def test_the_daemon_frees_its_arena_itself_when_no_keeper_starts(tmp_path):
    """Through a real daemon process whose keeper's file is gone (as after an upgrade under
    a running daemon): at a clean stop it leaves nothing behind in `shm_dir`."""
    from kvstore.server.process import DaemonProcess

    gone = tmp_path / "gone.py"

    class KeeperGone(DaemonProcess):
        def command(self) -> list[str]:
            run = ("import pathlib, sys; import kvstore.server.app as app; "
                   f"app.KEEPER = pathlib.Path({str(gone)!r}); "
                   "from kvstore.server.__main__ import main; sys.exit(main())")
            return [sys.executable, "-c", run, *super().command()[3:]]

    shm = tmp_path / "shm"
    shm.mkdir()
    d = KeeperGone(tmp_path / "d", "--host-bytes", "4MiB", "--disk-bytes", "0",
                   "--shm-dir", str(shm)).start()
    try:
        assert len(list(shm.glob("kvstore-*.arena"))) == 1
        assert d.stop() == 0
        assert list(shm.iterdir()) == []  # freed at the stop: no marker, no keeper to wait on
        assert "did not start; arena freed now" in d.log.read_text()
    finally:
        d.kill()


def test_a_missing_shm_dir_is_made_the_daemon_users_only(tmp_path: Path) -> None:
    """OPERATIONS advises a `shm_dir` per daemon on a shared host: one that does not exist
    yet is made (mode 0700, as the data directory), not a start-up error."""
    shm = tmp_path / "shm" / "kvstore-gpu0"
    host = HostTier(1 << 20, shm_dir=shm)
    try:
        assert shm.is_dir() and stat.S_IMODE(shm.stat().st_mode) == 0o700
        assert host.arena.path.parent == shm
    finally:
        host.close()
