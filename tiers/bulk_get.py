"""Pipelined GETs of large values on blocking sockets, each value read straight into a buffer of
its own.

redis-py's parsers (asyncio and blocking, without hiredis) take a bulk reply through 64 KiB
socket reads gathered in a buffer and then sliced out. On loopback the remote tier reads 1-32
MiB values at 1.1-3x the rate of redis-py's own GETs through this, verification included
(`python -m benchmarks.remote_throughput`, docs/PERFORMANCE.md "Remote tier"). The remote
tier's reads come through here: a standalone server's through `BulkGetter`, a Cluster's
through `ClusterBulkGetter`, one `BulkGetter` per primary, each key sent to its slot's node
as `CLUSTER SLOTS` last said. A MOVED or ASK reply (resharding, a
failover) is a miss for that key, not a redirect followed: the map is read again before the
next call, as after a node that failed.

It speaks only what GET needs of RESP2: a command array out; a bulk string, nil or an error
back. Each worker thread has its own connection (made at its first call: AUTH and SELECT as
the URL says). A connection that failed in any way, or was left mid-pipeline, is closed, and
the next call makes a new one: a pipeline's replies are never read out of step. A kept
connection that fails (the server restarted, or closed it idle) gets the call sent again, once,
on a new one, as redis-py's one immediate retry does.

A caller may name where each value's bytes past its first `head` go (`tails`: the remote tier's
payloads, read straight into the host tier's memory). Such a call is given up through its
`ReadCall`: `abort` shuts its sockets down, so a read the caller no longer waits for stops at
once instead of landing later in memory the caller has freed.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import socket
import ssl
import threading
from collections.abc import Sequence

import redis
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.exceptions import (
    AskError,
    AuthenticationError,
    ClusterDownError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

_CHUNK = 64 << 10  # the line buffer's size; values go straight to their own buffers
PARALLEL_NODES = True  # a Cluster read's nodes at once (`ClusterBulkGetter.get`)
_NODE_THREADS = 8  # for those: the other nodes of the remote tier's concurrent reads


class Head(bytearray):
    """A value's first bytes; the rest went into the tail the caller gave for it."""


class ReadCall:
    """One call's sockets, so that its caller can give it up (`abort`) from another thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self.aborted = False
        self.attached = False  # a socket of the call was attached: values may have been read

    def attach(self, sock: socket.socket) -> None:
        with self._lock:
            if self.aborted:
                raise RedisConnectionError("remote tier: read given up")
            self._socks.add(sock)
            self.attached = True

    def detach(self, sock: socket.socket) -> None:
        """Before the socket is closed (under the lock: `abort` never shuts down a socket
        closed meanwhile, whose descriptor may already name another)."""
        with self._lock:
            self._socks.discard(sock)

    def abort(self) -> bool:
        """Stop the call: its blocked reads fail now, and it attaches no socket again. Returns
        whether it had begun reading (its thread may still be unwinding)."""
        with self._lock:
            self.aborted = True
            for sock in self._socks:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            return self.attached


def command(*args: bytes) -> bytes:
    """One RESP2 command array."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out += [b"$%d\r\n" % len(a), a, b"\r\n"]
    return b"".join(out)


