"""The KV events' ZMQ sockets, in a process of their own (`kvstore.server.kv_events`).

ZMQ accepts every connection to a bound socket and gives each a file descriptor; it has no cap
of its own. In the daemon's process a flood of connections to the events endpoints (no token is
needed to open one) would take the descriptors its Unix socket, TCP listener and disk tier need.
Here they take this process's, held to `max_files`, and the daemon is untouched: while a flood
lasts only new subscribers are kept out, as on the TCP listener. Near its limit this process
stops listening (`Listening`) and listens again once connections close: libzmq retries a
failed accept (EMFILE) at once, forever, which spun a core. Connections that never finish
ZMQ's handshake are closed after `HANDSHAKE_MS`.

Protocol on the pipe from the daemon: each message is one encoded `KVEventBatch`; b"" asks this
process to exit. It answers once, at start: ("ok", endpoint, replay_endpoint) or ("error", why).
It exits when the pipe closes too (the daemon died), so it never outlives the daemon.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import resource
import signal
import time
from collections import deque
from itertools import count
from multiprocessing.connection import Connection
from multiprocessing.sharedctypes import Synchronized

import zmq

from kvstore.server.logsetup import setup_logging

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's replay end-of-sequence marker
HANDSHAKE_MS = 10_000  # ZMQ's default is 30 s
SPARE_FILES = 32  # below the limit: stop listening here, listen again at twice this below
CHECK_S = 0.2  # how often the descriptors in use are counted


class Listening:
    """Binds the sockets while this process has descriptors to spare, unbinds them near its
    limit (existing connections stay), binds them again when connections close."""

    def __init__(self, sockets: list[tuple[zmq.Socket[bytes], str]], limit: int) -> None:
        self.sockets, self.limit, self.on = sockets, limit, True
        self._warned = -math.inf  # when the last warning was logged (one a minute at most)

    def check(self) -> None:
        try:
            used = len(os.listdir("/proc/self/fd"))
        except OSError:  # EMFILE: listing them takes a descriptor too
            used = self.limit
        if self.on and used >= self.limit - SPARE_FILES:
            for sock, endpoint in self.sockets:
                sock.unbind(endpoint)
            self.on = False
            if time.monotonic() - self._warned > 60:
                self._warned = time.monotonic()
                log.warning("kv events: %d of %d open files in use by connections; not "
                            "accepting more until some close", used, self.limit)
        elif not self.on and used < self.limit - 2 * SPARE_FILES:
            try:
                for sock, endpoint in self.sockets:
                    sock.bind(endpoint)
            except zmq.ZMQError as e:  # the port taken meanwhile: try again later
                log.warning("kv events: cannot listen again on %s: %s", endpoint, e)
                for sock, endpoint in self.sockets:
                    with contextlib.suppress(zmq.ZMQError):
                        sock.unbind(endpoint)
                return
            self.on = True


def serve(conn: Connection, endpoint: str, replay_endpoint: str, topic: str,
          buffer_steps: int, hwm: int, max_files: int, sent: Synchronized[int],
          lost: Synchronized[int], log_level: str = "info", log_format: str = "text") -> None:
    """Bind PUB (and ROUTER for replays), then publish what the pipe brings until told to
    stop or the pipe closes. `sent` counts the batches given a sequence number, `lost` those
    of them PUB dropped (past `hwm`); a replay serves both."""
    # The daemon's drain (SIGTERM) and a terminal's ^C go to the daemon, which closes the
    # pipe when it is done; this process must not stop before the last batches are out.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup_logging(log_level, log_format)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > max_files:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max_files, max_files))
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.set_hwm(hwm)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
    replay: zmq.Socket[bytes] | None = None
    try:
        pub.bind(endpoint)
        if replay_endpoint:
            replay = ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
            replay.bind(replay_endpoint)
    except zmq.ZMQError as e:
        conn.send(("error", str(e)))
        _close(ctx, pub, replay)
        return
    bound = [(pub, pub.getsockopt_string(zmq.LAST_ENDPOINT))]  # port 0: the real one
    if replay is not None:
        bound.append((replay, replay.getsockopt_string(zmq.LAST_ENDPOINT)))
    conn.send(("ok", bound[0][1], bound[1][1] if replay is not None else ""))
    listening = Listening(bound, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    try:
        _publish(conn, pub, replay, topic.encode(), buffer_steps, sent, lost, listening)
    finally:
        _close(ctx, pub, replay)


def _publish(conn: Connection, pub: zmq.Socket[bytes], replay: zmq.Socket[bytes] | None,
             topic: bytes, buffer_steps: int, sent: Synchronized[int],
             lost: Synchronized[int], listening: Listening) -> None:
    buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
    seqs = count()
    poller = zmq.Poller()
    poller.register(conn.fileno(), zmq.POLLIN)
    if replay is not None:
        poller.register(replay, zmq.POLLIN)
    while True:
        ready = dict(poller.poll(int(CHECK_S * 1000)))
        listening.check()
        if replay is not None and replay in ready:
            try:
                _serve_replay(replay, topic, buffer)
            except zmq.ZMQError as e:  # a bad request must not stop publishing
                log.warning("kv events replay: %s", e)
        if conn.fileno() not in ready:
            continue
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):  # the daemon is gone
            return
        if not payload:
            return
        seq = next(seqs)
        try:
            # NOBLOCK: past the high-water mark PUB drops anyway; never wait on a reader.
            pub.send_multipart((topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # zmq.Again (past the high-water mark) or a failed send
            lost.value += 1
        buffer.append((seq, payload))  # a replay still has it
        sent.value += 1


def _serve_replay(replay: zmq.Socket[bytes], topic: bytes,
                  buffer: deque[tuple[int, bytes]]) -> None:
    frame = replay.recv_multipart()
    if len(frame) != 3:
        log.warning("kv events: invalid replay request (%d frames)", len(frame))
        return
    client, _, start = frame
    first = int.from_bytes(start, "big")
    for seq, payload in list(buffer):
        if seq >= first:
            replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
    replay.send_multipart((client, b"", b"", END_SEQ, b""))


def _close(ctx: zmq.Context[zmq.Socket[bytes]], pub: zmq.Socket[bytes],
           replay: zmq.Socket[bytes] | None) -> None:
    pub.close(linger=0)
    if replay is not None:
        replay.close(linger=0)
    ctx.term()
