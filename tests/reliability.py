"""Shared by the fault and security tests: raw gRPC access, quiescence and capacity checks,
and the soak ledger.

Each test states its pass criterion with asserts; this module holds what several of them
check the same way:
- `wait_quiescent`: no lease, pin or RPC left in flight (Stats), within a time bound;
- `CapacityWatch`: a thread sampling Stats (and the disk file) while a test runs; host and disk
  usage must stay within capacity, the remote write-through queue within its bound;
- `soak_record`: the counts a test saw (operations, kills, faults, wrong blocks), printed and,
  under `make soak` (`KV_SOAK_REPORT` set), appended to a JSON-lines report;
- `Worker`: a thread whose exception (a failed assert included) reaches the test, and
  `wait_until`: poll a condition with a deadline instead of sleeping and hoping.
`KV_SOAK_S` (seconds) turns the time-bounded tests into their long versions.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvstore.layout import KVLayout
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.server.process import DaemonProcess

SOAK_S = float(os.environ.get("KV_SOAK_S", "0"))


def soak_seconds(fast: float) -> float:
    """How long a time-bounded test runs: `fast` in `make test`, KV_SOAK_S in a soak."""
    return max(fast, SOAK_S)


def soak_record(test: str, **counts: int | float) -> None:
    """Print a test's counts; under `make soak` also append them to the report file."""
    print(f"SOAK {test}: " + ", ".join(f"{k}={v}" for k, v in counts.items()))
    report = os.environ.get("KV_SOAK_REPORT")
    if report:
        with open(report, "a") as f:
            f.write(json.dumps({"test": test, **counts}) + "\n")


class Worker(threading.Thread):
    """A thread for tests: an exception in its target (an assert included) is kept and raised
    again in the test by `result`; a plain thread would only print it or warn."""

    error: BaseException | None = None

    def run(self) -> None:
        try:
            super().run()
        except BaseException as e:
            self.error = e

    def result(self, timeout: float) -> None:
        """Join; raise what the target raised, or AssertionError if it is still running."""
        self.join(timeout)
        if self.is_alive():
            raise AssertionError(f"thread {self.name} still running after {timeout} s")
        if self.error is not None:
            raise self.error


def wait_until(cond: Callable[[], object], timeout: float, what: str,
               period_s: float = 0.01) -> None:
    """Poll `cond` until it is true; AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(period_s)


def stub(target: str) -> tuple[grpc.Channel, pb_grpc.KVStoreStub]:
    channel = grpc.insecure_channel(target)
    return channel, pb_grpc.KVStoreStub(channel)


def layout_pb(layout: KVLayout) -> pb.Layout:
    return pb.Layout(**layout.to_dict())


def stats(target: str, timeout: float = 5.0) -> pb.StatsReply:
    channel, s = stub(target)
    with channel:
        return s.Stats(pb.StatsRequest(), timeout=timeout)


def arena_path(target: str, timeout: float = 5.0) -> str:
    """The daemon's host arena file (Info). Not found by the daemon's pid: a daemon may have
    taken over its predecessor's, named after that one's pid (`host_handover_s`)."""
    channel, s = stub(target)
    with channel:
        return s.Info(pb.InfoRequest(), timeout=timeout).arena_path


def tier(reply: pb.StatsReply, name: str) -> pb.TierStats:
    return next(t for t in reply.tiers if t.name == name)


def in_flight(reply: pb.StatsReply) -> dict[str, int]:
    """Everything that must return to zero once no call is running."""
    out = {"active_leases": reply.active_leases, "inflight_rpcs": reply.inflight_rpcs}
    for t in reply.tiers:
        if t.capacity_bytes:  # local tiers (the remote entry has no capacity or pins)
            out[f"{t.name}_pinned_blocks"] = t.pinned_blocks
    return out


def wait_quiescent(target: str, within_s: float) -> pb.StatsReply:
    """Poll Stats until no lease, pin or RPC is in flight; fail after `within_s` seconds."""
    deadline = time.monotonic() + within_s
    while True:
        reply = stats(target)
        left = in_flight(reply)
        if not any(left.values()):
            return reply
        if time.monotonic() > deadline:
            raise AssertionError(f"still in flight after {within_s} s: {left}")
        time.sleep(0.05)


def rss_bytes(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM (peak) and RssAnon of a process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM", "RssAnon", "RssShmem"):
            out[name] = int(value.split()[0]) * 1024
    return out


@dataclass
class CapacityWatch:
    """Samples a daemon's usage every `period_s` while a test runs (a context manager).

    Host and disk `used_bytes` must never exceed `capacity_bytes`, the disk data file never
    exceeds the disk capacity (it is sized to it), and the remote write-through queue never
    holds more than its capacity. `check()` raises with the first violation seen.
    """

    daemon: DaemonProcess
    period_s: float = 0.05
    samples: int = 0
    peak: dict[str, int] = field(default_factory=dict)
    capacity: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: Worker | None = None

    def sample(self) -> None:
        try:
            reply = stats(self.daemon.target, timeout=2.0)
        except grpc.RpcError:
            return  # restarting, or shed under overload: the next sample counts
        self.samples += 1
        for t in reply.tiers:
            if not t.capacity_bytes:
                continue
            self.capacity[t.name] = t.capacity_bytes
            self.peak[t.name] = max(self.peak.get(t.name, 0), t.used_bytes)
            if t.used_bytes > t.capacity_bytes:
                self.violations.append(f"{t.name}: {t.used_bytes} B used of "
                                       f"{t.capacity_bytes} B")
        data = self.daemon.data_dir / "disk" / "blocks.dat"
        disk_cap = self.capacity.get("disk")
        if disk_cap is not None and data.exists() and data.stat().st_size > disk_cap:
            self.violations.append(f"disk file {data.stat().st_size} B > {disk_cap} B")
        if reply.HasField("remote") and reply.remote.queue_depth > reply.remote.queue_capacity:
            self.violations.append(f"remote queue {reply.remote.queue_depth} > "
                                   f"{reply.remote.queue_capacity}")

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    def __enter__(self) -> CapacityWatch:
        self._thread = Worker(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            if exc_type is None:  # else the test's own error is the one to see
                self._thread.result(0)

    def check(self) -> None:
        self.sample()
        assert self.samples > 0, "no capacity sample was taken"
        assert not self.violations, f"capacity exceeded: {self.violations[:5]}"
