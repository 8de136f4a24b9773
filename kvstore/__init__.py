"""kvstore core: layouts, keys, framing, the tiering policy, config and errors.

`Namespace` and `chain_keys` (which import numpy) are imported on first use (PEP 562), so the
`kvstore` CLI, which needs only `kvstore.proto` and `kvstore.config`, starts fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.errors import (
    AuthError,
    CapacityError,
    ConfigError,
    IntegrityError,
    InvalidArgumentError,
    KVStoreError,
    LayoutMismatchError,
    PermissionDeniedError,
)
from kvstore.layout import KVLayout
from kvstore.lazy import lazy_exports

if TYPE_CHECKING:
    from kvstore.keys import Namespace, chain_keys

__all__ = [
    "AuthError",
    "CapacityError",
    "ConfigError",
    "IntegrityError",
    "InvalidArgumentError",
    "KVLayout",
    "KVStoreError",
    "LayoutMismatchError",
    "Namespace",
    "PermissionDeniedError",
    "chain_keys",
]
__version__ = "0.1.0"

_LAZY = {"Namespace": "kvstore.keys", "chain_keys": "kvstore.keys"}

__getattr__, __dir__ = lazy_exports("kvstore", _LAZY, globals())
