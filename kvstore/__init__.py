"""kvstore core: layouts, keys, framing, the tiering policy, config and errors."""

from kvstore.errors import (
    CapacityError,
    ConfigError,
    IntegrityError,
    InvalidArgumentError,
    KVStoreError,
    LayoutMismatchError,
)
from kvstore.keys import Namespace, chain_keys
from kvstore.layout import KVLayout

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
