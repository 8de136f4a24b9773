"""The gRPC servicer: validates requests, then maps them onto `TieredStore` calls.

Sizes, counts and layouts are checked before anything is allocated. Errors from the store's
hierarchy become their gRPC status with the message intact. Requests that do not even decode
are `INVALID_ARGUMENT` too: the service is registered (`add_service`) with deserializers that
turn a decoding failure into an `Undecodable` value the handlers reject, where gRPC's own
would answer UNKNOWN or INTERNAL and log a traceback per bad message.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc
import numpy as np

from kvstore import __version__
from kvstore.errors import InvalidArgumentError, KVStoreError, PermissionDeniedError
from kvstore.keys import KEY_BYTES
from kvstore.layout import MAX_STRING_BYTES, KVLayout
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.server.inspect import NamespaceBook, inspect_reply
from kvstore.server.metrics import Metrics
from kvstore.server.store import PublishLease, TieredStore
from kvstore.server.tenancy import Scope, current_scope, current_tenant, owner_tag
from kvstore.tiering import owner_of

log = logging.getLogger(__name__)
# Bytes per streamed data message. 1 MiB, not 4: a stream nobody reads holds ~4.6 MiB of the
# daemon's memory instead of ~19.5 (gRPC keeps several copies of a message in flight), and
# streaming fetches measured faster, not slower (0.29-0.35 against 0.13-0.22 GiB/s for 128 MiB,
# alternating runs on 2 loaded cores).
STREAM_CHUNK = 1 << 20
FETCH_ANSWER_SHARE = 0.5  # of a Fetch's time left, for its disk reads to start in
# DescribeBlocks (KV events): tokens one description may cover when the namespace's layout is
# not known (its `block_tokens` is the limit when it is): 256 times the default block, more
# than a real model's 1 GiB block (`MAX_BLOCK_BYTES`) holds at its tens of KiB per token.
DESCRIBED_TOKENS = 1 << 16
DESCRIBE_CALL_TOKENS = 1 << 21  # per call: a 2M-token prompt's blocks in one call
ENGINE_HASH_BYTES = 64  # an engine block hash (vLLM's: 32-byte SHA-256, or 8 bytes)


def layout_from_proto(msg: pb.Layout) -> KVLayout:
    if not msg.model:
        raise InvalidArgumentError("layout is missing (layout.model is empty)")
    return KVLayout(
        model=msg.model, num_layers=msg.num_layers, num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim, dtype=msg.dtype, block_tokens=msg.block_tokens,
        model_revision=msg.model_revision, kv_kind=msg.kv_kind or "kv",
        tp_rank=msg.tp_rank, tp_size=msg.tp_size or 1, pp_rank=msg.pp_rank,
        pp_size=msg.pp_size or 1)


def layout_to_proto(layout: KVLayout) -> pb.Layout:
    return pb.Layout(**layout.to_dict())


class Undecodable:
    """What a request that failed to decode becomes; handlers answer INVALID_ARGUMENT."""

    __slots__ = ("error", "type_name")

    def __init__(self, type_name: str, error: str) -> None:
        # The error's text only: the exception's traceback would keep the raw request alive.
        self.type_name, self.error = type_name, error

    def reject(self) -> InvalidArgumentError:
        return InvalidArgumentError(f"request is not a valid {self.type_name}: {self.error}")


def _tolerant(message: Any) -> Callable[[bytes], Any]:
    def decode(raw: bytes) -> Any:
        try:
            return message.FromString(raw)
        except Exception as e:  # DecodeError, or anything else a hostile message provokes
            return Undecodable(message.DESCRIPTOR.full_name, str(e))

    return decode


_HANDLERS = {(False, False): grpc.unary_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler,
             (True, True): grpc.stream_stream_rpc_method_handler}


_DATA_TAG = bytes([pb.FetchChunk.DATA_FIELD_NUMBER << 3 | 2])  # length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def data_chunk(index: int, offset: int, data: Any) -> bytes:
    """A STREAM fetch's data message, `FetchChunk(block_index, chunk_offset, data)`, encoded
    here: its bytes are copied once, from the arena into the message (`data`: any buffer).
    Built as a message, they were copied three times (out of the arena, into the message,
    into its encoding), and a fetch over TCP ran at a quarter of gRPC's own rate."""
    head = pb.FetchChunk(block_index=index, chunk_offset=offset).SerializeToString()
    return b"".join((head, _DATA_TAG, _varint(len(data)), data))


def _serializer(message: Any) -> Any:
    """The message's encoder, passing through messages encoded already (`data_chunk`)."""
    encode = message.SerializeToString

    def serialize(msg: Any) -> bytes:
        return msg if isinstance(msg, bytes) else encode(msg)

    return serialize