class _Connection:
    """One socket and what was received past the last reply read."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray(_CHUNK)
        self.start = self.end = 0

    def _fill(self) -> None:
        """Receive more after what is buffered (moved down to make room if need be)."""
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end == len(self.buf):
            if self.start == 0:
                raise RedisConnectionError("remote tier: reply line longer than 64 KiB")
            kept = self.end - self.start
            self.buf[:kept] = self.buf[self.start : self.end]
            self.start, self.end = 0, kept
        n = self.sock.recv_into(memoryview(self.buf)[self.end :])
        if n == 0:
            raise RedisConnectionError("remote tier: server closed the connection")
        self.end += n

    def line(self) -> bytes:
        """The next line, without its CRLF."""
        while (i := self.buf.find(b"\r\n", self.start, self.end)) < 0:
            self._fill()
        line = bytes(self.buf[self.start : i])
        self.start = i + 2
        return line

    def read_into(self, dst: memoryview) -> None:
        """Fill `dst` exactly: first with what was received already, then from the socket."""
        have = min(self.end - self.start, len(dst))
        dst[:have] = self.buf[self.start : self.start + have]
        self.start += have
        got = have
        while got < len(dst):
            n = self.sock.recv_into(dst[got:])
            if n == 0:
                raise RedisConnectionError("remote tier: server closed the connection")
            got += n

    def reply(self, tail: memoryview | None = None, head: int = 0,
              ) -> bytearray | RedisError | None:
        """One GET reply: the value, None for nil, or the server's error (in place, as
        redis-py's `raise_on_error=False` gives it, and of the class it gives: NOAUTH or
        LOADING are connection errors, which open the breaker). A value of exactly `head`
        bytes plus `tail`'s length comes back as its `Head`, the rest read into `tail`; any
        other value whole, `tail` untouched."""
        line = self.line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            try:
                n = int(rest)
            except ValueError:
                raise RedisConnectionError(f"remote tier: bad bulk length {line[:40]!r}") from None
            if n < 0:
                return None
            if tail is not None and n == head + len(tail):
                value: bytearray = Head(head)
                self.read_into(memoryview(value))
                self.read_into(tail)
            else:
                value = bytearray(n)
                self.read_into(memoryview(value))
            crlf = bytearray(2)
            self.read_into(memoryview(crlf))
            if crlf != b"\r\n":
                raise RedisConnectionError("remote tier: bulk reply not followed by CRLF")
            return value
        if kind == b"-":
            return _error(rest.decode(errors="replace"))
        raise RedisConnectionError(f"remote tier: unexpected reply {line[:40]!r}")


class BulkGetter:
    """Pipelined GETs on one connection per calling thread (call from worker threads)."""

    def __init__(self, host: str, port: int, *, db: int = 0, username: str | None = None,
                 password: str | None = None, tls: bool = False, timeout_s: float = 5.0,
                 connect_timeout_s: float = 0.5) -> None:
        self.host, self.port, self.db = host, port, db
        self.username, self.password, self.tls = username, password, tls
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self._local = threading.local()
        self._open: set[_Connection] = set()
        self._lock = threading.Lock()
        self._closed = False

    def get(self, names: Sequence[bytes], tails: Sequence[memoryview] | None = None,
            head: int = 0, call: ReadCall | None = None, prefix: int = 0,
            ) -> list[bytearray | RedisError | None]:
        """The values of `names`, in order (None: no such key); with `tails`, a value of `head`
        bytes plus its tail's length comes back as its `Head` (`_Connection.reply`). Raises
        what the connection raised (`OSError`, `redis.exceptions.ConnectionError`), the
        connection closed; `call`: the caller may give the call up meanwhile. `prefix`: only
        each value's first `prefix` bytes (GETRANGE; empty for no such key)."""
        end = b"%d" % (prefix - 1)
        request = b"".join(command(b"GETRANGE", n, b"0", end) if prefix else command(b"GET", n)
                           for n in names)
        parts: Sequence[memoryview | None] = tails if tails is not None else [None] * len(names)
        while True:
            conn, fresh = self._connection()
            if call is not None:
                call.attach(conn.sock)  # raises if given up: the connection is kept as it is
            try:
                try:
                    conn.sock.sendall(request)
                    return [conn.reply(tail, head) for tail in parts]
                finally:
                    if call is not None:
                        call.detach(conn.sock)
            except (OSError, RedisConnectionError) as e:
                self._drop(conn)  # mid-pipeline: its next replies would be read out of step
                # A kept connection the server dropped meanwhile (a restart, an idle
                # timeout) fails its first use: GETs are safe to send again, once, on a new
                # one. Not after a timeout (that would double the wait) or a call given up.
                if fresh or isinstance(e, TimeoutError) or (call is not None and call.aborted):
                    raise
            except BaseException:
                self._drop(conn)
                raise

    def close(self) -> None:
        """Close every connection (calls in flight on them fail)."""
        with self._lock:
            self._closed = True
            conns, self._open = self._open, set()
        for c in conns:
            _close(c.sock)

    def _connection(self) -> tuple[_Connection, bool]:
        """This thread's connection, and whether it was made just now."""
        if self._closed:
            raise RedisConnectionError("remote tier: closed")
        conn: _Connection | None = getattr(self._local, "conn", None)
        if conn is not None:
            return conn, False
        sock = socket.create_connection((self.host, self.port), self.connect_timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls:
                sock = ssl.create_default_context().wrap_socket(sock,
                                                                 server_hostname=self.host)
            sock.settimeout(self.timeout_s)
            conn = _Connection(sock)
            self._hello(conn)
        except BaseException:
            _close(sock)
            raise
        with self._lock:
            if self._closed:
                _close(sock)
                raise RedisConnectionError("remote tier: closed")
            self._open.add(conn)
        self._local.conn = conn
        return conn, True

    def _hello(self, conn: _Connection) -> None:
        """AUTH and SELECT, as the URL asks."""
        setup: list[tuple[bytes, ...]] = []
        if self.password is not None:
            setup.append((b"AUTH", *([self.username.encode()] if self.username else []),
                          self.password.encode()))
        if self.db:
            setup.append((b"SELECT", str(self.db).encode()))
        if not setup:
            return
        conn.sock.sendall(b"".join(command(*c) for c in setup))
        for c in setup:
            line = conn.line()
            if line != b"+OK":
                what = line[1:].decode(errors="replace")
                if c[0] == b"AUTH":
                    raise AuthenticationError(f"remote tier: AUTH refused: {what}")
                raise RedisConnectionError(f"remote tier: {c[0].decode()} refused: {what}")

    def _drop(self, conn: _Connection) -> None:
        with self._lock:
            self._open.discard(conn)
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None
        _close(conn.sock)


class ClusterBulkGetter:
    """`BulkGetter`'s pipelined GETs over a Cluster: keys grouped by their slot's primary, one
    pipeline per node, the replies put back in order (call from worker threads)."""

    def __init__(self, nodes: Sequence[tuple[str, int]], *, username: str | None = None,
                 password: str | None = None, tls: bool = False, timeout_s: float = 5.0,
                 connect_timeout_s: float = 0.5) -> None:
        self._seeds = list(nodes)
        self.username, self.password, self.tls = username, password, tls
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self._getters: dict[tuple[str, int], BulkGetter] = {}
        self._slots: list[tuple[str, int] | None] | None = None  # slot -> primary
        self._lock = threading.Lock()
        self._closed = False
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def get(self, names: Sequence[bytes], tails: Sequence[memoryview] | None = None,
            head: int = 0, call: ReadCall | None = None, prefix: int = 0,
            ) -> list[bytearray | RedisError | None]:
        """The values of `names`, in order (the rest: as `BulkGetter.get`). Each node's keys
        in one pipeline, the nodes' pipelines at once (`PARALLEL_NODES`): a read spread over
        the Cluster takes its slowest node's time, not the sum. It returns only once every
        node's read has ended (given up through `call` included): nothing lands in `tails`
        after. A node that cannot be reached gives a connection error in place of each of
        its keys (the remote tier's breaker then opens)."""
        slots = self._slots if self._slots is not None else self._refresh()
        groups: dict[tuple[str, int] | None, list[int]] = {}
        for i, name in enumerate(names):
            groups.setdefault(slots[key_slot(name)], []).append(i)

        def read(node: tuple[str, int] | None, indexes: list[int],
                 ) -> tuple[list[bytearray | RedisError | None], bool]:
            """One node's values, and whether its slots may have moved."""
            if node is None:
                return [ClusterDownError("remote tier: slot not served")] * len(indexes), True
            try:
                return self._getter(node).get(
                    [names[i] for i in indexes],
                    None if tails is None else [tails[i] for i in indexes], head, call,
                    prefix), False
            except (OSError, RedisConnectionError) as e:  # the node failed: slots may move
                return [RedisConnectionError(f"remote tier: node {node}: {e}")] * len(
                    indexes), True

        work = list(groups.items())
        others: list[concurrent.futures.Future[tuple[list[bytearray | RedisError | None],
                                                      bool]]] = []
        try:
            if PARALLEL_NODES and len(work) > 1:
                pool = self._node_pool()
                for w in work[1:]:
                    try:
                        others.append(pool.submit(read, *w))
                    except RuntimeError as e:  # the pool shut down: closed meanwhile
                        raise RedisConnectionError("remote tier: closed") from e
            results = [read(*work[0])] if others else [read(*w) for w in work]
        finally:
            concurrent.futures.wait(others)  # never return while a node's read still lands
        if others:  # one per node after the first (a failed submission raised above)
            closed: list[bytearray | RedisError | None] = [  # `close` cancelled it
                RedisConnectionError("remote tier: closed")]
            results += [((closed * len(w[1]), True) if f.cancelled() else f.result())
                        for w, f in zip(work[1:], others, strict=True)]
        out: list[bytearray | RedisError | None] = [None] * len(names)
        stale = False
        for (_, indexes), (values, moved) in zip(work, results, strict=True):
            stale = stale or moved
            for i, v in zip(indexes, values, strict=True):
                out[i] = v
                stale = stale or isinstance(v, AskError | ClusterDownError | TryAgainError)
        if stale:
            self._slots = None  # MovedError is an AskError: read the map again next call
        return out

    def _node_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise RedisConnectionError("remote tier: closed")
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    _NODE_THREADS, thread_name_prefix="kvstore-remote-node")
            return self._pool

    def close(self) -> None:
        with self._lock:
            self._closed = True
            getters, self._getters = list(self._getters.values()), {}
            pool, self._pool = self._pool, None
        for g in getters:  # reads in flight on their sockets fail now
            g.close()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _getter(self, node: tuple[str, int]) -> BulkGetter:
        with self._lock:
            if self._closed:
                raise RedisConnectionError("remote tier: closed")
            g = self._getters.get(node)
            if g is None:
                g = self._getters[node] = BulkGetter(
                    node[0], node[1], username=self.username, password=self.password,
                    tls=self.tls, timeout_s=self.timeout_s,
                    connect_timeout_s=self.connect_timeout_s)
            return g

    def _refresh(self) -> list[tuple[str, int] | None]:
        """Read the slot map (`CLUSTER SLOTS`) from the first node that answers: the known
        primaries, then the URL's nodes."""
        with self._lock:
            known = list(self._getters)
        failures = []
        for host, port in dict.fromkeys([*known, *self._seeds]):
            client = redis.Redis(host=host, port=port, username=self.username,
                                 password=self.password, ssl=self.tls,
                                 socket_timeout=self.timeout_s,
                                 socket_connect_timeout=self.connect_timeout_s)
            try:
                rows = client.execute_command("CLUSTER", "SLOTS")  # type: ignore[no-untyped-call]
            except (RedisError, OSError) as e:
                failures.append(f"{host}:{port}: {e}")
                continue
            finally:
                client.close()
            table: list[tuple[str, int] | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
            for start, end, primary, *_ in rows:
                node_host = primary[0].decode() if primary[0] else host  # "": the one asked
                table[int(start) : int(end) + 1] = [(node_host, int(primary[1]))] * (
                    int(end) - int(start) + 1)
            self._slots = table
            return table
        raise RedisConnectionError("remote tier: no Cluster node answered CLUSTER SLOTS: "
                                   + "; ".join(failures))


def _error(message: str) -> RedisError:
    """The exception redis-py makes of an error reply (its class by the reply's prefix)."""
    try:
        from redis._parsers.base import BaseParser  # redis-py's own mapping; private

        error = BaseParser.parse_error(message)  # type: ignore[no-untyped-call]
    except ImportError:
        return ResponseError(message)
    return error if isinstance(error, RedisError) else ResponseError(message)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()
