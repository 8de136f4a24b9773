"""Remote tier: blocks shared by every daemon through Redis/Valkey, standalone or Cluster.

It owns the remote key space (names, TTL), the framing and verification of values, batched
pipelined calls each under a timeout, and the circuit breaker. Which blocks to write or read,
and when, is the store's call (`server/store.py`).

**Keys** are `kvs<format>:<namespace digest, 16 hex>:<block key, 64 hex>`, with no `{...}` hash
tag: a Cluster places each key by the CRC16 of its whole name, so the blocks of a namespace, even
of one prompt's chain, spread over every slot and node, and a long prefix is read from all nodes
in parallel. A hash tag on the namespace would put a whole tenant on one node. The namespace
part lets `clear` find a namespace's keys with SCAN; the frame format version in the prefix lets
daemons of two versions share a Cluster during an upgrade, each seeing the other's values as
misses instead of deleting them as corrupt.

**Values** are framed payloads (`kvstore.integrity`: header + payload) written by one SET, which
is atomic: no reader ever sees half a value, so the two-phase write the local tiers need is the
server's job here, and this class does not implement `tiers.base.Tier` (no local space to
reserve, no local membership to track: other daemons add and the Cluster expires blocks). Every
read is verified against the key and layout it is read under; a value that fails is a miss,
counted and deleted. A value with an intact header naming another layout is a miss but is kept:
the requester's layout is wrong, not the value.

**Writes go through a blocking client on a thread of their own.** redis-py's asyncio client
hands a large value to the event loop's transport, which joins and buffers it and sends it a
socket buffer per loop iteration, on the loop the daemon's other work shares; the blocking
client `sendall`s it with the GIL released. With the writer framing ahead, that halved the
time until a daemon's blocks are readable by others (`python -m benchmarks.write_through`;
docs/PERFORMANCE.md, "Remote tier"). GETs bypass redis-py's parser altogether, on blocking
sockets in worker threads (`tiers.bulk_get`); EXISTS, UNLINK and SCAN stay on the asyncio
client.

**Failures**: every call runs under `timeout_s`. A failed call (connection refused, timeout,
CLUSTERDOWN...) opens the breaker; while it is open calls raise `RemoteSkippedError` at once,
so an outage costs one deadline, not one per call. Per-key errors inside a pipeline are misses
for those keys; those of a node or the network (one Cluster node down) open the breaker as
well, while a command the server refuses (a SET past maxmemory) does not: it is answering.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.cluster
import redis.retry
import redis.utils
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    ClusterDownError,
    NoPermissionError,
    RedisClusterException,
    RedisError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvstore.errors import (
    IntegrityError,
    InvalidArgumentError,
    LayoutMismatchError,
    UnavailableError,
)
from kvstore.integrity import FORMAT_VERSION, HEADER_BYTES, checksum, decode_header, encode_header
from kvstore.integrity import verify as verify_payload
from kvstore.remote_url import RemoteTarget, parse_remote_url, redact_url
from kvstore.tiers.breaker import CircuitBreaker
from kvstore.tiers.bulk_get import BulkGetter, ClusterBulkGetter, Head, ReadCall
from kvstore.worker_wait import wait_out

log = logging.getLogger(__name__)
PREFIX = f"kvs{FORMAT_VERSION}:".encode()
# Verifying a batch this large (xxh3 at ~10-25 GB/s: 0.05-0.1 ms) moves to a worker thread
# (xxh3 releases the GIL), leaving the event loop free for other calls meanwhile.
_VERIFY_IN_THREAD_BYTES = 1 << 20
TRANSFER_FLOOR_BYTES_PER_S = 50 << 20
"""The slowest transfer rate a call's deadline allows for its values, on top of `timeout_s`:
far below loopback or any LAN, so only a stalled server or network misses it."""
_READ_THREADS = 4  # concurrent GET pipelines (fetches of several clients)
_SOCKET_IDLE_S = 5.0  # redis-py's per-read/write watchdog; calls are bounded by `deadline_s`


# Per-command errors worth another attempt later: the node or the network, not the command.
_TRANSIENT = (RedisConnectionError, RedisTimeoutError, ClusterDownError, TryAgainError)
# A failure of a whole call. `RedisClusterException` is not a `RedisError`: a Cluster client
# raises it when no node answers its discovery (every node down, a wrong address).
_CALL_FAILED = (RedisError, RedisClusterException, OSError)


class RemoteUnavailableError(UnavailableError):
    """The remote tier cannot serve now (breaker open, timeout, connection error): a miss."""


class RemoteSkippedError(RemoteUnavailableError):
    """Refused without trying: the breaker is open after a recent failure."""


def redis_key(namespace: bytes, key: bytes) -> bytes:
    return PREFIX + namespace.hex()[:16].encode() + b":" + key.hex().encode()


def namespace_pattern(namespace: bytes | None) -> bytes:
    """SCAN pattern of one namespace's keys, or of every key this store wrote."""
    return PREFIX + (namespace.hex()[:16].encode() + b":*" if namespace is not None else b"*")


