"""The connector's start-up check of vLLM's CPU attention ISA, by vLLM's own choice of it.

vLLM picks "amx" (a cache packed in AMX tiles, which the connector does not decode) for bf16 at
block sizes that are multiples of 32 on a CPU with AMX, and "vec"/"vec16" otherwise. On a CPU
without AMX the test says AMX is there (the one thing it cannot cause); vLLM's choice and the
connector's check run as they are.

    .venv-vllm/bin/python -m pytest tests/vllm/test_cpu_isa.py -m vllm
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run `bash scripts/setup_vllm.sh`",
                allow_module_level=True)

from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvstore.client.integrations.vllm import ConnectorConfigError, _check_cpu_isa

pytestmark = pytest.mark.vllm
CONFIG = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype="auto"))


def spec(dtype: torch.dtype, block_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=64, dtype=dtype)


@pytest.fixture
def amx(monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cpu._is_amx_tile_supported():
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)


def test_amx_cache_is_refused_at_start_with_what_to_change(amx: None) -> None:
    with pytest.raises(ConnectorConfigError, match=r"'amx'.*--dtype float32.*--block-size 16"):
        _check_cpu_isa(CONFIG, spec(torch.bfloat16, 128))


def test_what_the_refusal_suggests_starts(amx: None) -> None:
    _check_cpu_isa(CONFIG, spec(torch.float32, 128))  # "vec"
    _check_cpu_isa(CONFIG, spec(torch.bfloat16, 16))  # "vec16"
