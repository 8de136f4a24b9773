"""Smoke test of `benchmarks.alternatives` on a tiny layout: the kvstore host and disk paths and
the Redis path, each checked byte for byte by the benchmark itself (no LMCache: its venv is
optional, and starting it costs ~20 s)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks import alternatives
from kvstore import KVLayout
from tests import redis_servers

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not redis_servers.available(),
                                 reason=redis_servers.SKIP_REASON)]


def test_alternatives_tiny_run(tmp_path: Path) -> None:
    layout = KVLayout(model="tiny", num_layers=2, num_kv_heads=2, head_dim=16,
                      dtype=torch.bfloat16, block_tokens=16)
    result = alternatives.run(layout, blocks=2, repeats=2, data=tmp_path / "alt", lmcache=False,
                              disk=True)
    assert result["bytes"] == 2 * layout.block_bytes
    samples = result["samples"]
    assert set(samples) == {"memcpy (limit)", "kvstore host", "kvstore disk",
                            *(name for name, _, _ in alternatives.REDIS_VARIANTS)}
    assert all(len(v) == 2 and min(v) > 0 for s in samples.values() for v in s.values())
    assert set(samples["Redis (numpy().tobytes())"]) == {"publish"}
    rows = {r["path"]: r for r in alternatives.summarise(result)}
    assert rows[alternatives.REDIS]["goal"].startswith(">= 3x")
    assert isinstance(rows[alternatives.REDIS]["kvstore fetch / this"], float)
    assert rows["kvstore disk"]["publish GB/s"] == ""
