"""Shared fixtures: a real daemon in its own process, and small layouts."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstore import KVLayout
from kvstore.server.process import DaemonProcess


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """KVTEST_REPORT_AT_ONCE=1: a failure's traceback is written to stderr as it happens, not
    in the summary at the end. A run on a lent GPU machine (scripts/gpu_issue19.sh) is cut
    off by its time limit before that summary (docs/GPU.md)."""
    if report.failed and os.environ.get("KVTEST_REPORT_AT_ONCE") == "1":
        print(f"\n=== FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n",
              file=sys.__stderr__, flush=True)


def small_layout(dtype: torch.dtype = torch.float32, model: str = "tiny", **kw: object) -> KVLayout:
    """2 layers, 2 heads, head_dim 16, 16-token blocks: 512 B/token in fp32, 8 KiB blocks."""
    args: dict = dict(model=model, num_layers=2, num_kv_heads=2, head_dim=16, dtype=dtype,
                      block_tokens=16)
    args.update(kw)
    return KVLayout(**args)


def random_kv(layout: KVLayout, n_tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.kv_shape(n_tokens), generator=g).to(layout.torch_dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality (NaN patterns included), of tensors on any device (a slab's are CUDA)."""
    return a.shape == b.shape and a.dtype == b.dtype and bytes(
        a.contiguous().cpu().view(torch.uint8).numpy()) == bytes(
        b.contiguous().cpu().view(torch.uint8).numpy())


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
