"""A `KVStoreConnector` whose fetches come back one kvstore block short, tail poisoned.

It stands for a daemon that evicts or loses blocks between the scheduler's lookup and the
worker's fetch. The blocks past what the fetch reports hold NaNs: if the connector ever kept
them in vLLM's cache (`fetch`), or trusted what it copied past the reported end (`fetch_with`,
which hands the connector a NaN view for the prompt's last block), the outputs would show it.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kvstore.client.integrations.vllm import KVStoreConnector
from kvstore.client.sync import KVClient


class _ShortFetch:
    """Wraps a `KVClient`: `fetch` reports one block fewer than it got, the rest NaN."""

    def __init__(self, client: KVClient, poison: float = float("nan")) -> None:
        self._client = client
        self._poison = poison

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

    def fetch_with(self, tokens: Any, consume: Any, *, skip_blocks: int = 0,
                   **kwargs: Any) -> int:
        last = len(self._client.keys(tokens)) - 1

        def poisoned(blocks: list[int], views: list[torch.Tensor], stop: Any) -> int | None:
            views = [torch.full_like(v, self._poison) if b == last else v
                     for b, v in zip(blocks, views, strict=True)]
            return consume(blocks, views, stop)  # type: ignore[no-any-return]

        n = self._client.fetch_with(tokens, poisoned, skip_blocks=skip_blocks, **kwargs)
        return min(n, last * self._client.layout.block_tokens)


class FlakyKVStoreConnector(KVStoreConnector):
    """Worker-side fetches lose their last block (see the module docstring)."""

    def _client(self, salt: str, lora: str, group: int = 0, shard: int | None = None,
                peer: str | None = None) -> Any:
        return _ShortFetch(super()._client(salt, lora, group, shard, peer))


class FiniteFlakyKVStoreConnector(KVStoreConnector):
    """The same, its poisoned block large finite values (1e4) instead of NaN: a hybrid model's
    failed load is recomputed from the first token in freshly allocated blocks, whose slots
    past the prompt may keep what the failed load wrote; vLLM's CPU attention reads such
    masked slots with weight 0, which a NaN turns into NaN (docs/ENGINES.md, "Hybrid
    models"). Values used by attention would still change the output."""

    def _client(self, salt: str, lora: str, group: int = 0, shard: int | None = None,
                peer: str | None = None) -> Any:
        return _ShortFetch(super()._client(salt, lora, group, shard, peer), poison=1e4)


class RankFlakyKVStoreConnector(KVStoreConnector):
    """Tensor parallel: rank 1's worker-side fetches lose their last block (NaN), rank 0's
    are whole; a fault in one worker's load."""

    def _client(self, salt: str, lora: str, group: int = 0, shard: int | None = None,
                peer: str | None = None) -> Any:
        client = super()._client(salt, lora, group, shard, peer)
        return _ShortFetch(client) if self._rank == 1 else client


class StageFlakyKVStoreConnector(KVStoreConnector):
    """Pipeline parallel: stage 0's worker-side fetches lose their last block (NaN), stage
    1's are whole; a fault in one stage's load, which makes every later stage's new K/V of
    that step wrong too."""

    def _client(self, salt: str, lora: str, group: int = 0, shard: int | None = None,
                peer: str | None = None) -> Any:
        client = super()._client(salt, lora, group, shard, peer)
        return _ShortFetch(client) if self._stage == 0 else client


SLOW_LOAD_S = 4.0


class SlowLoadKVStoreConnector(KVStoreConnector):
    """`async_load`: each background load waits SLOW_LOAD_S before fetching (a slow daemon),
    so a request can be aborted while its load has not yet copied anything into its pages."""

    def _load_in_background(self, loads: Any) -> None:
        import time

        time.sleep(SLOW_LOAD_S)
        super()._load_in_background(loads)


class _SlowSave:
    """Wraps a `KVClient`: every save (`publish_with`) starts `delay_s` late."""

    def __init__(self, client: KVClient, delay_s: float = 1.5) -> None:
        self._client = client
        self._delay_s = delay_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def publish_with(self, tokens: Any, produce: Any) -> int:
        time.sleep(self._delay_s)
        return self._client.publish_with(tokens, produce)


class SlowSaveKVStoreConnector(KVStoreConnector):
    """Saves that take 1.5 s longer: a request finishes long before its blocks are stored."""

    def _client(self, salt: str, lora: str, group: int = 0, shard: int | None = None,
                peer: str | None = None) -> Any:
        return _SlowSave(super()._client(salt, lora, group, shard, peer))


LAYER_COPY_S = 0.05


class _SlowLayers:
    """Wraps a `PagedCache`: each `scatter_views` starts LAYER_COPY_S late."""

    def __init__(self, cache: Any) -> None:
        self._cache = cache

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def scatter_views(self, *args: Any) -> None:
        time.sleep(LAYER_COPY_S)
        self._cache.scatter_views(*args)


class SlowLayerKVStoreConnector(KVStoreConnector):
    """Loads whose every copy is LAYER_COPY_S late (a layer-by-layer load: each layer), into
    pages filled with NaN when the step's loads start: a forward that read a layer before
    its K/V were in place would give NaN log-probabilities, not the cold run's."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self._shard_caches = {k: _SlowLayers(c) for k, c in self._shard_caches.items()}

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        from kvstore.client.integrations.paged import token_pages

        for spec in self._metadata().loads:
            cache = self._shard_caches[spec.group, spec.shard]
            ps = cache.page_size
            pages = token_pages(spec.block_ids, self._groups[spec.group].block_size, ps,
                                spec.start, spec.end // ps * ps)
            for layer in cache.layers:
                layer[pages] = float("nan")
        super().start_load_kv(forward_context, **kwargs)


class SkippedLayerWaitKVStoreConnector(SlowLayerKVStoreConnector):
    """The same slow copies into NaN pages, and an attention layer (the first) that never
    waits for its load: a backend that does not call `wait_for_layer_load`. Its forward reads
    NaN; the connector must see the missing wait and fail the step's loads."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._layer_of.get(layer_name) != 0:
            super().wait_for_layer_load(layer_name)
