"""A disk that fills up, or a data directory that turns read-only, under a real daemon.

The disk tier degrades: its writes stop (counted, logged once, `kvstore_disk_degraded` and
Stats' `degraded` say so), what it holds is still served (verified), the host tier keeps taking
publishes and serving them, SIGTERM exits 0 and removes the arena, and a restart on the same
filesystem works (read-only, with a clear log line, when the disk cannot be written). Before
the fix a failed write's cleanup raised from RocksDB: every Publish failed INTERNAL, SIGTERM
exited 1 leaving the arena behind, and no daemon started on the full filesystem.

Real filesystems: a tmpfs of a few MiB (root needed; skipped otherwise).
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvstore.client import KVClient
from kvstore.server.process import DaemonProcess
from tests.conftest import random_kv, same_bytes, small_layout
from tests.fault.smallfs import (
    ext4,
    fail_read_only,
    fill,
    make_writable,
    read_only_bind,
    tmpfs,
)
from tests.reliability import stats, tier, wait_quiescent

pytestmark = [pytest.mark.fault, pytest.mark.integration]
LAYOUT = small_layout()  # 8 KiB blocks; a prompt of 64 tokens is 4 of them


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Daemon(DaemonProcess):
    """A daemon whose data directory is on the filesystem under test, and whose socket, log
    and arena are not (they must work while that filesystem is full or read-only)."""

    def __init__(self, data_dir: Path, outside: Path, *args: str) -> None:
        self.port = _free_port()
        super().__init__(data_dir, "--socket", str(outside / "kv.sock"), "--shm-dir",
                         str(outside / "shm"), "--metrics-port", str(self.port), *args)
        (outside / "shm").mkdir(exist_ok=True)
        self.outside = outside
        self.log = outside / "daemon.log"

    @property
    def socket(self) -> str:
        return str(self.outside / "kv.sock")

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.port}/metrics"
        return urllib.request.urlopen(url, timeout=10).read().decode()


def _prompt(p: int) -> tuple[list[int], object]:
    return [p * 1000 + t for t in range(64)], random_kv(LAYOUT, 64, seed=p)


def _publish_all(d: DaemonProcess, prompts: range) -> None:
    """Every publish is taken: the host tier keeps serving whatever the disk does."""
    with KVClient(d.target, LAYOUT, deadline_s=5) as c:
        for p in prompts:
            tokens, kv = _prompt(p)
            assert c.publish(tokens, kv) == 64, f"publish of prompt {p} was refused"


def _fetch_all(d: DaemonProcess, prompts: range) -> int:
    """Fetch each prompt: a hit must be byte-identical, else a miss. Returns full hits."""
    hits = 0
    with KVClient(d.target, LAYOUT, deadline_s=5) as c:
        for p in prompts:
            tokens, kv = _prompt(p)
            n, got = c.fetch(tokens)
            assert n % 16 == 0, n
            assert n == 0 or same_bytes(got, kv[:, :, :n]), f"prompt {p}: wrong bytes"
            hits += n == 64
    return hits


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    assert m, f"{name} not exported"
    return float(m.group(1))


def _check_degraded(d: _Daemon, why: str) -> None:
    disk = tier(stats(d.target), "disk")
    assert disk.degraded and why in disk.degraded_reason, disk
    text = d.metrics()
    assert _metric(text, "kvstore_disk_degraded") == 1
    assert _metric(text, "kvstore_disk_write_failures_total") >= 1
    cli = subprocess.run([sys.executable, "-m", "kvstore.client.cli", "--target", d.target,
                          "stats"], capture_output=True, text=True, timeout=60, check=False)
    assert cli.returncode == 0 and "disk tier DEGRADED" in cli.stdout and why in cli.stdout, cli
    log = d.log.read_text()
    assert len(re.findall(r"disk tier degraded", log)) == 1, log  # logged once
    assert "Traceback" not in log, log


def _wait_writable(d: _Daemon, within_s: float = 20) -> None:
    """Until the disk tier takes writes again (`disk_recheck_s`), then check it says so."""
    deadline = time.monotonic() + within_s
    while tier(stats(d.target), "disk").degraded:
        assert time.monotonic() < deadline, "the disk tier never took writes again"
        time.sleep(0.2)
    assert _metric(d.metrics(), "kvstore_disk_degraded") == 0
    assert _metric(d.metrics(), "kvstore_disk_recoveries_total") == 1
    assert "disk tier takes writes again" in d.log.read_text()


def _stop_cleanly(d: _Daemon) -> None:
    # (this process's writer lock lies beside it: `kvstore.writer_lock`)
    arena = list((d.outside / "shm").glob("kvstore-*.arena"))
    assert len(arena) == 1
    assert d.stop() == 0, d.log.read_text()[-3000:]
    # Removed, or left for the next daemon (`host_handover_s`) marked as such.
    assert not arena[0].exists() or Path(f"{arena[0]}.handover").exists(), \
        "SIGTERM left the arena behind unmarked"
    assert not Path(d.socket).exists()


def test_disk_full_degrades_the_disk_tier_and_host_keeps_serving(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "fs", "4m") as fs:
        fill(fs)  # the filesystem is full but for what the filler could not use
        (fs / "filler").unlink()
        (fs / "ballast").write_bytes(bytes(3 << 20))  # ~1 MiB left: the disk tier fills it
        d = _Daemon(fs / "d0", tmp_path, "--host-bytes", "256KiB", "--disk-bytes", "64MiB",
                    "--shutdown-flush-s", "5")
        try:
            d.start()
            # 200 blocks published: ~170 demoted, at 12 KiB each on disk: ~2 MiB > 1 MiB free.
            _publish_all(d, range(50))
            _check_degraded(d, "No space left")
            assert _fetch_all(d, range(42, 50)) == 8, "the newest prompts are in host (32 blocks)"
            _fetch_all(d, range(50))  # the rest: byte-identical or a miss, never an error
            _publish_all(d, range(50, 60))  # still taking publishes
            assert _fetch_all(d, range(55, 60)) == 5
            wait_quiescent(d.target, 5)
            _stop_cleanly(d)
            # A restart on the still-full filesystem works and serves what the disk holds.
            d.start()
            disk_hits = _fetch_all(d, range(60))
            assert disk_hits > 0, "nothing the disk held came back"
            _publish_all(d, range(60, 70))
            assert _fetch_all(d, range(65, 70)) == 5
            assert "Traceback" not in d.log.read_text()
            _stop_cleanly(d)
        finally:
            d.kill()


def test_data_dir_turning_read_only(tmp_path: Path) -> None:
    with ext4(tmp_path / "fs", tmp_path / "fs.img", 32) as fs:
        d = _Daemon(fs / "d0", tmp_path, "--host-bytes", "256KiB", "--disk-bytes", "8MiB")
        try:
            d.start()
            _publish_all(d, range(20))  # 80 blocks: most demoted to disk
            on_disk = tier(stats(d.target), "disk").blocks
            assert on_disk > 40
            fail_read_only(fs)
            _publish_all(d, range(20, 40))  # demotions now fail: EROFS
            _check_degraded(d, "Read-only file system")
            assert _fetch_all(d, range(35, 40)) == 5
            assert _fetch_all(d, range(20)) > 0, "the disk tier no longer serves reads"
            wait_quiescent(d.target, 5)
            _stop_cleanly(d)
            # Restart on the read-only directory: the disk tier opens read-only and serves.
            d.start()
            log = d.log.read_text()
            assert "disk tier read-only" in log, log[-3000:]
            disk = tier(stats(d.target), "disk")
            assert disk.degraded and disk.blocks > 0
            assert _fetch_all(d, range(20)) > 0, "the read-only disk tier serves nothing"
            _publish_all(d, range(40, 45))
            assert _fetch_all(d, range(40, 45)) == 5
            assert "Traceback" not in d.log.read_text(), log
            _stop_cleanly(d)
            # With its socket in the read-only directory a daemon cannot listen: a clear no.
            plain = DaemonProcess(fs / "d0", "--shm-dir", str(tmp_path / "shm"))
            plain.log = tmp_path / "plain.log"
            with pytest.raises(RuntimeError, match="did not start"):
                plain.start(timeout=30)
            log = plain.log.read_text()
            assert plain.proc is not None and plain.proc.returncode == 2, log
            assert "socket" in log and "Read-only file system" in log, log
            assert "Traceback" not in log, log
        finally:
            d.kill()


def test_a_disk_freed_under_the_daemon_takes_writes_again(tmp_path: Path) -> None:
    """The operator frees space: the tier takes writes again within `disk_recheck_s`, and a
    Clear made while it was degraded stays done across a restart."""
    with tmpfs(tmp_path / "fs", "16m") as fs:
        (fs / "ballast").write_bytes(bytes(15 << 20))  # ~1 MiB left, the tier wants 8 MiB
        d = _Daemon(fs / "d0", tmp_path, "--host-bytes", "256KiB", "--disk-bytes", "8MiB",
                    "--disk-recheck-s", "1")
        try:
            d.start()
            _publish_all(d, range(50))  # ~2 MiB demoted: the disk fills
            _check_degraded(d, "No space left")
            time.sleep(2.5)  # rechecked twice meanwhile: still full, so still degraded
            assert tier(stats(d.target), "disk").degraded
            with KVClient(d.target, LAYOUT, deadline_s=5) as c:
                assert c.clear() > 0  # dropped from disk, not yet durable: it cannot write
            assert tier(stats(d.target), "disk").blocks == 0
            (fs / "ballast").unlink()
            _wait_writable(d)
            _publish_all(d, range(100, 140))  # 160 blocks: ~1.9 MiB onto the disk
            disk = tier(stats(d.target), "disk")
            assert not disk.degraded and disk.blocks > 100, disk
            wait_quiescent(d.target, 5)
            _stop_cleanly(d)
            d.start()  # the Clear stayed done; what was written after recovery is all there
            assert _fetch_all(d, range(50)) == 0, "blocks cleared while degraded came back"
            assert _fetch_all(d, range(100, 140)) == 40
            log = d.log.read_text()
            assert "damaged" not in log and "Traceback" not in log, log[-3000:]
            _stop_cleanly(d)
        finally:
            d.kill()


def test_a_data_dir_mounted_read_only_takes_writes_once_remounted(tmp_path: Path) -> None:
    """Started on a read-only mount (index and data file opened read-only), then remounted
    read-write under it: the tier reopens both for writing and takes writes. With KV events
    on, whose description store lives beside the index: it opens read-only too (it used to
    stop the daemon from starting)."""
    src = tmp_path / "src"
    events = ("--kv-events", "tcp://127.0.0.1:0")
    d = _Daemon(src / "d0", tmp_path, "--host-bytes", "256KiB", "--disk-bytes", "8MiB", *events)
    try:
        d.start()
        _publish_all(d, range(20))  # 80 blocks: most on disk after a clean stop
        _stop_cleanly(d)
    finally:
        d.kill()
    with read_only_bind(src, tmp_path / "ro") as ro:
        d = _Daemon(ro / "d0", tmp_path, "--host-bytes", "256KiB", "--disk-bytes", "8MiB",
                    "--disk-recheck-s", "1", *events)
        try:
            d.start()
            assert "disk tier read-only" in d.log.read_text()
            before = tier(stats(d.target), "disk")
            assert before.degraded and before.blocks > 40, before
            make_writable(ro)
            _wait_writable(d)
            _publish_all(d, range(20, 40))
            assert tier(stats(d.target), "disk").blocks > before.blocks
            wait_quiescent(d.target, 5)
            _stop_cleanly(d)
            d.start()
            log = d.log.read_text()
            assert "damaged" not in log and "Traceback" not in log, log[-3000:]
            assert _fetch_all(d, range(40)) == 40, "the disk blocks did not all come back"
            _stop_cleanly(d)
        finally:
            d.kill()
