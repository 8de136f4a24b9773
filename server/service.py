"""The gRPC servicer: validates requests, then maps them onto `TieredStore` calls.

Sizes, counts and layouts are checked before anything is allocated. Errors from the store's
hierarchy become their gRPC status with the message intact.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import numpy as np

from kvstore import __version__
from kvstore.errors import InvalidArgumentError, KVStoreError
from kvstore.keys import KEY_BYTES
from kvstore.layout import KVLayout
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from server.metrics import Metrics
from server.store import Lease, TieredStore

log = logging.getLogger(__name__)
STREAM_CHUNK = 4 << 20  # bytes per streamed data message


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


def _code(err: KVStoreError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, err.grpc_code, grpc.StatusCode.INTERNAL)


def rpc(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Time the call, map kvstore errors to statuses, never let an internal error go unlogged."""

    @functools.wraps(fn)
    async def unary(self: KVStoreService, request: Any, context: grpc.aio.ServicerContext) -> Any:
        start, code = time.perf_counter(), "OK"
        self.metrics.gauges["inflight"] += 1
        try:
            return await fn(self, request, context)
        except KVStoreError as e:
            code = e.grpc_code
            await context.abort(_code(e), str(e))
        except Exception:
            code = "INTERNAL"
            log.exception("%s failed", fn.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"{fn.__name__}: internal error")
        finally:
            self.metrics.gauges["inflight"] -= 1
            self.metrics.latency.labels(fn.__name__, code).observe(time.perf_counter() - start)

    return unary


