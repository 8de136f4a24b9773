"""Unit-test plumbing: start the cross-process key computation as soon as collection ends.

`test_keys.py::test_keys_identical_across_processes_with_different_hash_seeds` runs three fresh
interpreters with different `PYTHONHASHSEED`s; each has to import torch (seconds of CPU).
Started here, they run alongside the other unit tests instead of holding up the run at the end.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HASH_SEEDS = ("0", "1", "12345")
CHILD_SCRIPT = """
import torch
from kvstore import KVLayout, Namespace, chain_keys
ns = Namespace(KVLayout(model="tiny", num_layers=2, num_kv_heads=2, head_dim=16,
                        dtype=torch.float32, block_tokens=16), lora="l", tenant="t", salt="s")
print(",".join(k.hex() for k in chain_keys(ns, list(range(7, 7 + 64)))))
"""
_TEST_NAME = "test_keys_identical_across_processes_with_different_hash_seeds"
_CHILDREN = pytest.StashKey[list[subprocess.Popen[str]]]()


def _spawn() -> list[subprocess.Popen[str]]:
    return [subprocess.Popen([sys.executable, "-c", CHILD_SCRIPT], cwd=ROOT,
                             env={**os.environ, "PYTHONHASHSEED": seed},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for seed in HASH_SEEDS]


def pytest_collection_finish(session: pytest.Session) -> None:
    if any(item.name == _TEST_NAME for item in session.items):
        session.config.stash[_CHILDREN] = _spawn()


def pytest_unconfigure(config: pytest.Config) -> None:
    for proc in config.stash.get(_CHILDREN, []):
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.fixture
def hash_seed_children(request: pytest.FixtureRequest) -> list[subprocess.Popen[str]]:
    """The three child processes (started early when possible), one per seed in HASH_SEEDS."""
    if _CHILDREN not in request.config.stash:
        request.config.stash[_CHILDREN] = _spawn()
    return request.config.stash[_CHILDREN]
