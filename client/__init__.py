"""kvstore client library: `KVClient` (sync) and `AsyncKVClient`, embedded in engines.

The names are imported on first use (PEP 562), so `import client.cli` (the operator's
`kvstore` command) does not import torch: `from client import KVClient` works as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from client.aio import AsyncKVClient
    from client.backoff import BackoffPolicy
    from client.sync import KVClient

__all__ = ["AsyncKVClient", "BackoffPolicy", "KVClient"]

_LAZY = {"AsyncKVClient": "client.aio", "BackoffPolicy": "client.backoff",
         "KVClient": "client.sync"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:  # `from client import cli` then imports the submodule
        raise AttributeError(f"module 'client' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
