"""A `KVStoreConnector` whose fetches come back one kvstore block short, tail poisoned.

It stands for a daemon that evicts or loses blocks between the scheduler's lookup and the
worker's fetch. The blocks past what the fetch reports hold NaNs: if the connector ever copied
them into vLLM's cache, the outputs would show it.
"""

from __future__ import annotations

from typing import Any

import torch

from client.integrations.vllm import KVStoreConnector
from client.sync import KVClient


class _ShortFetch:
    """Wraps a `KVClient`: `fetch` reports one block fewer than it got, the rest NaN."""

    def __init__(self, client: KVClient) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def fetch(self, tokens: Any, into: torch.Tensor | None = None,
              ) -> tuple[int, torch.Tensor | None]:
        n, kv = self._client.fetch(tokens, into)
        if kv is None or n == 0:
            return n, kv
        short = n - self._client.layout.block_tokens
        kv[:, :, short:] = float("nan")
        return short, kv


class FlakyKVStoreConnector(KVStoreConnector):
    """Worker-side fetches lose their last block (see the module docstring)."""

    def _client(self, salt: str, lora: str) -> Any:
        return _ShortFetch(super()._client(salt, lora))
