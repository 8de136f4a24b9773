"""One error hierarchy for kvstore.

Every failure the store can report is a `KVStoreError`. Each subclass carries the gRPC status
code the daemon answers with, so the server maps errors to statuses in one place and the client
maps statuses back to the same classes.
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Base of every kvstore error."""

    grpc_code: str = "INTERNAL"


class InvalidArgumentError(KVStoreError, ValueError):
    """The caller sent something malformed: a wrong shape, dtype, token or size."""

    grpc_code = "INVALID_ARGUMENT"


class ConfigError(InvalidArgumentError):
    """A configuration value is invalid; the message names the option."""


class LayoutMismatchError(InvalidArgumentError):
    """A tensor or payload does not match the layout it is used with."""


class IntegrityError(KVStoreError):
    """A stored payload failed verification (checksum, key or layout binding, truncation)."""

    grpc_code = "DATA_LOSS"


class CapacityError(KVStoreError):
    """A tier cannot make room: everything left is pinned or the item exceeds its capacity."""

    grpc_code = "RESOURCE_EXHAUSTED"


class NotFoundError(KVStoreError):
    """A lease or block the caller named does not exist (or has expired)."""

    grpc_code = "NOT_FOUND"


class UnavailableError(KVStoreError):
    """The daemon cannot be reached or is shutting down."""

    grpc_code = "UNAVAILABLE"


class AuthError(KVStoreError):
    """The caller did not present a valid token."""

    grpc_code = "UNAUTHENTICATED"


class PermissionDeniedError(KVStoreError):
    """The caller is authenticated but may not do this (a tenant asking for another's data)."""

    grpc_code = "PERMISSION_DENIED"
