"""kvstore client library: `KVClient` (sync) and `AsyncKVClient`, embedded in engines."""

from client.aio import AsyncKVClient
from client.backoff import BackoffPolicy
from client.sync import KVClient

__all__ = ["AsyncKVClient", "BackoffPolicy", "KVClient"]
