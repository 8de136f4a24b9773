"""Graceful drain (item 16): SIGTERM turns health NOT_SERVING, calls in flight finish within the
grace period (or are cut at its end, their pins released), shared memory is unlinked, and the
process exits 0.

The in-flight calls are made long with the test-only stalled-disk knob: a fetch of blocks on
disk takes `STALL_S` per read.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.client import KVClient
from kvstore.proto import kvstore_pb2 as pb
from tests.conftest import random_kv, small_layout
from tests.reliability import (
    Worker,
    arena_path,
    layout_pb,
    soak_record,
    stats,
    stub,
    wait_until,
)

pytestmark = [pytest.mark.fault, pytest.mark.integration]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _watch_health(target: str, seen: list[tuple[float, int]], ready: threading.Event) -> None:
    """Record every status the Watch stream reports; stop at NOT_SERVING (an open stream
    would hold the drain to its full grace period)."""
    with grpc.insecure_channel(target) as channel:
        call = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service="kvstore.v1.KVStore"), timeout=30)
        try:
            for reply in call:
                seen.append((time.monotonic(), reply.status))
                ready.set()
                if reply.status == NOT_SERVING:
                    call.cancel()
                    return
        except grpc.RpcError:
            return


def _arena_files(arena: str) -> list[str]:
    return [p for p in os.listdir("/dev/shm") if p.startswith(os.path.basename(arena))]


@pytest.mark.parametrize(("stall_s", "grace_s"), [(0.4, 3.0), (1.5, 0.5)],
                         ids=["finishes-within-grace", "cut-at-grace"])
def test_sigterm_drains_then_exits_clean(daemon_factory, stall_s, grace_s):
    d = daemon_factory("--host-bytes", "64KiB", "--disk-bytes", "1MiB",
                       "--drain-grace-s", str(grace_s), "--shutdown-flush-s", "2",
                       "--fault-disk-read-delay-s", str(stall_s)).start()
    layout = small_layout()
    tokens = list(range(64))
    kv = random_kv(layout, 64)
    with KVClient(d.target, layout, deadline_s=5) as c:
        assert c.publish(tokens, kv) == 64
        assert c.publish(list(range(9000, 9128)), random_kv(layout, 128, seed=1)) == 128
        keys, ns = c.keys(tokens), c.namespace.digest()
    arena = arena_path(d.target)
    assert _arena_files(arena)
    seen: list[tuple[float, int]] = []
    ready = threading.Event()
    watcher = Worker(target=_watch_health, args=(d.target, seen, ready))
    watcher.start()
    assert ready.wait(5) and seen[0][1] == SERVING

    result: dict[str, object] = {}

    def in_flight() -> None:  # 4 blocks on disk, read concurrently: one stall long
        channel, s = stub(d.target)
        with channel:
            try:
                chunks = list(s.Fetch(pb.FetchRequest(
                    namespace=ns, layout=layout_pb(layout), keys=keys,
                    transfer=pb.TRANSFER_STREAM), timeout=10))
                result["hits"] = chunks[0].hits
                result["data"] = b"".join(ch.data for ch in chunks[1:])
            except grpc.RpcError as e:
                result["code"] = e.code()
        result["t"] = time.monotonic()

    caller = Worker(target=in_flight)
    caller.start()
    # Its lease is the first thing the fetch makes; its stalled reads start right after.
    wait_until(lambda: stats(d.target).active_leases > 0, 5, "the fetch reached the store")
    t_term = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    code = d.proc.wait(grace_s + stall_s + 10)
    t_exit = time.monotonic()
    caller.result(10)
    watcher.result(10)

    assert code == 0
    assert any(s == NOT_SERVING and t >= t_term for t, s in seen), seen
    # Removed, or left for the next daemon (`host_handover_s`) with its marker: never a
    # live-looking arena nobody holds.
    left = _arena_files(arena)
    arenas = [p for p in left if p.endswith(".arena")]
    assert left == [] or sorted(left) == sorted([*arenas, *(f"{a}.handover" for a in arenas)]), \
        left
    assert not os.path.exists(d.socket)
    if stall_s < grace_s:  # finished within the grace period, and correctly
        assert result.get("hits") == 4, result.get("code")
        # The stream sends the blocks in order, each one `[L, kv, T, H, D]`.
        blocks = [kv[:, :, i * 16 : (i + 1) * 16].contiguous() for i in range(4)]
        assert result["data"] == b"".join(b.numpy().tobytes() for b in blocks)
        assert result["t"] - t_term < grace_s
    else:  # cut at the end of the grace period: the caller hears it, the daemon still exits 0
        assert result.get("code") in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
        assert result["t"] - t_term < grace_s + 0.5
    drain_s = t_exit - t_term
    assert drain_s < grace_s + stall_s + 2 + 1  # grace, the stalled read, the flush budget
    soak_record(f"drain[{'within' if stall_s < grace_s else 'cut'}]", operations=1, faults=1,
                wrong=0, drain_ms=round(drain_s * 1000))
