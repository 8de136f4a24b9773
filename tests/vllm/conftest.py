"""vLLM tests: they run in `.venv-vllm` (scripts/setup_vllm.sh) and skip where vLLM is absent."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # Registered here until pyproject's marker list has it (--strict-markers rejects unknowns).
    config.addinivalue_line("markers", "vllm: needs vLLM (.venv-vllm; skipped where absent)")
