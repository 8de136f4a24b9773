"""Real small filesystems for the storage fault tests: a tmpfs of a few MiB that fills up, and
an ext4 image (loop device, `errors=remount-ro`) that the kernel turns read-only under open
files, as it does on a real disk error. Mounting needs root (CI runs as root); elsewhere the
tests skip, saying why."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)


@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of `size` (`16m`) at `path` for the block; skip the test if impossible."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs (CI runs as root)")
    path.mkdir(parents=True, exist_ok=True)
    r = _run("mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path))
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs at {path}: {r.stderr.strip()}")
    try:
        yield path
    finally:
        # Lazy: a daemon killed by the test may still hold files open for an instant.
        _run("umount", "-l", str(path))


@contextmanager
def ext4(path: Path, image: Path, size_mib: int, reserved_pct: int = 5) -> Iterator[Path]:
    """Mount a fresh ext4 image of `size_mib` at `path` with `errors=remount-ro`, keeping
    `reserved_pct` of its blocks for root (mkfs's default is 5)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount an ext4 image (CI runs as root)")
    with open(image, "wb") as f:
        f.truncate(size_mib << 20)
    r = _run("mkfs.ext4", "-q", "-F", "-m", str(reserved_pct), str(image))
    if r.returncode != 0:
        pytest.skip(f"mkfs.ext4 unavailable or failed: {r.stderr.strip()}")
    path.mkdir(parents=True, exist_ok=True)
    r = _run("mount", "-o", "loop,errors=remount-ro", str(image), str(path))
    if r.returncode != 0:
        pytest.skip(f"cannot loop-mount an ext4 image at {path}: {r.stderr.strip()}")
    try:
        yield path
    finally:
        _run("umount", "-l", str(path))


def fail_read_only(path: Path) -> None:
    """Make the ext4 filesystem at `path` hit an error: the kernel remounts it read-only at
    once, files open for writing included (`remount,ro` would refuse: busy)."""
    dev = _run("findmnt", "-n", "-o", "SOURCE", str(path)).stdout.strip()
    trigger = Path("/sys/fs/ext4") / Path(dev).name / "trigger_fs_error"
    if not trigger.exists():
        pytest.skip(f"{trigger} is missing: cannot inject an ext4 error")
    trigger.write_text("kvstore test: the data directory turns read-only\n")
    with pytest.raises(OSError, match="Read-only file system"):
        (path / "probe").write_bytes(b"x")


def fill(path: Path) -> int:
    """Write a filler file until the filesystem is full; returns the bytes written."""
    written = 0
    chunk = b"\xa5" * 4096
    with open(path / "filler", "wb", buffering=0) as f:
        try:
            while n := f.write(chunk):
                written += n
        except OSError:  # ENOSPC: full
            pass
    return written


@contextmanager
def read_only_bind(source: Path, path: Path) -> Iterator[Path]:
    """Bind-mount `source` at `path` read-only (as a volume mounted read-only by mistake);
    `make_writable(path)` turns it read-write in place, under open files."""
    if os.geteuid() != 0:
        pytest.skip("needs root to bind-mount a directory (CI runs as root)")
    path.mkdir(parents=True, exist_ok=True)
    for cmd in (("mount", "--bind", str(source), str(path)),
                ("mount", "-o", "remount,bind,ro", str(path))):
        r = _run(*cmd)
        if r.returncode != 0:
            _run("umount", "-l", str(path))
            pytest.skip(f"cannot bind-mount {source} read-only: {r.stderr.strip()}")
    try:
        yield path
    finally:
        _run("umount", "-l", str(path))


def make_writable(path: Path) -> None:
    r = _run("mount", "-o", "remount,bind,rw", str(path))
    assert r.returncode == 0, r.stderr
