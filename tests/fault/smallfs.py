"""Real small filesystems for the storage fault tests: a tmpfs of a few MiB that fills up, or
one remounted read-only. Mounting needs root (CI runs as root); elsewhere the tests skip,
saying why."""

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


def remount(path: Path, mode: str) -> None:
    """Remount `path` `ro` or `rw` (the data directory turning read-only under a daemon)."""
    r = _run("mount", "-o", f"remount,{mode}", str(path))
    assert r.returncode == 0, f"remount,{mode} {path}: {r.stderr}"


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