def add_service(service: KVStoreService, server: grpc.aio.Server) -> None:
    """Register `service` as the generated `add_KVStoreServicer_to_server` would, but with
    `_tolerant` deserializers, built from the proto's own service descriptor."""
    desc = pb.DESCRIPTOR.services_by_name["KVStore"]
    handlers = {}
    for m in desc.methods:
        make = _HANDLERS[(m.client_streaming, m.server_streaming)]
        handlers[m.name] = make(
            getattr(service, m.name),
            request_deserializer=_tolerant(getattr(pb, m.input_type.name)),
            response_serializer=_serializer(getattr(pb, m.output_type.name)))
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(desc.full_name, handlers),))
    server.add_registered_method_handlers(desc.full_name, handlers)


def _code(err: KVStoreError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, err.grpc_code, grpc.StatusCode.INTERNAL)


class StalledError(KVStoreError):
    """A client stopped moving a stream's bytes for longer than `lease_timeout_s`."""

    grpc_code = "DEADLINE_EXCEEDED"


class OverloadedError(KVStoreError):
    """More calls that create work are in progress than `max_concurrent_rpcs` allows."""

    grpc_code = "RESOURCE_EXHAUSTED"


class Admission:
    """The concurrency limit, shared by every listener of one daemon.

    Only calls that create work count and are shed past the limit (`SHED`). Calls that end
    work (Release, Commit) or only read a few counters (Info, Stats) are always served: were
    they shed too, an overloaded daemon would refuse the very calls that unpin its blocks,
    and every lease of the overload would hold its blocks until `lease_timeout_s`.
    """

    SHED = frozenset({"Lookup", "Fetch", "Publish", "Reserve", "Clear", "Inspect"})

    def __init__(self, limit: int = 0) -> None:
        self.limit = limit  # 0: no limit
        self.working = 0
        self.shed = 0
        # Streams (Publish, streaming Fetch) hold memory and a slot for as long as their client
        # takes (up to `lease_timeout_s` of silence): a quarter of the slots at most, so slow or
        # hostile TCP clients can neither starve same-node callers nor take more than a
        # quarter-limit times ~5 MiB.
        self.stream_limit = max(1, limit // 4) if limit else 0
        self.streams = 0
        # Tenants (TCP callers scoped by their token) share the slots: one holds at most half
        # of the calls and of the streams, all of them together three quarters of the calls,
        # so a tenant flooding the daemon leaves room to the others and to same-node callers.
        self.tenant_limit = max(1, limit // 2) if limit else 0
        self.tenants_limit = max(1, limit - limit // 4) if limit else 0
        self.tenant_stream_limit = max(1, self.stream_limit // 2) if limit else 0
        self.by_tenant: dict[str, int] = {}  # calls in progress per tenant ("": all scoped)
        self.streams_by_tenant: dict[str, int] = {}

    def _shed(self, why: str) -> OverloadedError:
        self.shed += 1
        return OverloadedError(f"{why}; shedding load")

    @staticmethod
    def _take(counts: dict[str, int], tenant: str, n: int) -> None:
        counts[tenant] = counts.get(tenant, 0) + n
        if not counts[tenant]:
            del counts[tenant]

    @contextlib.contextmanager
    def stream(self) -> Iterator[None]:
        """Hold one of the stream slots for the body; `OverloadedError` when none is free."""
        if self.stream_limit and self.streams >= self.stream_limit:
            raise self._shed(f"{self.streams} streams in progress, the limit is "
                             f"{self.stream_limit} (max_concurrent_rpcs / 4)")
        tenant = current_tenant.get()
        if (tenant and self.tenant_stream_limit
                and self.streams_by_tenant.get(tenant, 0) >= self.tenant_stream_limit):
            raise self._shed(f"tenant {tenant!r} has {self.streams_by_tenant[tenant]} streams "
                             f"in progress, a tenant's limit is {self.tenant_stream_limit} "
                             "(half the stream slots)")
        self.streams += 1
        if tenant:
            self._take(self.streams_by_tenant, tenant, 1)
        try:
            yield
        finally:
            self.streams -= 1
            if tenant:
                self._take(self.streams_by_tenant, tenant, -1)

    def enter(self, method: str) -> str | None:
        """Admit a call: its tenant ("" unscoped; pass it to `leave` when the call ends), or
        None for calls that are never shed nor counted. `OverloadedError` past the limit, or
        past its tenant's."""
        if method not in self.SHED:
            return None
        if self.limit and self.working >= self.limit:
            raise self._shed(f"{self.working} calls in progress, the limit is {self.limit}")
        tenant = current_tenant.get()
        if tenant and self.limit:
            if self.by_tenant.get(tenant, 0) >= self.tenant_limit:
                raise self._shed(f"tenant {tenant!r} has {self.by_tenant[tenant]} calls in "
                                 f"progress, a tenant's limit is {self.tenant_limit} "
                                 "(max_concurrent_rpcs / 2)")
            if self.by_tenant.get("", 0) >= self.tenants_limit:
                raise self._shed(f"tenants have {self.by_tenant['']} calls in progress, their "
                                 f"limit is {self.tenants_limit} (3/4 of max_concurrent_rpcs)")
        self.working += 1
        if tenant:
            self._take(self.by_tenant, tenant, 1)
            self._take(self.by_tenant, "", 1)
        return tenant

    def leave(self, tenant: str = "") -> None:
        """End a call `enter` admitted; `tenant`: what `enter` returned."""
        self.working -= 1
        if tenant:
            self._take(self.by_tenant, tenant, -1)
            self._take(self.by_tenant, "", -1)


class _ClientGone(Exception):
    """A write to a call's stream failed: its client cancelled it or went away."""


def rpc(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Admit (or shed) the call, time it, map kvstore errors to statuses, never let an internal
    error go unlogged."""

    @functools.wraps(fn)
    async def unary(self: KVStoreService, request: Any,
                    context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        start, code = time.perf_counter(), "OK"
        self.metrics.gauges["inflight"] += 1
        admitted: str | None = None
        status: tuple[grpc.StatusCode, str] | None = None
        try:
            admitted = self.admission.enter(fn.__name__)
            if isinstance(request, Undecodable):
                raise request.reject()
            return await fn(self, request, context)
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        except KVStoreError as e:
            code, status = e.grpc_code, (_code(e), str(e))
        except _ClientGone:
            # Its choice, not the daemon's fault: no error to log or alert on.
            code = "CANCELLED"
            log.debug("%s: the client went away mid-call", fn.__name__, exc_info=True)
            return None
        except Exception:
            code = "INTERNAL"
            log.exception("%s failed", fn.__name__)
            status = (grpc.StatusCode.INTERNAL, f"{fn.__name__}: internal error")
        finally:
            if admitted is not None:
                self.admission.leave(admitted)
            self.metrics.gauges["inflight"] -= 1
            self.metrics.latency.labels(fn.__name__, code).observe(time.perf_counter() - start)
        if status is not None:
            _fail(context, status)
            if status[0] in _BAD_INPUT:
                _collect_soon()
        return None

    return unary


# Refusals of what a client sent (not of load: shedding must not add pauses to an overload).
_BAD_INPUT = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED,
                        grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OUT_OF_RANGE})
_FULL_COLLECT_EVERY_S = 1.0
_COLLECT_EVERY_S = 0.01
_last_collect = _last_full_collect = 0.0


def _collect_soon() -> None:
    """After a call refused for its input: a garbage collection once the call is over. Each
    call's state in gRPC sits in a reference cycle, so a refused request, up to
    `max_message_bytes`, stayed in memory until the cyclic collector ran, which counts
    objects, not bytes: 35 refused 16 MiB publishes grew the daemon by 414 MiB. The young
    generations hold a short call's objects (collecting them took 0.1-0.15 ms); a full
    collection, at most one a second, catches a long call's (start-up's objects are frozen,
    `gc.freeze`, so it scans only later ones). At most one every `_COLLECT_EVERY_S`, so a
    flood of bad requests costs the loop little."""
    global _last_collect, _last_full_collect
    now = time.monotonic()
    if now - _last_collect < _COLLECT_EVERY_S:
        return
    _last_collect = now
    full = now - _last_full_collect >= _FULL_COLLECT_EVERY_S
    if full:
        _last_full_collect = now
    asyncio.get_running_loop().call_later(0.05, gc.collect, 2 if full else 1)  # call ended


def _fail(context: grpc.aio.ServicerContext[Any, Any], status: tuple[grpc.StatusCode, str]) -> None:
    """End the call with `status` (the handler then returns nothing).

    Not `context.abort`: it raises, and the exception's traceback holds the handler's frames,
    which hold the exception (and, chained, the one that was caught): reference cycles that
    keep every refused request, up to `max_message_bytes` each, alive until the cyclic garbage
    collector runs, which in a daemon can be thousands of bad requests later."""
    context.set_code(status[0])
    context.set_details(status[1])


class KVStoreService(pb_grpc.KVStoreServicer):
    def __init__(self, store: TieredStore, metrics: Metrics, max_blocks_per_call: int,
                 max_message_bytes: int, admission: Admission | None = None,
                 namespaces: NamespaceBook | None = None) -> None:
        self.store = store
        self.admission = admission or Admission()
        self.namespaces = namespaces or NamespaceBook()
        self.metrics = metrics
        self.max_blocks = max_blocks_per_call
        self.max_message_bytes = max_message_bytes

    def _keys(self, keys: Any, more: int = 0, name: str = "keys") -> list[bytes]:
        """`keys` checked: `more` other keys of the same call count against the limit too."""
        if len(keys) + more > self.max_blocks:
            raise InvalidArgumentError(f"{len(keys) + more} keys in one call; the limit is "
                                       f"{self.max_blocks}")
        out: list[bytes] = list(keys)  # each access to a repeated field makes new bytes: once
        if out and set(map(len, out)) != {KEY_BYTES}:
            i, k = next((i, k) for i, k in enumerate(out) if len(k) != KEY_BYTES)
            raise InvalidArgumentError(f"{name}[{i}] is {len(k)} bytes, keys are {KEY_BYTES}")
        return out

    @staticmethod
    def _namespace(ns: bytes) -> bytes:
        if len(ns) != KEY_BYTES:
            raise InvalidArgumentError(f"namespace is {len(ns)} bytes, expected {KEY_BYTES}")
        return ns

    @rpc
    async def Info(self, request: pb.InfoRequest, context: Any) -> pb.InfoReply:
        arena = self.store.host.arena
        return pb.InfoReply(version=__version__, arena_path=str(arena.path),
                            arena_bytes=arena.size, arena_id=self.store.host.arena_id,
                            max_message_bytes=self.max_message_bytes,
                            max_blocks_per_call=self.max_blocks,
                            kv_events=self.store.events.publisher.endpoint
                            if self.store.events is not None else "",
                            slab=self._slab(context))

    def _slab(self, context: Any) -> pb.Slab | None:
        """The gpu tier's slab, for a Unix-socket caller (a same-node client; the slab, like the
        arena, is zero-copy and unscoped by tenant)."""
        gpu = self.store.gpu
        if gpu is None or not context.peer().startswith("unix:"):
            return None
        fields = gpu.share()
        return pb.Slab(**fields) if fields is not None else None

    @rpc
    async def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupReply:
        # Past the local prefix the shared remote tier is asked too (keys there are
        # prefixed by the namespace, so it needs one; a malformed one just skips remote).
        scope = current_scope()  # a TCP tenant's keys and namespace are rewritten (tenancy.py)
        keys = scope.keys(self._keys(request.keys))
        ns = scope.namespace(request.namespace)
        if request.each:  # a probe: `prefetch` does not apply
            held = await self.store.held(keys, ns)
            leading = held.index(False) if False in held else len(held)
            return pb.LookupReply(hits=leading, found=held)
        layout = layout_from_proto(request.layout) if request.prefetch else None
        found = await self.store.lookup_through(keys, ns)
        if layout is not None:
            # Only blocks a promotion into host helps: remote and disk hits (a gpu hit is read
            # where it lies, or through scratch space, never promoted down into host).
            resident = {t.name for t in self.store.tiers if t is not self.store.disk}
            if any(t not in resident for t in found):
                self.store.prefetch(keys[: len(found)], layout.digest(), ns, layout.block_bytes,
                                    owner=scope.tenant)
        bw = self.store.read_bandwidth()  # measured tiers only (the host tier never is)
        return pb.LookupReply(hits=len(found), tiers=found,
                              read_bandwidth={t: bw[t] for t in set(found) if t in bw})

    def _zero_copy_allowed(self, context: Any, what: str) -> None:
        """Zero-copy transfers hand out arena offsets that only a caller mapping the daemon's
        shared arena can use: one on the Unix socket (same user, mode 0600). A TCP caller
        could neither write nor read them, yet Reserve + Commit would publish whatever the
        slots held before (another tenant's KV), and unreleased SHM fetch leases pin blocks."""
        if not context.peer().startswith("unix:"):
            raise PermissionDeniedError(f"{what} is zero-copy through the shared arena, which "
                                        "only Unix-socket clients map; over TCP use the "
                                        "streaming transfer")

    @rpc
    async def Fetch(self, request: pb.FetchRequest, context: Any) -> None:
        """SHM: one message, the lease handed to the client. STREAM: the lease stays held by
        this call while its bytes go out, each chunk read from a block this call pins; a
        client that stops reading for `lease_timeout_s` ends the call (and the pins)."""
        layout = layout_from_proto(request.layout)
        scope = current_scope()
        keys = scope.keys(self._keys(request.keys))
        # The prompt's earlier keys count against the same limit: they name its blocks too.
        prior = scope.keys(self._keys(request.prior_keys, len(keys), "prior_keys"))
        ns = scope.namespace(request.namespace)
        shm = request.transfer == pb.TRANSFER_SHM
        if shm:
            self._zero_copy_allowed(context, "a TRANSFER_SHM fetch")
        if len(ns) == KEY_BYTES:
            self.namespaces.note(ns, layout, scope, request.namespace)
        # Only an SHM fetch may get slab blocks (a stream's bytes come from the host arena).
        slab_ok = shm and request.slab_ok and self.store.gpu is not None
        # Reads that would start after half the client's time are left to its next call: it
        # gets the prefix read so far with time to copy it, however slow the disk.
        left = context.time_remaining()
        lease = await self.store.fetch(keys, layout.digest(), ns, layout.block_bytes,
                                       owner=scope.tenant, hold=True, prior=prior,
                                       slab_ok=slab_ok, whole=request.whole,
                                       answer_within=None if left is None
                                       else left * FETCH_ANSWER_SHARE)
        try:
            refs = [pb.BlockRef(offset=e.offset, length=e.length, tier=t, in_slab=in_slab)
                    for e, t, in_slab in zip(lease.entries, lease.tiers, lease.in_slab,
                                             strict=True)]
            if shm:
                gpu = self.store.gpu
                await self._send(context, pb.FetchChunk(
                    hits=len(refs), lease_id=lease.id if lease.entries else 0, blocks=refs,
                    arena_id=self.store.host.arena_id, more=lease.more,
                    slab_id=gpu.slab_id if slab_ok and gpu is not None else ""))
                # Sent: the client's to release now (or the reaper's after lease_timeout_s).
                # A send that failed releases it below; had the client got it anyway, its
                # Release answers False and it discards the copy.
                if lease.entries:
                    self.store.hand_over(lease, hold=False)
                    self.store.count_served(lease)
                return
            with self.admission.stream():
                await self._send(context, pb.FetchChunk(hits=len(refs), blocks=refs,
                                                        more=lease.more))
                for i, entry in enumerate(lease.entries):
                    data = self.store.host.view(entry)
                    for off in range(0, entry.length, STREAM_CHUNK):
                        await self._send(context, data_chunk(i, off,
                                                             data[off : off + STREAM_CHUNK]))
                    self.store.count_served(lease, i)
        finally:
            if lease.held:
                self.store.release(lease.id)

    async def _send(self, context: Any, msg: pb.FetchChunk | bytes) -> None:
        """Write one message, or end the call when the client has not taken it within
        `lease_timeout_s`: a stream nobody reads must not hold pins, memory and a concurrency
        slot until the client goes away."""
        try:
            async with asyncio.timeout(self.store.lease_timeout_s):
                await context.write(msg)
        except TimeoutError:
            raise StalledError(f"the client read nothing for {self.store.lease_timeout_s:g} s "
                               "(lease_timeout_s); the fetch is ended") from None
        except Exception as e:  # grpc's ExecuteBatchError, AbortError, UsageError: the
            # stream is gone (cancelled, connection dropped), before the call knows it
            raise _ClientGone from e

    async def _next(self, messages: AsyncIterator[Any], what: str) -> Any:
        """The next message of a client stream (None at its end), or `StalledError` after
        `lease_timeout_s` of silence."""
        try:
            async with asyncio.timeout(self.store.lease_timeout_s):
                return await anext(messages, None)
        except TimeoutError:
            raise StalledError(f"the client sent nothing for {self.store.lease_timeout_s:g} s "
                               f"(lease_timeout_s) {what}; the publish is ended") from None

    @rpc
    async def Publish(self, request_iterator: Any, context: Any) -> pb.PublishReply:
        """Blocks arrive in order; each is reserved when its first chunk comes and committed
        when its last does, so a stream needs host space for one block, not all of them.

        The reservation is held by this call (the reaper never hands its slot to anyone
        else while the stream may still write into it), and bounded by the call: a block must
        arrive within `lease_timeout_s` of its first chunk, and silence longer than that ends
        the stream; either way the reservation is freed and nothing of that block is stored.
        """
        with self.admission.stream():
            return await self._publish(aiter(request_iterator))

    async def _publish(self, messages: AsyncIterator[Any]) -> pb.PublishReply:
        first = await self._next(messages, "after opening the stream")
        if first is None:
            raise InvalidArgumentError("empty Publish stream: the first message names the blocks")
        if isinstance(first, Undecodable):
            raise first.reject()
        layout = layout_from_proto(first.layout)
        scope = current_scope()
        keys = scope.keys(self._keys(first.keys))
        prior = scope.keys(self._keys(first.prior_keys, len(keys), "prior_keys"))
        ns = scope.namespace(self._namespace(first.namespace))
        self.namespaces.note(ns, layout, scope, first.namespace)
        digest, length = layout.digest(), layout.block_bytes
        stored = present = 0
        block, filled = -1, 0
        lease: PublishLease | None = None
        target: np.ndarray | None = None
        msg = first
        try:
            while msg is not None:
                if isinstance(msg, Undecodable):
                    raise msg.reject()
                if msg.data:
                    i, off = msg.block_index, msg.chunk_offset
                    if i >= len(keys) or i < block:
                        raise InvalidArgumentError(f"block_index {i} out of order or past the "
                                                   f"{len(keys)} keys")
                    if i != block:
                        if block >= 0 and filled != length:
                            raise InvalidArgumentError(f"block {block} got {filled} of "
                                                       f"{length} bytes")
                        block, filled = i, 0
                        lease = await self.store.reserve(ns, digest, [keys[i]], length,
                                                         owner=scope.tenant, hold=True)
                        target = (self.store.host.view(lease.entries[0]) if lease.entries
                                  else None)
                        present += not lease.needed[0] if lease.needed else 0
                    if off != filled or off + len(msg.data) > length:
                        raise InvalidArgumentError(f"block {i}: chunk at {off}+{len(msg.data)}, "
                                                   f"expected offset {filled} within {length} "
                                                   "bytes")
                    if lease is not None and time.monotonic() > lease.expires:
                        raise StalledError(f"block {i} took longer than "
                                           f"{self.store.lease_timeout_s:g} s (lease_timeout_s) "
                                           "to arrive; the publish is ended")
                    if target is not None:  # the slot is this call's: its lease is held
                        target[off : off + len(msg.data)] = np.frombuffer(msg.data, np.uint8)
                    filled += len(msg.data)
                    if filled == length and lease is not None:
                        stored += (self.store.commit(lease.id, scope.tenant) if lease.entries
                                   else 0)
                        self.store.release(lease.id)
                        lease, target = None, None
                msg = await self._next(messages, f"after {block + 1} blocks")
            if block >= 0 and filled != length:
                raise InvalidArgumentError(f"block {block} got {filled} of {length} bytes")
            # Blocks were committed one by one; rank the chain as a whole (parents freshest),
            # the blocks before the stream's (`prior_keys`) included.
            self.store.touch_chain([*prior, *keys[: block + 1]])
        finally:
            if lease is not None:
                self.store.release(lease.id)
        return pb.PublishReply(stored=stored, present=present)

    @rpc
    async def Reserve(self, request: pb.ReserveRequest, context: Any) -> pb.ReserveReply:
        self._zero_copy_allowed(context, "Reserve (then Commit)")
        layout = layout_from_proto(request.layout)
        scope = current_scope()
        keys = scope.keys(self._keys(request.keys))
        prior = scope.keys(self._keys(request.prior_keys, len(keys), "prior_keys"))
        ns = scope.namespace(self._namespace(request.namespace))
        self.namespaces.note(ns, layout, scope, request.namespace)
        lease = await self.store.reserve(ns, layout.digest(), keys, layout.block_bytes,
                                         owner=scope.tenant, prior=prior,
                                         writer=request.writer)
        if not lease.entries:  # nothing to write: no lease to hold (Commit(0) is a no-op)
            self.store.commit(lease.id, scope.tenant)  # ranks the chain, as Commit would
        refs = [pb.BlockRef(offset=e.offset, length=e.length, tier="host") for e in lease.entries]
        return pb.ReserveReply(lease_id=lease.id if lease.entries else 0, needed=lease.needed,
                               blocks=refs,
                               arena_id=self.store.host.arena_id, more=lease.more)

    @rpc
    async def Commit(self, request: pb.CommitRequest, context: Any) -> pb.CommitReply:
        if request.lease_id == 0:  # a Reserve that needed nothing: already ended
            return pb.CommitReply(stored=0)
        return pb.CommitReply(stored=self.store.commit(request.lease_id,
                                                       current_scope().tenant))

    @rpc
    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseReply:
        lease = self.store.leases.get(request.lease_id)
        if lease is not None and lease.held:  # a call of the daemon's own is moving its bytes
            return pb.ReleaseReply(released=False)
        return pb.ReleaseReply(released=self.store.release(request.lease_id,
                                                           current_scope().tenant))

    @rpc
    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsReply:
        scope = current_scope()
        if scope.scoped:  # a tenant sees its own blocks, not the daemon's traffic
            return tenant_stats_reply(self.store, scope)
        # In flight: every call but this one.
        return stats_reply(self.store, self.metrics.gauges["inflight"] - 1, self.admission.shed)

    @rpc
    async def Clear(self, request: pb.ClearRequest, context: Any) -> pb.ClearReply:
        if request.all == bool(request.namespace):
            raise InvalidArgumentError("Clear takes either a namespace or all=true")
        scope = current_scope()
        if request.all and scope.scoped:
            raise PermissionDeniedError("Clear(all) is for the admin token or the Unix socket; "
                                        "a tenant clears its namespaces one at a time")
        ns = None if request.all else scope.namespace(self._namespace(request.namespace))
        # The shared tier too, or read-through would bring the cleared blocks straight back.
        # `removed` is then local blocks plus remote values: a block in both counts twice.
        local, remote = await self.store.clear_everywhere(ns)
        return pb.ClearReply(removed=local + remote)

    @rpc
    async def EndSession(self, request: pb.EndSessionRequest,
                         context: Any) -> pb.EndSessionReply:
        # A tenant's keys are rewritten into its own key space (tenancy.py): it can mark only
        # its own blocks, never another tenant's.
        keys = current_scope().keys(self._keys(request.keys))
        return pb.EndSessionReply(marked=self.store.end_session(keys))

    @rpc
    async def Inspect(self, request: pb.InspectRequest, context: Any) -> pb.InspectReply:
        return inspect_reply(self.store, self.namespaces, current_scope())

    @rpc
    async def DescribeBlocks(self, request: pb.DescribeBlocksRequest,
                             context: Any) -> pb.DescribeBlocksReply:
        scope = current_scope()
        keys = scope.keys(self._keys([b.key for b in request.blocks]))
        self._check_descriptions(request, scope)
        events = self.store.events
        if events is None:  # events off: nothing to keep (clients ask Info first)
            return pb.DescribeBlocksReply(described=0)
        from kvstore.server.kv_events import EngineBlocks  # pyzmq/msgspec: only when events on

        for key, b in zip(keys, request.blocks, strict=True):
            events.describe(key, EngineBlocks(
                block_hashes=list(b.block_hashes),
                parent_block_hash=b.parent_block_hash or None,
                token_ids=list(b.token_ids), block_size=b.block_size,
                lora_name=b.lora_name or None,
                group_idx=b.group_idx if b.HasField("group_idx") else None,
                spec_kind=b.kv_cache_spec_kind or None,
                sliding_window=b.sliding_window or None))
        return pb.DescribeBlocksReply(described=len(keys))

    def _check_descriptions(self, request: pb.DescribeBlocksRequest, scope: Scope) -> None:
        """Sizes first (lengths only, nothing copied): a description is kept as long as its
        block is, so none may name more than its block holds. The engine blocks of one cover
        `len(block_hashes) * block_size` tokens: at most the namespace's `block_tokens` when
        a call named its layout since start (Inspect's book), else `DESCRIBED_TOKENS`; its
        token ids are at most those tokens. A call covers at most `DESCRIBE_CALL_TOKENS`."""
        ns = scope.namespace(request.namespace)
        seen = self.namespaces.get(ns) if len(ns) == KEY_BYTES else None
        limit, why = ((seen.layout.block_tokens, "the namespace's block_tokens") if seen
                      else (DESCRIBED_TOKENS, "the limit for a block"))
        total = 0
        for i, b in enumerate(request.blocks):
            hashes, size = len(b.block_hashes), b.block_size
            if not hashes or not size:
                raise InvalidArgumentError("DescribeBlocks: every block needs block_hashes "
                                           "and block_size")
            if hashes * size > limit:
                raise InvalidArgumentError(
                    f"blocks[{i}].block_hashes: {hashes} engine blocks of {size} tokens "
                    f"(block_size) cover {hashes * size} tokens, more than one block holds "
                    f"({limit}: {why})")
            if len(b.token_ids) > hashes * size:
                raise InvalidArgumentError(
                    f"blocks[{i}].token_ids: {len(b.token_ids)} ids, more than its {hashes} "
                    f"engine blocks of {size} tokens hold ({hashes * size})")
            total += hashes * size
            if total > DESCRIBE_CALL_TOKENS:
                raise InvalidArgumentError(
                    f"blocks: over {DESCRIBE_CALL_TOKENS} tokens described in one call "
                    "(block_hashes times block_size, summed); describe fewer blocks per call")
            for name, longest in (("parent_block_hash", len(b.parent_block_hash)),
                                  ("block_hashes", max(map(len, b.block_hashes)))):
                if longest > ENGINE_HASH_BYTES:
                    raise InvalidArgumentError(f"blocks[{i}].{name}: a hash of {longest} "
                                               f"bytes; the limit is {ENGINE_HASH_BYTES}")
            for name in ("lora_name", "kv_cache_spec_kind"):
                if (n := len(getattr(b, name).encode())) > MAX_STRING_BYTES:
                    raise InvalidArgumentError(f"blocks[{i}].{name} is {n} bytes; the limit "
                                               f"is {MAX_STRING_BYTES}")


_STARTED = time.monotonic()


def tenant_stats_reply(store: TieredStore, scope: Scope) -> pb.StatsReply:
    """Stats as a tenant may see them: capacity, and the blocks and bytes of its own
    namespaces per tier. The daemon's counters (lookups, hits, leases, traffic) are every
    tenant's together, so they would tell one tenant what the others do: left at 0."""
    tiers = []
    mine = owner_tag(scope.tenant)  # the tag of its namespaces: known after a restart too
    for tier in store.tiers:
        blocks = nbytes = 0
        for ns, (n, b) in tier.by_namespace.items():
            if owner_of(ns) == mine:
                blocks, nbytes = blocks + n, nbytes + b
        tiers.append(pb.TierStats(name=tier.name, blocks=blocks, used_bytes=nbytes,
                                  capacity_bytes=tier.capacity_bytes))
    return pb.StatsReply(version=__version__, uptime_s=time.monotonic() - _STARTED, tiers=tiers)


def stats_reply(store: TieredStore, inflight_rpcs: int = 0, shed_rpcs: int = 0) -> pb.StatsReply:
    c = store.counters
    bw = store.read_bandwidth()  # 0: not measured (the host tier never is: a hit is a pin)
    tiers = []
    for tier in store.tiers:
        s = tier.stats()
        tiers.append(pb.TierStats(
            name=s.name, blocks=s.blocks, used_bytes=s.used_bytes,
            capacity_bytes=s.capacity_bytes, pinned_blocks=s.pinned_blocks,
            evictions=s.evictions, hits=c.tier_hits.get(s.name, 0),
            bytes_read=c.bytes_read.get(s.name, 0), bytes_written=c.bytes_written.get(s.name, 0),
            read_bandwidth=bw.get(s.name, 0.0), degraded=bool(s.degraded),
            degraded_reason=s.degraded))
    remote, integrity_failures = None, c.integrity_failures
    if store.remote is not None and store.write_queue is not None:
        r, q = store.remote.stats(), store.write_queue.stats()
        integrity_failures += r.integrity_failures
        tiers.append(pb.TierStats(
            name=store.remote.name, hits=c.tier_hits.get(store.remote.name, 0),
            bytes_read=c.bytes_read.get(store.remote.name, 0), bytes_written=r.bytes_written,
            read_bandwidth=bw.get(store.remote.name, 0.0)))
        remote = pb.RemoteStats(
            url=r.url, available=r.available, queue_depth=q.depth, queue_capacity=q.capacity,
            queued_writes=q.queued, shed_writes=q.shed, written_blocks=r.blocks_written,
            failed_writes=r.failed_writes, lost_writes=c.remote_lost_writes, errors=r.errors,
            timeouts=r.timeouts, breaker_opens=r.breaker_opens, skipped_calls=r.skipped_calls,
            integrity_failures=r.integrity_failures, lookup_hits=c.remote_lookup_hits,
            dropped_writes=c.remote_dropped_writes)
    return pb.StatsReply(
        version=__version__, uptime_s=time.monotonic() - _STARTED, tiers=tiers,
        lookups=c.lookups, hit_blocks=c.hit_blocks, miss_blocks=c.miss_blocks,
        integrity_failures=integrity_failures, active_leases=len(store.leases),
        demotions=c.demotions, promotions=c.promotions, stored_blocks=c.stored_blocks,
        remote=remote, inflight_rpcs=max(0, inflight_rpcs), expired_leases=c.expired_leases,
        shed_rpcs=shed_rpcs,
        kv_events_published=store.events.publisher.published if store.events else 0,
        kv_events_dropped=store.events.publisher.dropped if store.events else 0,
        lifts_skipped=c.lifts_skipped, sessions_ended=c.sessions_ended,
        session_blocks_marked=c.session_blocks_marked,
        host_prefaulted_bytes=store.host.prefaulted_bytes,
        fenced_leases=store.fences.fenced_total, fenced_bytes=store.fences.nbytes,
        late_fetches=c.late_fetches, prefetches=c.prefetches,
        prefetched_blocks=c.prefetched_blocks)
