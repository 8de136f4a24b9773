"""A vLLM plugin for the pipeline-parallel tests only: works around vLLM 0.32's CPU build
failing PP > 1 on its first step.

A later stage's model runner keeps its intermediate-tensor buffers in
`GPUModelRunner.intermediate_tensors`, which only `_dummy_run` allocates; the CPU worker never
runs one, so the first step fails `assert self.intermediate_tensors is not None` in
`sync_and_gather_intermediate_tensors`. This allocates them there, as `_dummy_run` would. With
it, PP=2 on the CPU gives the same tokens and log-probabilities as PP=1 (docs/ENGINES.md,
"Pipeline parallel").

It is found through the `vllm.general_plugins` entry point of the `*.dist-info` beside it, so
it loads in every vLLM process (the workers are spawned) of an engine that has this directory
on its PYTHONPATH, and nowhere else.
"""

from __future__ import annotations

from typing import Any


def register() -> None:
    from vllm.v1.worker import gpu_model_runner

    runner = gpu_model_runner.GPUModelRunner
    original = runner.sync_and_gather_intermediate_tensors
    if getattr(original, "kvstore_pp_fix", False):
        return  # vLLM may load a plugin more than once per process

    def sync_and_gather(self: Any, num_tokens: int, intermediate_tensors: Any,
                        sync_self: bool) -> Any:
        if self.intermediate_tensors is None:
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens, dtype=self.model_config.dtype,
                device=self.device)
        return original(self, num_tokens, intermediate_tensors, sync_self)

    sync_and_gather.kvstore_pp_fix = True  # type: ignore[attr-defined]
    runner.sync_and_gather_intermediate_tensors = sync_and_gather
