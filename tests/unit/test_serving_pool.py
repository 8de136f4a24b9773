"""`benchmarks.vllm_serving --pool`: the pooled TTFT figures PERFORMANCE.md quotes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import benchmarks.vllm_serving as serving

ARGS = {"users": 4, "rounds": 3, "system": 1024, "question": 1024, "answer": 16,
        "cache_blocks": 48, "stagger_s": 1.0}  # as results files before --history


def write(results: Path, name: str, runs: dict[str, list[list[float]]],
          **args: object) -> None:
    requests = {config: [{"ttft_s": float(sorted(r)[len(r) // 2]), "ttft_runs": r}
                         for r in per] for config, per in runs.items()}
    (results / f"{name}.json").write_text(json.dumps({"args": {**ARGS, **args},
                                                      "requests": requests}))


def test_each_request_is_the_median_of_all_its_runs(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serving, "RESULTS", tmp_path)
    write(tmp_path, "one", {"kvstore": [[1.0, 9.0], [2.0, 2.0]], "vllm": [[5.0], [6.0]]})
    write(tmp_path, "two", {"kvstore": [[2.0], [4.0, 4.0]], "vllm": [[7.0], [8.0]]})
    rows = {r["config"]: r for r in serving.pooled(["one", "two"])}
    # kvstore: request 0 over 1, 9, 2 -> 2; request 1 over 2, 2, 4, 4 -> 3 (not 9's pull).
    assert rows["kvstore"]["runs per request"] == 3
    assert rows["kvstore"]["TTFT mean s"] == pytest.approx(2.5)
    assert rows["kvstore"]["TTFT p50 s"] == pytest.approx(2.5)
    assert rows["vllm"]["TTFT mean s"] == pytest.approx(6.5)  # medians 6 and 7


def test_files_of_other_workloads_are_refused(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serving, "RESULTS", tmp_path)
    write(tmp_path, "one", {"kvstore": [[1.0], [2.0]]})
    write(tmp_path, "three", {"kvstore": [[1.0], [2.0], [3.0]]})
    with pytest.raises(SystemExit, match="not the same workload"):
        serving.pooled(["one", "three"])


def test_files_of_another_shape_are_refused(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serving, "RESULTS", tmp_path)
    write(tmp_path, "old", {"kvstore": [[1.0], [2.0]]})  # no "history": a file from before it
    write(tmp_path, "zero", {"kvstore": [[1.0], [2.0]]}, history=0)
    write(tmp_path, "docs", {"kvstore": [[1.0], [2.0]]}, history=4096)
    assert serving.pooled(["old", "zero"])  # the same workload
    with pytest.raises(SystemExit, match="history"):
        serving.pooled(["old", "docs"])


def test_documents_leave_the_earlier_workload_as_it_was() -> None:
    """Results files of before --history pool with new ones only if the prompts are equal."""
    sys0, docs0, turns0 = serving.workload(4, 3, 1024, 1024, 16)
    sys1, docs1, turns1 = serving.workload(4, 3, 1024, 1024, 16, history=512)
    assert (sys0, turns0) == (sys1, turns1)
    assert docs0 == [[]] * 4
    assert [len(d) for d in docs1] == [512] * 4 and docs1[0] != docs1[1]


def test_worst_request_against_vllm_alone(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serving, "RESULTS", tmp_path)
    write(tmp_path, "one", {"kvstore": [[2.0], [9.0]], "vllm": [[4.0], [6.0]]})
    rows = {r["config"]: r for r in serving.pooled(["one"])}
    assert rows["kvstore"]["worst TTFT / vLLM alone's"] == pytest.approx(1.5)  # 9 / 6
    assert "worst TTFT / vLLM alone's" not in rows["vllm"]


def test_bootstrap_interval_holds_the_ratio_and_narrows_with_agreeing_runs() -> None:
    same = {"a": [[2.0] * 5, [4.0] * 5], "b": [[1.0] * 5, [2.0] * 5]}
    for row in serving.bootstrap_ratio(same, "a", "b", samples=50):
        assert row["2.5%"] == row["median"] == row["97.5%"] == pytest.approx(2.0)
    noisy = {"a": [[1.0, 3.0, 2.0, 2.5, 1.5]] * 2, "b": [[1.0, 3.0, 2.0, 2.5, 1.5]] * 2}
    for row in serving.bootstrap_ratio(noisy, "a", "b", samples=200):
        assert row["2.5%"] < 1.0 < row["97.5%"]  # the same runs: parity, with its spread
