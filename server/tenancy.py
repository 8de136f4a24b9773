"""Tenants: who a TCP caller is, and the server-side scoping that keeps tenants apart.

A tenant is named by the token it authenticated with (`tenant_tokens_file`), never by a request
field: a client can put anything in its namespace, so isolation cannot rest on it. The daemon
rewrites a tenant's namespace and keys before they reach the store:

    scope   = SHA256("kvstore-tenant-v1\\0" || tenant)
    ns'     = SHA256(scope || ns)[:24] || TAG || scope[:4]       key' = SHA256(scope || key)

(`TAG`: `kvstore.tiering.TENANT_NAMESPACE_TAG`.) A stored namespace so names its tenant in its
last 8 bytes, and the tiers share their space between tenants by it (`kvstore.tiering`), a
reopened disk tier's blocks included. Its first bytes stay a hash of its own: they name it in
the remote tier's keys (`tiers.remote.redis_key`), so `Clear` of one namespace clears that one.

Two tenants sending identical keys therefore address different blocks: neither can read, probe
(by timing a hit) or overwrite the other's. Callers on the Unix socket and those presenting the
admin `token` are unscoped (tenant ""): they see the store as it is.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvstore.config import read_secret_file
from kvstore.errors import ConfigError
from kvstore.tiering import OWNER_BYTES, TENANT_NAMESPACE_TAG

TENANT_SCOPE_VERSION = b"kvstore-tenant-v1\x00"
_TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MIN_TOKEN_CHARS = 16

# The tenant of the call being served ("" = unscoped). Set per call by `TokenInterceptor`'s
# wrapped handler; each gRPC call runs in its own task, hence its own context.
current_tenant: contextvars.ContextVar[str] = contextvars.ContextVar("kvstore_tenant",
                                                                     default="")


def scope_of(tenant: str) -> bytes:
    return hashlib.sha256(TENANT_SCOPE_VERSION + tenant.encode()).digest()


def owner_tag(tenant: str) -> bytes:
    """The last bytes of `tenant`'s stored namespaces: its owner in the tiers
    (`kvstore.tiering.owner_of`); b"" for the unscoped callers (tenant "")."""
    if not tenant:
        return b""
    return TENANT_NAMESPACE_TAG + scope_of(tenant)[: OWNER_BYTES - len(TENANT_NAMESPACE_TAG)]


class OwnerNames:
    """The tenant an owner tag (`owner_tag`, `kvstore.tiering.owner_of`) stands for: "" for
    the unscoped callers, the tokens file's name, or "?" and the hex of the tag's 4 bytes for
    a tenant the file does not list (any more)."""

    def __init__(self, tenants: Iterable[str] = ()) -> None:
        self._names = {owner_tag(t): t for t in tenants}

    def add(self, tenants: Iterable[str]) -> None:
        """Name more tenants (a reloaded tokens file); those no longer listed keep their
        names, as their blocks stay until evicted."""
        self._names.update((owner_tag(t), t) for t in tenants)

    def __call__(self, owner: bytes) -> str:
        if not owner:
            return ""
        return self._names.get(owner) or f"?{owner[len(TENANT_NAMESPACE_TAG):].hex()}"


@dataclass(frozen=True)
class Scope:
    """Rewrites namespaces and keys of one tenant; the identity for tenant ""."""

    tenant: str

    @property
    def scoped(self) -> bool:
        return bool(self.tenant)

    def namespace(self, ns: bytes) -> bytes:
        """The stored namespace; a malformed one (not 32 bytes) passes unchanged, so that
        validation still reports what the client sent."""
        if not self.tenant or len(ns) != 32:
            return ns
        return (hashlib.sha256(scope_of(self.tenant) + ns).digest()[: 32 - OWNER_BYTES]
                + owner_tag(self.tenant))

    def keys(self, keys: Sequence[bytes]) -> list[bytes]:
        if not self.tenant:
            return list(keys)
        prefix = scope_of(self.tenant)
        return [hashlib.sha256(prefix + k).digest() for k in keys]


def current_scope() -> Scope:
    return Scope(current_tenant.get())


def owner_weights(weights: dict[str, float], tenants: Iterable[str] | None,
                  ) -> dict[bytes, float]:
    """`tenant_weights` (`kvstore.config.parse_tenant_weights`) by owner tag, each tenant
    named checked against `tenants` (the tokens file's; None: no TCP listener, so none): a
    misspelt name would otherwise leave the tenant meant at 1, silently."""
    listed = set(tenants) if tenants is not None else set()
    unknown = sorted(t for t in weights if t and t not in listed)
    if unknown:
        where = ("`tenant_tokens_file` does not list" if tenants is not None else
                 "there are no tenants without `listen` (they connect over TCP):")
        raise ConfigError(f"tenant_weights: {where} {', '.join(map(repr, unknown))}")
    return {owner_tag(t): w for t, w in weights.items()}


def load_tenant_tokens(path: str | Path) -> dict[str, str]:
    """Token -> tenant from a file of `TENANT TOKEN` lines (`#` comments, blank lines).

    Refuses (ConfigError naming `tenant_tokens_file`) what `read_secret_file` refuses (a file
    others can read, not a regular file, over 1 MiB), malformed lines, tenant names outside
    `[A-Za-z0-9_.-]`, tokens shorter than 16 characters and a token given twice. A tenant may
    have several tokens (rotation).
    """
    opt = "tenant_tokens_file"
    p = Path(path)
    text = read_secret_file(p, opt)
    tokens: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ConfigError(f"{opt}: {p}:{n}: expected `TENANT TOKEN`")
        tenant, token = parts
        if not _TENANT_RE.match(tenant):
            raise ConfigError(f"{opt}: {p}:{n}: tenant name {tenant!r} must be 1-64 of "
                              "[A-Za-z0-9_.-], starting with a letter or digit")
        if len(token) < MIN_TOKEN_CHARS:
            raise ConfigError(f"{opt}: {p}:{n}: the token of {tenant!r} is shorter than "
                              f"{MIN_TOKEN_CHARS} characters")
        if token in tokens:
            raise ConfigError(f"{opt}: {p}:{n}: this token is already given to "
                              f"{tokens[token]!r}")
        tokens[token] = tenant
    if not tokens:
        raise ConfigError(f"{opt}: {p} names no tenants")
    tags: dict[bytes, str] = {}
    for tenant in sorted(set(tokens.values())):
        other = tags.setdefault(owner_tag(tenant), tenant)
        if other != tenant:  # 1 in 2^32 a pair: they would share one eviction share
            raise ConfigError(f"{opt}: tenants {other!r} and {tenant!r} have the same 4-byte "
                              "tag; rename one")
    return tokens


class TokenTable:
    """Maps a presented bearer token to a tenant in constant time over all known tokens."""

    def __init__(self, admin_token: str = "", tenant_tokens: dict[str, str] | None = None) -> None:
        entries = [(f"Bearer {t}".encode(), tenant)
                   for t, tenant in (tenant_tokens or {}).items()]
        if admin_token:
            if admin_token in (tenant_tokens or {}):
                raise ConfigError("token: the admin token is also a tenant's token")
            entries.append((f"Bearer {admin_token}".encode(), ""))
        if not entries:
            raise ConfigError("a TCP listener needs `token` or `tenant_tokens_file`")
        self._entries = entries

    def replace(self, other: TokenTable) -> None:
        """Take `other`'s tokens (a reload): calls from now on are checked against them, each
        call's tenant fixed when it was admitted."""
        self._entries = other._entries

    @property
    def token_count(self) -> int:
        return len(self._entries)

    @property
    def tenants(self) -> set[str]:
        """The tenants the table knows (the admin's "" not included)."""
        return {tenant for _, tenant in self._entries if tenant}

    def tenant_for(self, presented: bytes) -> str | None:
        """The tenant of `presented` ("" for the admin token); None when it matches none.
        Every entry is compared (no early exit), each with `hmac.compare_digest`."""
        found: str | None = None
        for expected, tenant in self._entries:
            if hmac.compare_digest(presented, expected):
                found = tenant
        return found
