"""The benchmarks' cleanup of LMCache's shared-memory buffers (`benchmarks.vllm_ttft`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchmarks.vllm_ttft import remove_dead_lmcache_buffers


def test_only_buffers_of_dead_processes_are_removed(tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead = int(gone.stdout)  # exited: its pid names no live process (unless reused at once)
    for name in (f"lmcache_kv_{dead}_0", f"lmcache_kv_{dead}_1", f"lmcache_kv_{os.getpid()}_0",
                 "lmcache_kv_notapid_0", "kvstore-1-abc.arena"):
        (tmp_path / name).write_bytes(b"x")
    assert remove_dead_lmcache_buffers(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "kvstore-1-abc.arena", f"lmcache_kv_{os.getpid()}_0", "lmcache_kv_notapid_0"]