# ---- framing: one value = header + payload
def new_frame(length: int) -> bytearray:
    """A value buffer for a `length`-byte payload; fill `payload_view`, then `seal_frame`."""
    return bytearray(HEADER_BYTES + length)


def payload_view(frame: bytearray) -> memoryview:
    return memoryview(frame)[HEADER_BYTES:]


def seal_frame(frame: bytearray, key: bytes, layout_digest: bytes,
               payload_checksum: bytes | None = None) -> bytearray:
    """Write the header; the payload checksum is computed unless the caller verified one."""
    payload = payload_view(frame)
    csum = payload_checksum if payload_checksum is not None else checksum([payload])
    frame[:HEADER_BYTES] = encode_header(key, layout_digest, csum, len(payload))
    return frame


def frame_value(key: bytes, layout_digest: bytes, payload: bytes | memoryview) -> bytearray:
    """The framed value of one payload (one copy of the payload)."""
    frame = new_frame(len(memoryview(payload)))
    payload_view(frame)[:] = payload
    return seal_frame(frame, key, layout_digest)


def read_frame(raw: bytes, key: bytes, layout_digest: bytes) -> memoryview:
    """The verified payload of a value read under `key` and `layout_digest` (a view of `raw`).

    Raises `IntegrityError` for a damaged or misplaced value, `LayoutMismatchError` when the
    intact value was written under another layout.
    """
    payload = memoryview(raw)[HEADER_BYTES:]
    verify_frame(raw, payload, key, layout_digest)
    return payload


def verify_frame(head: bytes | bytearray | memoryview, payload: bytes | memoryview, key: bytes,
                 layout_digest: bytes) -> None:
    """Verify a value read in two parts: its header (`head`) and its payload, wherever that
    landed (`read_frame`'s errors)."""
    header = decode_header(head)
    if header.key != key:
        raise IntegrityError("value belongs to another key")
    if header.layout_digest != layout_digest:
        raise LayoutMismatchError("value was written under another layout")
    verify_payload(header, payload, key, layout_digest)


def _verify_batch(raws: Sequence[Any], keys: Sequence[bytes], layout_digest: bytes,
                  tails: Sequence[memoryview] | None = None,
                  ) -> list[memoryview | Exception | None]:
    """Each value's verified payload (a view of its value, or its tail where the value was
    read into one), else what was wrong with it."""
    out: list[memoryview | Exception | None] = []
    for i, (raw, key) in enumerate(zip(raws, keys, strict=True)):
        if raw is None or isinstance(raw, Exception):
            out.append(raw)
            continue
        try:
            if isinstance(raw, Head) and tails is not None:
                verify_frame(raw, tails[i], key, layout_digest)
                out.append(tails[i])
            else:
                payload = read_frame(raw, key, layout_digest)
                if tails is not None and len(payload) != len(tails[i]):
                    raise LayoutMismatchError(f"value of {len(payload)} bytes, "
                                              f"{len(tails[i])} expected")
                out.append(payload)
        except (IntegrityError, LayoutMismatchError) as e:
            out.append(e)
    return out


