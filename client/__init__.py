"""kvstore client library: `KVClient` (sync) and `AsyncKVClient`, embedded in engines.

The names are imported on first use (PEP 562), so `import client.cli` (the operator's
`kvstore` command) does not import torch: `from client import KVClient` works as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.lazy import lazy_exports

if TYPE_CHECKING:
    from client.aio import AsyncKVClient
    from client.backoff import BackoffPolicy
    from client.sync import KVClient

__all__ = ["AsyncKVClient", "BackoffPolicy", "KVClient"]

_LAZY = {"AsyncKVClient": "client.aio", "BackoffPolicy": "client.backoff",
         "KVClient": "client.sync"}

__getattr__, __dir__ = lazy_exports("client", _LAZY, globals())
