"""Shared fixtures: a real daemon in its own process, and small layouts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstore import KVLayout

ROOT = Path(__file__).resolve().parents[1]


def small_layout(dtype: torch.dtype = torch.float32, model: str = "tiny", **kw: object) -> KVLayout:
    """2 layers, 2 heads, head_dim 16, 16-token blocks: 512 B/token in fp32, 8 KiB blocks."""
    args: dict = dict(model=model, num_layers=2, num_kv_heads=2, head_dim=16, dtype=dtype,
                      block_tokens=16)
    args.update(kw)
    return KVLayout(**args)


def random_kv(layout: KVLayout, n_tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.kv_shape(n_tokens), generator=g).to(layout.dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bytes(
        a.contiguous().view(torch.uint8).numpy()) == bytes(b.contiguous().view(torch.uint8).numpy())


class DaemonProcess:
    """`python -m server` in its own process, on a data directory that outlives restarts."""

    def __init__(self, data_dir: Path, *args: str) -> None:
        self.data_dir = data_dir
        self.args = list(args)
        self.proc: subprocess.Popen[str] | None = None
        self.log = data_dir.parent / f"{data_dir.name}.log"

    @property
    def socket(self) -> str:
        return str(self.data_dir / "kv.sock")

    @property
    def target(self) -> str:
        return f"unix://{self.socket}"

    def start(self, timeout: float = 20.0) -> DaemonProcess:
        cmd = [sys.executable, "-m", "server", "--data-dir", str(self.data_dir), *self.args]
        logf = open(self.log, "a")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=logf,
                                     text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("READY"):
                return self
            if not line and self.proc.poll() is not None:
                break
        raise RuntimeError(f"daemon did not start; log:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
                return -9
        return self.proc.returncode


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator:
    started: list[DaemonProcess] = []

    def make(*args: str, name: str = "d0") -> DaemonProcess:
        d = DaemonProcess(tmp_path / name, *args)
        started.append(d)
        return d

    yield make
    for d in started:
        d.kill()


@pytest.fixture
def daemon(daemon_factory) -> DaemonProcess:
    return daemon_factory("--host-bytes", "8MiB", "--disk-bytes", "32MiB").start()
