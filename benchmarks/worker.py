"""A subprocess driven by JSON lines: the way benchmarks and tests run an engine or another
store in its own interpreter (vLLM's venv, LMCache's venv).

The child reads one JSON command per line on stdin and answers each with a line
`RESULT {json}` on stdout; everything else it prints (stderr included) is its log. Standard
library only: the LMCache worker imports it in a venv without kvstore's dependencies.
"""

from __future__ import annotations

import collections
import contextlib
import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any


class JsonLineWorker:
    """Start `argv`; `read` the first result (e.g. a readiness message), `call` commands,
    `close` with a `quit` command. Log lines go to `log_path` (when given, flushed per line so
    a reader can follow it) and the last ones stay in memory for `tail`."""

    def __init__(self, name: str, argv: Sequence[str], *, cwd: Path, env: dict[str, str],
                 log_path: Path | None = None) -> None:
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "w") if log_path else None  # noqa: SIM115 - see close()
        self._tail: collections.deque[str] = collections.deque(maxlen=200)
        self.proc = subprocess.Popen(list(argv), cwd=cwd, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def read(self) -> dict[str, Any]:
        """The next result; log lines before it are kept. RuntimeError if the child exits."""
        for line in self._pipe(self.proc.stdout):
            if line.startswith("RESULT "):
                return json.loads(line.removeprefix("RESULT "))
            self._tail.append(line)
            if self._log is not None:
                self._log.write(line)
                self._log.flush()
        where = f"; see {self.log_path}" if self.log_path else ""
        raise RuntimeError(f"{self.name} exited ({self.proc.wait()}){where}:\n{self.tail()}")

    @staticmethod
    def _pipe(pipe: IO[str] | None) -> IO[str]:
        if pipe is None:  # Popen was given PIPE for both: cannot happen
            raise RuntimeError("worker pipe is closed")
        return pipe

    def call(self, **cmd: Any) -> dict[str, Any]:
        stdin = self._pipe(self.proc.stdin)
        stdin.write(json.dumps(cmd) + "\n")
        stdin.flush()
        return self.read()

    def tail(self, n: int = 60) -> str:
        return "".join(list(self._tail)[-n:])

    def close(self, timeout: float = 60) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(RuntimeError, BrokenPipeError):
                self.call(op="quit")
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._log is not None:
            self._log.close()
