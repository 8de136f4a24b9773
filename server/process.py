"""Run `kvstore-server` in its own process: for tests, benchmarks and the demo."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvstore.arena import Arena
from kvstore.config import ServerConfig

ROOT = Path(__file__).resolve().parents[1]
# The daemon runs from the repository root in a checkout (where `python -m kvstore.server`
# imports without an install); from an installed wheel, from wherever its caller is.
CWD = ROOT if (ROOT / "pyproject.toml").is_file() else None


class DaemonProcess:
    """`python -m kvstore.server` in its own process, on a data directory that outlives restarts."""

    def __init__(self, data_dir: Path, *args: str) -> None:
        self.data_dir = Path(data_dir).resolve()  # gRPC wants unix:///absolute/path
        self.args = list(args)
        self.proc: subprocess.Popen[str] | None = None
        self.log = self.data_dir.parent / f"{self.data_dir.name}.log"

    @property
    def socket(self) -> str:
        return str(self.data_dir / "kv.sock")

    @property
    def target(self) -> str:
        return f"unix://{self.socket}"

    def command(self) -> list[str]:
        """The daemon's command line."""
        return [sys.executable, "-m", "kvstore.server", "--data-dir", str(self.data_dir),
                *self.args]

    # 60 s: where a GPU driver exists the daemon pins its arena through CUDA, and a dozen daemons
    # initialising CUDA at once took over 20 s on an H200 machine (docs/GPU.md section 8).
    def start(self, timeout: float = 60.0) -> DaemonProcess:
        cmd = self.command()
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        logf = open(self.log, "a")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(cmd, cwd=CWD, stdout=subprocess.PIPE, stderr=logf,
                                     text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + timeout
        if self.proc.stdout is None:  # never: stdout=PIPE
            raise RuntimeError("no pipe from the daemon's stdout")
        fd, seen = self.proc.stdout.fileno(), b""
        while (left := deadline - time.monotonic()) > 0:
            # Raw reads under a timeout: a daemon that hangs silently must not hang us.
            if not select.select([fd], [], [], left)[0]:
                break
            chunk = os.read(fd, 4096)
            seen += chunk
            if b"READY" in seen:
                return self
            if not chunk:  # the daemon exited
                break
        self.kill()
        raise RuntimeError(f"daemon did not start within {timeout:.0f} s; "
                           f"log:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL, as a crash would; then remove the arena it left (the next daemon to start
        on that directory would, but until then its pages stay in shared memory)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
            Arena.remove_stale(self.shm_dir)  # those no live daemon holds, this one's among them

    @property
    def shm_dir(self) -> str:
        """Where the daemon keeps its arena: `--shm-dir`, else `KVSTORE_SHM_DIR`, else the
        default (a `--config` file's setting is not read)."""
        if "--shm-dir" in self.args[:-1]:
            return self.args[self.args.index("--shm-dir") + 1]
        return os.environ.get("KVSTORE_SHM_DIR", ServerConfig.shm_dir)

    def stop(self, timeout_s: float = 20.0, *, keep_arena: bool = True) -> int:
        """SIGTERM, then SIGKILL after `timeout_s` (give it the daemon's flush budget and
        more: a shutdown flush longer than that is cut short). The daemon leaves its arena's
        memory for the next one started on its `shm_dir` (`host_handover_s`);
        `keep_arena=False`, for a last stop: free it now, not when its keeper gives up on
        a successor (a benchmark's next phase needs that memory)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
                return -9
        code = self.proc.returncode
        if not keep_arena:
            Arena.remove_stale(self.shm_dir)  # unlocked arenas: this one's among them
        return code