class KVStoreService(pb_grpc.KVStoreServicer):
    def __init__(self, store: TieredStore, metrics: Metrics, max_blocks_per_call: int,
                 max_message_bytes: int) -> None:
        self.store = store
        self.metrics = metrics
        self.max_blocks = max_blocks_per_call
        self.max_message_bytes = max_message_bytes

    def _keys(self, keys: Any) -> list[bytes]:
        if len(keys) > self.max_blocks:
            raise InvalidArgumentError(f"{len(keys)} keys in one call; the limit is "
                                       f"{self.max_blocks}")
        for i, k in enumerate(keys):
            if len(k) != KEY_BYTES:
                raise InvalidArgumentError(f"keys[{i}] is {len(k)} bytes, keys are {KEY_BYTES}")
        return list(keys)

    @staticmethod
    def _namespace(ns: bytes) -> bytes:
        if len(ns) != KEY_BYTES:
            raise InvalidArgumentError(f"namespace is {len(ns)} bytes, expected {KEY_BYTES}")
        return ns

    @rpc
    async def Info(self, request: pb.InfoRequest, context: Any) -> pb.InfoReply:
        arena = self.store.host.arena
        return pb.InfoReply(version=__version__, arena_path=str(arena.path),
                            arena_bytes=arena.size, arena_id=arena.path.name,
                            max_message_bytes=self.max_message_bytes,
                            max_blocks_per_call=self.max_blocks)

    @rpc
    async def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupReply:
        # Past the local prefix the shared remote tier is asked too (keys there are
        # prefixed by the namespace, so it needs one; a malformed one just skips remote).
        found = await self.store.lookup_through(self._keys(request.keys), request.namespace)
        return pb.LookupReply(hits=len(found), tiers=found)

    async def Fetch(self, request: pb.FetchRequest, context: Any) -> AsyncIterator[pb.FetchChunk]:
        start, code = time.perf_counter(), "OK"
        self.metrics.gauges["inflight"] += 1
        lease_id = 0
        try:
            layout = layout_from_proto(request.layout)
            keys = self._keys(request.keys)
            lease = await self.store.fetch(keys, layout.digest(), request.namespace,
                                           layout.block_bytes)
            lease_id = lease.id
            refs = [pb.BlockRef(offset=e.offset, length=e.length, tier=t)
                    for e, t in zip(lease.entries, lease.tiers, strict=True)]
            if request.transfer == pb.TRANSFER_SHM:
                lease_id = 0  # the client releases it after copying
                yield pb.FetchChunk(hits=len(refs), lease_id=lease.id, blocks=refs,
                                    arena_id=self.store.host.arena.path.name, more=lease.more)
                return
            yield pb.FetchChunk(hits=len(refs), blocks=refs, more=lease.more)
            for i, entry in enumerate(lease.entries):
                data = self.store.host.view(entry)
                for off in range(0, entry.length, STREAM_CHUNK):
                    chunk = data[off : off + STREAM_CHUNK].tobytes()
                    yield pb.FetchChunk(block_index=i, chunk_offset=off, data=chunk)
        except KVStoreError as e:
            code = e.grpc_code
            await context.abort(_code(e), str(e))
        finally:
            if lease_id:
                self.store.release(lease_id)
            self.metrics.gauges["inflight"] -= 1
            self.metrics.latency.labels("Fetch", code).observe(time.perf_counter() - start)

    @rpc
    async def Publish(self, request_iterator: Any, context: Any) -> pb.PublishReply:
        """Blocks arrive in order; each is reserved when its first chunk comes and committed
        when its last does, so a stream needs host space for one block, not all of them."""
        first = await anext(aiter(request_iterator), None)
        if first is None:
            raise InvalidArgumentError("empty Publish stream: the first message names the blocks")
        layout = layout_from_proto(first.layout)
        keys = self._keys(first.keys)
        ns = self._namespace(first.namespace)
        digest, length = layout.digest(), layout.block_bytes
        stored = present = 0
        block, filled = -1, 0
        lease: Lease | None = None
        target: np.ndarray | None = None
        try:
            async for msg in _chain(first, request_iterator):
                if not msg.data:
                    continue
                i, off = msg.block_index, msg.chunk_offset
                if i >= len(keys) or i < block:
                    raise InvalidArgumentError(f"block_index {i} out of order or past the "
                                               f"{len(keys)} keys")
                if i != block:
                    if block >= 0 and filled != length:
                        raise InvalidArgumentError(f"block {block} got {filled} of {length} bytes")
                    block, filled = i, 0
                    lease = await self.store.reserve(ns, digest, [keys[i]], length)
                    target = (self.store.host.view(lease.entries[0]) if lease.entries
                              else None)
                    present += not lease.needed[0] if lease.needed else 0
                if off != filled or off + len(msg.data) > length:
                    raise InvalidArgumentError(f"block {i}: chunk at {off}+{len(msg.data)}, "
                                               f"expected offset {filled} within {length} bytes")
                if target is not None:
                    target[off : off + len(msg.data)] = np.frombuffer(msg.data, np.uint8)
                filled += len(msg.data)
                if filled == length and lease is not None:
                    stored += self.store.commit(lease.id) if lease.entries else 0
                    self.store.release(lease.id)
                    lease, target = None, None
            if block >= 0 and filled != length:
                raise InvalidArgumentError(f"block {block} got {filled} of {length} bytes")
            # Blocks were committed one by one; rank the chain as a whole (parents freshest).
            self.store.touch_chain(keys[: block + 1])
        finally:
            if lease is not None:
                self.store.release(lease.id)
        return pb.PublishReply(stored=stored, present=present)

    @rpc
    async def Reserve(self, request: pb.ReserveRequest, context: Any) -> pb.ReserveReply:
        layout = layout_from_proto(request.layout)
        keys = self._keys(request.keys)
        ns = self._namespace(request.namespace)
        lease = await self.store.reserve(ns, layout.digest(), keys, layout.block_bytes)
        refs = [pb.BlockRef(offset=e.offset, length=e.length, tier="host") for e in lease.entries]
        return pb.ReserveReply(lease_id=lease.id, needed=lease.needed, blocks=refs,
                               arena_id=self.store.host.arena.path.name, more=lease.more)

    @rpc
    async def Commit(self, request: pb.CommitRequest, context: Any) -> pb.CommitReply:
        return pb.CommitReply(stored=self.store.commit(request.lease_id))

    @rpc
    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseReply:
        return pb.ReleaseReply(released=self.store.release(request.lease_id))

    @rpc
    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsReply:
        return stats_reply(self.store)

    @rpc
    async def Clear(self, request: pb.ClearRequest, context: Any) -> pb.ClearReply:
        if request.all == bool(request.namespace):
            raise InvalidArgumentError("Clear takes either a namespace or all=true")
        ns = None if request.all else self._namespace(request.namespace)
        removed = self.store.clear(ns)
        # The shared tier too, or read-through would bring the cleared blocks straight back.
        # `removed` is then local blocks plus remote values: a block in both counts twice.
        removed += await self.store.clear_remote(ns)
        return pb.ClearReply(removed=removed)


async def _chain(first: Any, rest: Any) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item


_STARTED = time.monotonic()


def stats_reply(store: TieredStore) -> pb.StatsReply:
    c = store.counters
    tiers = []
    for tier in store.tiers:
        s = tier.stats()
        tiers.append(pb.TierStats(
            name=s.name, blocks=s.blocks, used_bytes=s.used_bytes,
            capacity_bytes=s.capacity_bytes, pinned_blocks=s.pinned_blocks,
            evictions=s.evictions, hits=c.tier_hits.get(s.name, 0),
            bytes_read=c.bytes_read.get(s.name, 0), bytes_written=c.bytes_written.get(s.name, 0)))
    remote, integrity_failures = None, c.integrity_failures
    if store.remote is not None and store.write_queue is not None:
        r, q = store.remote.stats(), store.write_queue.stats()
        integrity_failures += r.integrity_failures
        tiers.append(pb.TierStats(
            name=store.remote.name, hits=c.tier_hits.get(store.remote.name, 0),
            bytes_read=c.bytes_read.get(store.remote.name, 0), bytes_written=r.bytes_written))
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
        remote=remote)
