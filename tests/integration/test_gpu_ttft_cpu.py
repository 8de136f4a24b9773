"""`benchmarks.gpu_ttft` run small on the CPU (`--device cpu`), so the benchmark a rare GPU
session runs does not rot between them: both daemons (host tier; gpu level with its slab as a
shared file), every warm path, and the checks it reports (logits bit for bit the model's own
split, the prefix served from the gpu level)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks import common, gpu_ttft

pytestmark = pytest.mark.integration


def test_gpu_ttft_runs_small_on_the_cpu(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(sys, "argv", [
        "gpu_ttft", "--device", "cpu", "--layers", "2", "--hidden", "256", "--lengths", "512",
        "--repeats", "1", "--ctas-sweep", "8", "--host-bytes", "256MiB",
        "--gpu-tier-bytes", "64MiB",
        "--data-dir", str(tmp_path / "data"), "--out", "smoke",
        "--profile", str(tmp_path / "profile")])
    gpu_ttft.main()
    (row,) = json.loads((tmp_path / "results" / "smoke.json").read_text())["rows"]
    assert row["prefix_tokens"] == 512
    assert row["bitwise_same_split"] and row["hbm_bitwise_same_split"]
    assert row["gpu_tier_same_split"]
    assert row["gpu_tier_hits_per_prefill"] == 512 / 256  # every block from the gpu level
    assert row["gpu_slab_on"] == "cpu"
    assert row["warm_gpu_tier_s"] > 0 and row["fetch_gpu_tier_s"] > 0
    assert row["warm_groups4_flat_s"] > 0 and row["warm_groups4_ctas8_s"] > 0
    for name in ("512_host", "512_gpu_level"):  # --profile: where each daemon's prefills went
        # The prefill itself: its cumulative time ranks it near the top of the 40 rows (a
        # callee such as start_fetch_cache fell below them on the 16-core GPU machine).
        assert "(_prefill)" in (tmp_path / "profile" / f"{name}.txt").read_text()
        assert "aten::" in (tmp_path / "profile" / f"{name}.torch.txt").read_text()
        assert json.loads((tmp_path / "profile" / f"{name}.trace.json").read_text())
