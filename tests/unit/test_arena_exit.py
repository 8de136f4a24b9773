"""A process that lets go of a daemon's arena just before it exits must exit cleanly.

The unmap runs on the arena's background thread (`kvstore/arena.py` `_reap`). It releases the
GIL, and a daemon thread taking it back while the interpreter exits is ended by a forced
unwind; when that unwind ran through torch's deleter of a tensor over the mapping, the
process aborted ("terminate called without an active exception", SIGABRT) after its work
was done: 9 of 20 runs of this script, and a third of the engine processes of
tests/fault/test_storage_shm.py. The thread now drops the tensor before the mapping, and an
exit handler ends it before the interpreter finalizes (0 of 60 runs here).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
from kvstore.arena import Arena
a = Arena.create(sys.argv[1], 128 << 20)
a.array[::4096] = 1  # populated: its unmap takes a while
b = Arena.attach(a.path, a.size)  # a client's mapping of it, and a view as a copy makes
v = b.tensor[:10]
a.unlink()
del v, b  # the background thread unmaps `b` while the interpreter exits
"""


def test_a_process_exiting_while_its_arena_is_unmapped_exits_cleanly() -> None:
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else None) as d:
        codes = [subprocess.run([sys.executable, "-c", SCRIPT, d], cwd=ROOT,
                                capture_output=True, text=True, timeout=120).returncode
                 for _ in range(8)]
    assert codes == [0] * 8, f"exit codes {codes} (-6: aborted at exit)"