@dataclass(frozen=True)
class RemoteOptions:
    """How the daemon uses the remote tier (see `kvstore.config.ServerConfig.remote_*`)."""

    ttl_s: int = 86_400  # 0: values never expire (the Cluster's maxmemory policy evicts)
    timeout_s: float = 0.5
    retry_s: float = 1.0  # breaker window after a failure; doubles up to 8x while it fails
    max_connections: int = 64


@dataclass(frozen=True)
class RemoteWrite:
    namespace: bytes
    key: bytes
    frame: bytearray  # `frame_value` / `seal_frame` output


@dataclass
class PutResult:
    written: int = 0
    transient: list[bytes] = field(default_factory=list)  # failed, may work later: retry
    rejected: list[bytes] = field(default_factory=list)  # refused by the server: give up


@dataclass
class RemoteStats:
    url: str
    available: bool
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_written: int = 0
    failed_writes: int = 0
    errors: int = 0
    timeouts: int = 0
    integrity_failures: int = 0
    deleted: int = 0
    breaker_opens: int = 0
    skipped_calls: int = 0


class RemoteTier:
    """Batched, verified, time-bounded access to the shared Redis/Valkey key space."""

    name = "remote"

    def __init__(self, url: str, options: RemoteOptions | None = None) -> None:
        self.options = options or RemoteOptions()
        if self.options.timeout_s <= 0 or self.options.ttl_s < 0 or self.options.retry_s <= 0:
            raise InvalidArgumentError(f"remote: invalid options {self.options}")
        self.target = parse_remote_url(url)
        self.url = redact_url(url)
        self._client = self._connect(self.target)
        # The blocking client of writes, made in the write thread at its first call (a
        # blocking Cluster client connects in its constructor: a Cluster down at start-up
        # must cost a failed write, not the daemon).
        self._blocking: redis.Redis | redis.cluster.RedisCluster | None = None
        self._writes = ThreadPoolExecutor(1, thread_name_prefix="kvstore-remote-write")
        # GETs read each value straight into its own buffer, in worker threads, rather than
        # through redis-py's parser (`tiers.bulk_get`).
        t, c = self.target, self._common(self.target)
        reader = dict(username=t.username, password=t.password, tls=t.tls,
                      timeout_s=c["socket_timeout"], connect_timeout_s=c["socket_connect_timeout"])
        self._getter: BulkGetter | ClusterBulkGetter = (
            ClusterBulkGetter(t.nodes, **reader) if t.cluster else
            BulkGetter(t.nodes[0][0], t.nodes[0][1], db=t.db, **reader))
        self._reads = ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="kvstore-remote-read")
        if redis.utils.HIREDIS_AVAILABLE:
            log.warning("hiredis is installed: redis-py then packs each value written with two "
                        "more copies, and write-through takes about twice as long "
                        "(docs/OPERATIONS.md, \"Remote tier\"); `pip uninstall hiredis` "
                        "unless something else here needs it")
        self.breaker = CircuitBreaker(f"remote tier {self.url}", self.options.retry_s,
                                      8 * self.options.retry_s, 2 * self.options.timeout_s, log)
        self._stats = RemoteStats(self.url, True)
        self._refused: set[str] = set()  # commands Redis refused to our user (NOPERM), logged
        self._calls: set[ReadCall] = set()  # reads in flight: `close` gives them up

    def _common(self, t: RemoteTarget) -> dict[str, Any]:
        """The connection settings every client of the tier shares (redis-py's names)."""
        return dict(username=t.username, password=t.password, ssl=t.tls,
                    socket_timeout=max(self.options.timeout_s, _SOCKET_IDLE_S),
                    socket_connect_timeout=self.options.timeout_s,
                    max_connections=self.options.max_connections)

    def _connect(self, t: RemoteTarget) -> Redis | RedisCluster:
        common = self._common(t)
        if t.cluster:
            # No client-side retries: the breaker is the retry policy, and redis-py's Cluster
            # retry closes every connection and sleeps before each attempt.
            return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in t.nodes],
                                require_full_coverage=False, retry=Retry(NoBackoff(), 0),
                                **common)
        host, port = t.nodes[0]
        # One immediate retry: a pooled connection the server closed (idle timeout, restart)
        # fails its first command; a fresh connection then works.
        return Redis(host=host, port=port, db=t.db, retry=Retry(NoBackoff(), 1), **common)

    def _connect_blocking(self, t: RemoteTarget) -> redis.Redis | redis.cluster.RedisCluster:
        """The same connection settings as `_connect`, for the blocking client of writes."""
        common = self._common(t)
        if t.cluster:
            return redis.cluster.RedisCluster(
                startup_nodes=[redis.cluster.ClusterNode(h, p)  # type: ignore[no-untyped-call]
                               for h, p in t.nodes],
                require_full_coverage=False, retry=redis.retry.Retry(NoBackoff(), 0), **common)
        host, port = t.nodes[0]
        return redis.Redis(host=host, port=port, db=t.db,
                           retry=redis.retry.Retry(NoBackoff(), 1), **common)

    # ---- the call wrapper: breaker, timeout, error accounting
    def deadline_s(self, nbytes: int) -> float:
        """The deadline of a call moving `nbytes` of values: `timeout_s` for the round trip,
        plus the bytes at TRANSFER_FLOOR_BYTES_PER_S. A flat `timeout_s` would time out
        every write of a block too large to cross in it (a 64 MiB fp32 block of an 8B
        model, from a loaded machine: measured, "timed out" at 0.5 s), open the breaker,
        and leave such blocks never shared."""
        return self.options.timeout_s + nbytes / TRANSFER_FLOOR_BYTES_PER_S

    async def _pipeline(self, commands: Sequence[tuple[Any, ...]],
                        timeout_s: float | None = None, nbytes: int = 0,
                        blocking: bool = False, tails: Sequence[memoryview] | None = None,
                        ) -> list[Any]:
        """Run commands in one pipeline, within `timeout_s` (default: `deadline_s(nbytes)`,
        `nbytes` the value bytes the call moves); per-command errors come back in place
        (those of a node or the network open the breaker); a failure of the whole call
        raises `RemoteUnavailableError`. `blocking`: on the blocking client, in the write
        thread (a call past its deadline is given up here; the thread ends it at its socket
        timeout). GETs go through the bulk getter (`tails`: its `tails`, payloads after a
        header), stopped before this returns or raises (`_read`)."""
        if not commands:
            return []
        if not self.breaker.allow():
            raise RemoteSkippedError(f"remote tier {self.url} skipped: breaker open")
        try:
            async with asyncio.timeout(timeout_s or self.deadline_s(nbytes)):
                results: list[Any]
                if blocking:
                    results = await asyncio.get_running_loop().run_in_executor(
                        self._writes, self._blocking_pipeline, commands)
                elif all(c[0] == "GET" for c in commands):
                    results = await self._read([c[1] for c in commands], tails)
                elif all(c[0] == "GETRANGE" and c[2:] == (0, commands[0][3]) for c in commands):
                    results = await self._read([c[1] for c in commands], None, commands[0][3] + 1)
                else:
                    pipe = self._client.pipeline(transaction=False)
                    for cmd in commands:
                        pipe.execute_command(*cmd)
                    results = await pipe.execute(raise_on_error=False)
        except TimeoutError:
            self._stats.timeouts += 1
            self._failed("timed out")
            raise RemoteUnavailableError(f"remote tier {self.url}: timed out") from None
        except _CALL_FAILED as e:
            self._explain_cluster_refusal(e)
            self._failed(f"{type(e).__name__}: {e}")
            raise RemoteUnavailableError(f"remote tier {self.url}: {e}") from None
        errors = [r for r in results if isinstance(r, Exception)]
        for cmd, r in zip(commands, results, strict=True):
            if isinstance(r, NoPermissionError) and cmd[0] not in self._refused:
                self._refused.add(cmd[0])  # once per command: every call would repeat it
                log.error("remote tier %s: Redis refuses %s to this daemon's user (%s): those "
                          "calls are misses or dropped writes until the user may run it "
                          "(docs/OPERATIONS.md, \"Remote tier\", lists the commands)",
                          self.url, cmd[0], r)
        transient = [r for r in errors if isinstance(r, _TRANSIENT)]
        if transient:  # a node or the network is down: skip the tier for a while
            self._stats.errors += len(errors) - 1
            self._failed(f"{len(errors)} of {len(results)} commands failed: {transient[0]}")
        else:  # the server answered, even if it refused a command (out of memory, say)
            self._stats.errors += len(errors)
            self.breaker.success()
        return results

    async def _read(self, names: Sequence[bytes], tails: Sequence[memoryview] | None,
                    prefix: int = 0) -> list[Any]:
        """Pipelined GETs (`prefix`: GETRANGEs of the first bytes) in a read thread. Given up
        (the deadline, a cancellation), the call is stopped, and waited for if it had begun
        reading: its values may be landing in `tails`, memory the caller frees once this
        raises."""
        call = ReadCall()
        self._calls.add(call)
        try:
            fut = asyncio.get_running_loop().run_in_executor(
                self._reads, self._getter.get, names, tails, HEADER_BYTES, call, prefix)
            try:
                return await asyncio.shield(fut)
            except BaseException:
                if call.abort():  # its sockets are shut down: the thread unwinds at once
                    await wait_out(fut)
                raise
        finally:
            self._calls.discard(call)

    def _blocking_pipeline(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Write thread: one pipeline on the blocking client."""
        if self._blocking is None:
            self._blocking = self._connect_blocking(self.target)
        pipe = self._blocking.pipeline(transaction=False)
        for cmd in commands:
            pipe.execute_command(*cmd)
        return pipe.execute(raise_on_error=False)

    def _explain_cluster_refusal(self, e: BaseException) -> None:
        """redis-py reports any error answer to its `CLUSTER SLOTS` as "Cluster mode is not
        enabled on this node", a NOPERM included: say once what it more likely means where
        the URL names a Cluster."""
        if not self.target.cluster or "Cluster mode is not enabled" not in str(e) \
                or "CLUSTER SLOTS" in self._refused:
            return
        self._refused.add("CLUSTER SLOTS")
        log.error("remote tier %s: a Cluster node answered CLUSTER SLOTS with an error. With "
                  "an ACL user, it needs +cluster|slots and +command besides the data "
                  "commands (docs/OPERATIONS.md, \"Redis ACLs\"); a server that is not a "
                  "Cluster takes a redis:// URL. Remote calls are misses meanwhile", self.url)

    def _failed(self, what: str) -> None:
        self._stats.errors += 1
        self.breaker.failure(what)

    # ---- batched operations
    async def exists(self, namespace: bytes, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether a value is stored (unverified: `get` verifies)."""
        results = await self._pipeline([("EXISTS", redis_key(namespace, k)) for k in keys])
        return [r == 1 for r in results]

    async def get(self, namespace: bytes, keys: Sequence[bytes], layout_digest: bytes,
                  block_bytes: int = 0) -> list[memoryview | None]:
        """Verified payloads per key (views of the values read); None for a miss: absent,
        bad, or on an unreachable node. `block_bytes`: each value's payload size, for the
        call's deadline. Raises `RemoteUnavailableError` when the call fails as a whole."""
        names = [redis_key(namespace, k) for k in keys]
        raws = await self._pipeline([("GET", n) for n in names],
                                    nbytes=block_bytes * len(keys))
        out = await self._verified(names, keys, raws, layout_digest)
        for value in out:
            self._count(value)
        return out

    async def held(self, namespace: bytes, keys: Sequence[bytes], layout_digest: bytes,
                   block_bytes: int) -> list[bool]:
        """Per key, whether a value of `block_bytes` is stored under it for `layout_digest`, by
        its header alone (one pipelined GETRANGE: the payload is neither read nor verified,
        `get_into` does that). For a reader that makes room for the payloads first. Raises
        `RemoteUnavailableError` when the call fails as a whole."""
        raws = await self._pipeline([("GETRANGE", redis_key(namespace, k), 0, HEADER_BYTES - 1)
                                     for k in keys])
        out = []
        for raw, key in zip(raws, keys, strict=True):
            try:
                header = decode_header(raw) if isinstance(raw, bytes | bytearray) else None
            except IntegrityError:
                header = None  # `get_into` would find it bad too, and delete it
            out.append(header is not None and header.key == key
                       and header.layout_digest == layout_digest and header.length == block_bytes)
        return out

    async def get_into(self, namespace: bytes, keys: Sequence[bytes], layout_digest: bytes,
                       payloads: Sequence[memoryview]) -> list[bool]:
        """Read each key's payload straight into `payloads[i]` (host memory: no buffer of its
        own, no copy) and verify it there. True where `payloads[i]` holds the key's verified
        payload; False for a miss (absent, bad, of another size or layout, on an unreachable
        node), `payloads[i]` then holding anything. Raises `RemoteUnavailableError` when the
        call fails as a whole. Once it returns or raises, cancelled included, nothing writes
        into `payloads` any more."""
        names = [redis_key(namespace, k) for k in keys]
        raws = await self._pipeline([("GET", n) for n in names],
                                    nbytes=sum(len(p) for p in payloads), tails=payloads)
        out = await self._verified(names, keys, raws, layout_digest, payloads)
        for value in out:
            self._count(value)
        return [value is not None for value in out]

    def _count(self, value: memoryview | None) -> None:
        if value is None:
            self._stats.misses += 1
        else:
            self._stats.hits += 1
            self._stats.bytes_read += len(value)

    async def _verified(self, names: Sequence[bytes], keys: Sequence[bytes], raws: list[Any],
                        layout_digest: bytes, tails: Sequence[memoryview] | None = None,
                        ) -> list[memoryview | None]:
        """Verify GET results (`_verify_batch`); corrupt values are counted and deleted, and
        are misses."""
        size = sum(len(r) for r in raws if isinstance(r, bytes | bytearray))
        if tails is not None:
            size += sum(len(t) for r, t in zip(raws, tails, strict=True) if isinstance(r, Head))
        if size >= _VERIFY_IN_THREAD_BYTES:
            checked = await asyncio.to_thread(_verify_batch, raws, keys, layout_digest, tails)
        else:
            checked = _verify_batch(raws, keys, layout_digest, tails)
        out: list[memoryview | None] = []
        corrupt: list[bytes] = []
        for name, key, item in zip(names, keys, checked, strict=True):
            out.append(item if isinstance(item, memoryview) else None)
            if isinstance(item, IntegrityError):
                self._stats.integrity_failures += 1
                log.warning("integrity failure in remote tier, block %s: %s; deleting it",
                            key.hex()[:16], item)
                corrupt.append(name)
        if corrupt:
            # Another daemon may rewrite a good value between our GET and this DEL; that
            # costs one later miss, never a wrong block.
            try:
                await self._pipeline([("UNLINK", n) for n in corrupt])
                self._stats.deleted += len(corrupt)
            except RemoteUnavailableError as e:
                log.debug("could not delete corrupt remote values: %s", e)
        return out

    async def put(self, writes: Sequence[RemoteWrite]) -> PutResult:
        """Store framed values (with the TTL). Raises `RemoteUnavailableError` when the call
        failed as a whole; per-key failures are in the result."""
        ttl = self.options.ttl_s
        cmds = [("SET", redis_key(w.namespace, w.key), w.frame, *(("EX", ttl) if ttl else ()))
                for w in writes]
        try:
            results = await self._pipeline(cmds, nbytes=sum(len(w.frame) for w in writes),
                                           blocking=True)
        except RemoteSkippedError:
            raise
        except RemoteUnavailableError:
            self._stats.failed_writes += len(writes)
            raise
        out = PutResult()
        refusal: Exception | None = None
        for w, r in zip(writes, results, strict=True):
            if not isinstance(r, Exception):
                out.written += 1
                self._stats.bytes_written += len(w.frame) - HEADER_BYTES
                continue
            self._stats.failed_writes += 1
            if isinstance(r, _TRANSIENT):
                out.transient.append(w.key)
            else:
                out.rejected.append(w.key)
                refusal = r
        if out.rejected:  # one line per batch: a full Cluster refuses every write
            log.warning("remote tier refused %d of %d blocks: %s", len(out.rejected), len(writes),
                        refusal)
        self._stats.blocks_written += out.written
        return out

    async def delete(self, namespace: bytes, keys: Sequence[bytes]) -> int:
        results = await self._pipeline([("UNLINK", redis_key(namespace, k)) for k in keys])
        removed = sum(r for r in results if isinstance(r, int))
        self._stats.deleted += removed
        return removed

    async def clear(self, namespace: bytes | None) -> int:
        """Delete one namespace's values (every value this store wrote when None).

        An admin call: SCAN visits the whole key space of every node, so it gets a longer
        deadline than the per-call timeout.
        """
        if not self.breaker.allow():
            raise RemoteSkippedError(f"remote tier {self.url} skipped: breaker open")
        removed = 0
        try:
            async with asyncio.timeout(max(5.0, 20 * self.options.timeout_s)):
                batch: list[bytes] = []
                async for name in self._client.scan_iter(match=namespace_pattern(namespace),
                                                         count=1000):
                    batch.append(name)
                    if len(batch) >= 1000:
                        removed += await self._unlink(batch)
                        batch = []
                removed += await self._unlink(batch)
        except TimeoutError:
            self._stats.timeouts += 1
            self._failed("clear timed out")
            raise RemoteUnavailableError(f"remote tier {self.url}: clear timed out") from None
        except _CALL_FAILED as e:
            self._failed(f"{type(e).__name__}: {e}")
            raise RemoteUnavailableError(f"remote tier {self.url}: {e}") from None
        self.breaker.success()
        self._stats.deleted += removed
        return removed

    async def _unlink(self, names: list[bytes]) -> int:
        if not names:
            return 0
        pipe = self._client.pipeline(transaction=False)
        for n in names:
            pipe.execute_command("UNLINK", n)
        return sum(r for r in await pipe.execute(raise_on_error=True) if isinstance(r, int))

    # ---- state
    @property
    def available(self) -> bool:
        """False while the breaker refuses calls (an outage is being waited out)."""
        return not self.breaker.is_open

    def stats(self) -> RemoteStats:
        s = self._stats
        s.available = self.available
        s.breaker_opens = self.breaker.opens
        s.skipped_calls = self.breaker.skipped
        return RemoteStats(**vars(s))

    async def close(self) -> None:
        for call in list(self._calls):  # a read waiting on a stalled node fails now
            call.abort()
        try:
            await self._client.aclose()
        except (RedisError, OSError) as e:  # closing a half-dead connection pool
            log.debug("closing the remote tier client: %s", e)
        # A write past its deadline may still run in the thread: it ends at its socket
        # timeout; closing its client meanwhile makes it end sooner, with an error.
        self._writes.shutdown(wait=False, cancel_futures=True)
        self._reads.shutdown(wait=False, cancel_futures=True)
        self._getter.close()
        try:
            if self._blocking is not None:
                self._blocking.close()
        except (RedisError, OSError) as e:
            log.debug("closing the remote tier's blocking client: %s", e)
