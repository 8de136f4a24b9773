"""kvstore client library: `KVClient` (sync) and `AsyncKVClient`, embedded in engines.

The names are imported on first use (PEP 562), so `import kvstore.client.cli` (the operator's
`kvstore` command) does not import torch: `from kvstore.client import KVClient` works as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.lazy import lazy_exports

if TYPE_CHECKING:
    from kvstore.client.aio import AsyncKVClient
    from kvstore.client.backoff import BackoffPolicy
    from kvstore.client.sync import KVClient

__all__ = ["AsyncKVClient", "BackoffPolicy", "KVClient"]

_LAZY = {"AsyncKVClient": "kvstore.client.aio", "BackoffPolicy": "kvstore.client.backoff",
         "KVClient": "kvstore.client.sync"}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
