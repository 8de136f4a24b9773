"""kvstore core: layouts, keys, framing, the tiering policy, config and errors.

`Namespace` and `chain_keys` (which import numpy) are imported on first use (PEP 562), so the
`kvstore` CLI, which needs only `kvstore.proto` and `kvstore.config`, starts fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvstore.errors import (
    CapacityError,
    ConfigError,
    IntegrityError,
    InvalidArgumentError,
    KVStoreError,
    LayoutMismatchError,
)
from kvstore.layout import KVLayout

if TYPE_CHECKING:
    from kvstore.keys import Namespace, chain_keys

__all__ = [
    "CapacityError",
    "ConfigError",
    "IntegrityError",
    "InvalidArgumentError",
    "KVLayout",
    "KVStoreError",
    "LayoutMismatchError",
    "Namespace",
    "chain_keys",
]
__version__ = "0.1.0"

_LAZY = {"Namespace": "kvstore.keys", "chain_keys": "kvstore.keys"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:  # `from kvstore import config` then imports the submodule
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
