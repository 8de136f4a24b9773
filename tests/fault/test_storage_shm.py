"""Shared memory smaller than the host arena: the daemon must reserve its arena at start or refuse.

A sparse arena on a tmpfs that runs out kills whoever touches an unbacked page with SIGBUS: a
same-node engine copying a block in, or the daemon itself writing a streamed Publish. The
daemon reserves the whole arena at start (`posix_fallocate`), and refuses to start, naming
`host_bytes` and what the filesystem has free, when it cannot. These tests use a real 16 MiB
tmpfs as `shm_dir` (root needed; skipped otherwise).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.server.process import DaemonProcess
from tests.fault.smallfs import tmpfs
from tests.reliability import wait_until

pytestmark = [pytest.mark.fault, pytest.mark.integration]

# An engine on the same node: publishes `n` 512 KiB prompts through shared memory, then fetches
# each back and compares it byte for byte. Exit 0 only if every prompt came back identical.
ENGINE = """
import sys
from kvstore.client import KVClient
from tests.conftest import random_kv, same_bytes, small_layout
target, n = sys.argv[1], int(sys.argv[2])
layout = small_layout(block_tokens=256)  # 128 KiB blocks
with KVClient(target, layout, deadline_s=10, transfer="shm") as c:
    for p in range(n):
        tokens = [p * 10_000 + t for t in range(1024)]
        assert c.publish(tokens, random_kv(layout, 1024, seed=p)) == 1024, f"publish {p}"
    for p in range(n):
        tokens = [p * 10_000 + t for t in range(1024)]
        got, kv = c.fetch(tokens)
        assert got == 1024 and same_bytes(kv, random_kv(layout, 1024, seed=p)), f"fetch {p}"
print("ENGINE OK")
"""


def _engine(target: str, prompts: int) -> subprocess.CompletedProcess[str]:
    root = Path(__file__).resolve().parents[2]
    return subprocess.run([sys.executable, "-c", ENGINE, target, str(prompts)], cwd=root,
                          capture_output=True, text=True, timeout=120, check=False)


def _daemon(tmp_path: Path, name: str, shm: Path, host: str) -> DaemonProcess:
    return DaemonProcess(tmp_path / name, "--host-bytes", host, "--disk-bytes", "0",
                         "--shm-dir", str(shm))


def test_arena_larger_than_shm_is_refused_at_start(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "shm", "16m") as shm:
        d = _daemon(tmp_path, "big", shm, "64MiB")
        try:
            with pytest.raises(RuntimeError, match="did not start"):
                d.start(timeout=30)
        finally:
            d.kill()
        assert d.proc is not None and d.proc.returncode == 2, "expected a refusal (exit 2)"
        log = d.log.read_text()
        assert "host_bytes" in log and "64.0 MiB" in log and str(shm) in log, log
        assert "--shm-size" in log, log  # says what to do about it in a container
        assert "Traceback" not in log, log
        assert list(shm.iterdir()) == [], "a refused arena must not stay in shm"


def test_two_arenas_overcommitting_shm_never_kill_an_engine(tmp_path: Path) -> None:
    """Two 12 MiB arenas on 16 MiB of shm: before the fix both started, sparse, and the engine
    that touched the 17th MiB died of SIGBUS. Now the second daemon is refused at start and the
    first one's engine writes and reads all 12 MiB."""
    with tmpfs(tmp_path / "shm", "16m") as shm:
        first = _daemon(tmp_path, "first", shm, "12MiB").start()
        second = _daemon(tmp_path, "second", shm, "12MiB")
        try:
            try:
                second.start(timeout=30)
                started = [first, second]
            except RuntimeError:
                started = [first]
            for d in started:  # a same-node engine fills each running daemon's arena
                r = _engine(d.target, 24)  # 24 x 512 KiB = the whole 12 MiB arena
                assert r.returncode == 0, (f"engine of {d.data_dir.name} exited "
                                           f"{r.returncode}: {r.stderr[-2000:]}")
                assert "ENGINE OK" in r.stdout
            assert started == [first], "the second arena does not fit and must be refused"
            log = second.log.read_text()
            assert "host_bytes" in log and "free" in log and "Traceback" not in log, log
            assert first.stop() == 0
        finally:
            first.kill()
            second.kill()


def test_a_restarted_daemon_finds_shm_an_engine_held_for_the_old_arena(tmp_path: Path) -> None:
    """The daemon dies while a same-node engine maps its arena (12 MiB on 16 MiB of shm). The
    engine must let go of the dead arena once it sees the daemon gone, or the restarted daemon
    cannot reserve a new one (its pages stay allocated while any process maps them)."""
    from kvstore.client import KVClient
    from tests.conftest import random_kv, same_bytes, small_layout

    layout = small_layout(block_tokens=256)  # 128 KiB blocks
    tokens = list(range(1024))
    with tmpfs(tmp_path / "shm", "16m") as shm:
        d = _daemon(tmp_path, "d", shm, "12MiB").start()
        try:
            with KVClient(d.target, layout, deadline_s=5, transfer="shm") as c:
                assert c.publish(tokens, random_kv(layout, 1024)) == 1024
                assert c.fetch(tokens)[0] == 1024  # the engine maps the arena
                d.kill()
                assert c.lookup(tokens) == 0  # the engine sees the daemon gone
                d.start(timeout=30)  # refused ("cannot be reserved") while the map is held
                kv = random_kv(layout, 1024, seed=1)

                def back() -> bool:
                    return c.publish(tokens, kv) == 1024

                wait_until(back, 10, "the engine publishing to the restarted daemon")
                n, got = c.fetch(tokens)
                assert n == 1024 and same_bytes(got, kv)
        finally:
            d.kill()
