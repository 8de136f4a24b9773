"""The KV events' ZMQ sockets, in a process of their own (`kvstore.server.kv_events`).

ZMQ accepts every connection to a bound socket and gives each a file descriptor; it has no cap
of its own. In the daemon's process a flood of connections to the events endpoints (no token is
needed to open one) took the descriptors its Unix socket, TCP listener and disk tier need. Here
they take this process's, held to `max_files` (which bounds its memory too), and the daemon is
untouched. Connections that never finish ZMQ's handshake are closed after `HANDSHAKE_MS`.

At its limit libzmq retries the failed accept (EMFILE) at once, over and over, until a
connection closes: it would spin a core. So this process runs at the lowest CPU priority
(nice 19), where a spin takes only what the daemon and the engines leave idle, and the kernel's
OOM killer picks it first. While a flood lasts new subscribers are kept out; existing ones keep
their connections.

Protocol on the pipe from the daemon: each message is one encoded `KVEventBatch`; b"" asks this
process to exit. It answers once, at start: ("ok", endpoint, replay_endpoint) or ("error", why).
It exits when the pipe closes too (the daemon died), so it never outlives the daemon.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import signal
from collections import deque
from itertools import count
from multiprocessing.connection import Connection
from multiprocessing.sharedctypes import Synchronized

import zmq

from kvstore.server.logsetup import setup_logging

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's replay end-of-sequence marker
HANDSHAKE_MS = 10_000  # ZMQ's default is 30 s
LINGER_MS = 500  # at exit, for the last batches to reach subscribers that read


def serve(conn: Connection, endpoint: str, replay_endpoint: str, topic: str,
          buffer_steps: int, hwm: int, max_files: int, sent: Synchronized[int],
          failed: Synchronized[int], log_level: str = "info", log_format: str = "text",
          ) -> None:
    """Bind PUB (and ROUTER for replays), then publish what the pipe brings until told to
    stop or the pipe closes. `sent` counts the batches given a sequence number (handed to
    PUB, which drops silently past `hwm`, as vLLM's; a replay still serves them), `failed`
    those whose send raised."""
    # ^C in a terminal reaches the whole process group: the daemon closes the pipe when it is
    # done, and this process must not leave before its last batches. (SIGTERM stays: it is how
    # multiprocessing ends a daemonic child when the daemon's interpreter exits.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup_logging(log_level, log_format)
    _yield_to_the_daemon()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > max_files:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max_files, max_files))
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.set_hwm(hwm)
    pub.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
    replay: zmq.Socket[bytes] | None = None
    try:
        pub.bind(endpoint)
        if replay_endpoint:
            replay = ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
            replay.bind(replay_endpoint)
    except zmq.ZMQError as e:
        conn.send(("error", str(e)))
        _close(ctx, pub, replay, linger_ms=0)
        return
    conn.send(("ok", pub.getsockopt_string(zmq.LAST_ENDPOINT),  # port 0: the real one
               replay.getsockopt_string(zmq.LAST_ENDPOINT) if replay is not None else ""))
    try:
        _publish(conn, pub, replay, topic.encode(), buffer_steps, sent, failed)
    finally:
        _close(ctx, pub, replay, linger_ms=LINGER_MS)


def _yield_to_the_daemon() -> None:
    """Lowest CPU priority, first in line for the OOM killer (raising either needs no
    privilege): a flood at this process's limit must cost the daemon and the engines
    nothing."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, 19)
    with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")


def _publish(conn: Connection, pub: zmq.Socket[bytes], replay: zmq.Socket[bytes] | None,
             topic: bytes, buffer_steps: int, sent: Synchronized[int],
             failed: Synchronized[int]) -> None:
    buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
    seqs = count()
    poller = zmq.Poller()
    poller.register(conn.fileno(), zmq.POLLIN)
    if replay is not None:
        poller.register(replay, zmq.POLLIN)
    while True:
        ready = dict(poller.poll())
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
        buffer.append((seq, payload))  # a replay has it, sent or not
        sent.value += 1  # before the send: a subscriber never sees more than this counts
        try:
            # NOBLOCK: past the high-water mark PUB drops anyway; never wait on a reader.
            pub.send_multipart((topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            failed.value += 1
            log.warning("kv events: send failed: %s", e)


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
           replay: zmq.Socket[bytes] | None, linger_ms: int) -> None:
    pub.close(linger=linger_ms)
    if replay is not None:
        replay.close(linger=0)
    ctx.term()
