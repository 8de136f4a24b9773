"""What `Inspect` reports: the namespaces a daemon holds, their layouts and blocks per tier.

A block carries only its namespace digest; the layout behind a digest is learnt from the calls
that name it (Fetch, Publish, Reserve carry one), so after a restart a namespace read back from
disk shows without a layout until a client names it again. Its tenant is known all along: a
tenant's stored namespace ends with its tag (`kvstore.tiering.owner_of`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from kvstore.layout import KVLayout
from kvstore.proto import kvstore_pb2 as pb
from kvstore.server.store import TieredStore
from kvstore.server.tenancy import OwnerNames, Scope, owner_tag
from kvstore.tiering import owner_of

MAX_NAMESPACES = 4096  # layouts remembered; the oldest is forgotten past it (blocks stay)


@dataclass(frozen=True)
class Seen:
    # The layout as validated (its strings at most `MAX_STRING_BYTES`), never the request's
    # message: a protobuf field keeps its whole request alive (data chunks, thousands of keys).
    layout: KVLayout
    tenant: str
    client_namespace: bytes  # the digest as the client sent it (before tenant scoping)


class NamespaceBook:
    """Layout and tenant of each namespace (by stored digest) seen since start: at most
    `limit` of them, each a few KiB at most (a layout's strings are bounded)."""

    def __init__(self, limit: int = MAX_NAMESPACES, tenants: Iterable[str] = ()) -> None:
        self.limit = limit
        self._seen: dict[bytes, Seen] = {}
        self.names = OwnerNames(tenants)  # the tokens file's tenants (more at a reload)

    def tenant_of(self, stored_ns: bytes) -> str:
        """The tenant of a stored namespace, named or seen since start or not: by its tag."""
        seen = self._seen.get(stored_ns)
        return seen.tenant if seen is not None else self.names(owner_of(stored_ns))

    def note(self, stored_ns: bytes, layout: KVLayout, scope: Scope, client_ns: bytes) -> None:
        if stored_ns in self._seen:
            self._seen[stored_ns] = self._seen.pop(stored_ns)  # most recent last
            return
        self._seen[stored_ns] = Seen(layout, scope.tenant, client_ns)
        if len(self._seen) > self.limit:
            del self._seen[next(iter(self._seen))]

    def get(self, stored_ns: bytes) -> Seen | None:
        return self._seen.get(stored_ns)


def inspect_reply(store: TieredStore, book: NamespaceBook, scope: Scope) -> pb.InspectReply:
    """Every namespace with blocks in a local tier (a tenant: only its own, under the digests
    it sent). The shared remote tier is not scanned: it spans machines and may be large."""
    counts: dict[bytes, dict[str, list[int]]] = defaultdict(dict)
    for tier in store.tiers:  # counts the tiers keep as blocks come and go: no walk of blocks
        for ns, (blocks, nbytes) in tier.by_namespace.items():
            counts[ns][tier.name] = [blocks, nbytes]
    out = []
    for ns, per_tier in sorted(counts.items(), key=lambda kv: -sum(c[1] for c in
                                                                    kv[1].values())):
        # The tenant is the namespace's own tag (`owner_of`), so a tenant finds its blocks
        # after a restart, or once the book has forgotten the namespace, too.
        if scope.scoped and owner_of(ns) != owner_tag(scope.tenant):
            continue
        seen = book.get(ns)
        tenant = scope.tenant or book.tenant_of(ns)
        out.append(pb.NamespaceStats(
            namespace=seen.client_namespace if scope.scoped and seen else ns,
            layout=pb.Layout(**seen.layout.to_dict()) if seen else None, tenant=tenant,
            tiers=[pb.TierBlocks(tier=t, blocks=c[0], bytes=c[1])
                   for t, c in per_tier.items()]))
    return pb.InspectReply(namespaces=out)
