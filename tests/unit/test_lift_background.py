"""The promotion into the gpu level (the lift) runs after its fetch answered, under its own pins,
and copies only once the fetch's leases ended (its client copies the same bytes until then).

A real `TieredStore` (gpu on cpu over host over disk, as `test_store.py` builds it). The lift's
block copies (`GpuTier.write_from`, in a worker) are held at a gate, so each test acts while a
lift is in flight: the client ends its lease and another publish wants the space, a second
fetch asks for a lift, the store shuts down, the copy fails.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvstore.server.store import TieredStore
from kvstore.tiers.base import PAGE, BlockEntry
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.gpu import GpuTier
from kvstore.tiers.host import HostTier
from tests.unit.test_store import LAYOUT, fetched_bytes, key, payload, publish


def make_store(tmp_path: Path, gpu_blocks: int = 4, host_blocks: int = 8) -> TieredStore:
    host = HostTier(host_blocks * 2 * PAGE, shm_dir=tmp_path)
    disk = DiskTier(tmp_path / "disk", 16 * 3 * PAGE, sync="never")
    return TieredStore(host, disk, lease_timeout_s=0.5, io_threads=2,
                       gpu=GpuTier(gpu_blocks * 2 * PAGE, "cpu"))


class Gate:
    """Holds every lift copy in its worker until `open` is set; `fail` makes the copy raise."""

    def __init__(self, gpu: GpuTier, fail: bool = False) -> None:
        self.entered = threading.Event()
        self.open = threading.Event()
        copy = gpu.write_from

        def write_from(entry: BlockEntry, src: memoryview) -> None:
            self.entered.set()
            if not self.open.wait(5):
                raise TimeoutError("the test never opened the gate")
            if fail:
                raise RuntimeError("injected copy failure")
            copy(entry, src)

        gpu.write_from = write_from  # type: ignore[method-assign]

    async def reached(self) -> None:
        """Wait until a lift copy is in flight (its worker waits at the gate)."""
        for _ in range(5000):
            if self.entered.is_set():
                return
            await asyncio.sleep(0.001)
        raise AssertionError("no lift copy started")


def gpu_of(store: TieredStore) -> GpuTier:
    assert store.gpu is not None
    return store.gpu


def gpu_bytes(store: TieredStore, keys: Sequence[bytes]) -> list[bytes]:
    gpu = gpu_of(store)
    out = []
    for k in keys:
        entry = gpu.get(k)
        assert entry is not None, f"block {k.hex()[:8]} not in gpu"
        out.append(gpu.view(entry).numpy().tobytes())
    return out


def pins(store: TieredStore) -> tuple[int, int]:
    return store.host.stats().pinned_blocks, gpu_of(store).stats().pinned_blocks


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("ending", ["release", "reap"])
def test_lease_ended_during_the_lift_frees_nothing_it_reads(
        tmp_path: Path, ending: str, caplog: pytest.LogCaptureFixture) -> None:
    """The client's lease ends (released, or reaped), which lets the lift copy; while it
    copies, another publish wants the whole host tier. The lift's own pins keep its source
    blocks in place, so gpu gets their bytes (not the publish's), and every pin ends."""
    store = make_store(tmp_path, host_blocks=4)
    now = [1000.0]
    store.clock = lambda: now[0]
    p, q = [key(0), key(1)], [key(i) for i in range(10, 14)]

    async def main() -> None:
        await publish(store, p)
        gate = Gate(gpu_of(store))
        lease = await store.fetch(p, LAYOUT)
        assert fetched_bytes(store, lease) == [payload(k) for k in p]
        if ending == "release":
            assert store.release(lease.id)
        else:
            now[0] += 1.0
            assert store.reap_expired() == 1
        await gate.reached()  # the lift copies p[0]: the reply did not wait for it
        assert not store.leases
        # Host holds 4 blocks: without the lift's pins p would be demoted and q written over it.
        q_lease = await publish(store, q)
        assert len(q_lease.entries) == 2 and q_lease.more
        assert all(store.host.contains(k) for k in p)
        gate.open.set()
        await store.lifts_idle()
        assert gpu_bytes(store, p) == [payload(k) for k in p]
        assert store.counters.promotions == 2 and pins(store) == (0, 0)
        # Nothing is held back: the whole of host and gpu can be taken again.
        assert store.clear(None) == 4  # p (in host and gpu) and q's two
        assert store.host.stats().used_bytes == 0 and gpu_of(store).stats().used_bytes == 0
        assert len((await publish(store, q)).entries) == 4

    try:
        asyncio.run(main())
    finally:
        store.close()
    assert errors(caplog) == []


def test_another_prompts_fetch_during_a_lift_is_skipped_and_counted(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    p, r = [key(0), key(1)], [key(10), key(11)]

    async def main() -> None:
        await publish(store, p + r)
        gate = Gate(gpu_of(store))
        store.release((await store.fetch(p, LAYOUT)).id)
        await gate.reached()
        lease_r = await store.fetch(r, LAYOUT)  # one lift at a time: r's is skipped
        assert fetched_bytes(store, lease_r) == [payload(k) for k in r]
        assert store.counters.lifts_skipped == 1
        store.release(lease_r.id)
        gate.open.set()
        await store.lifts_idle()
        gpu = gpu_of(store)
        assert [gpu.contains(k) for k in p + r] == [True, True, False, False]
        assert store.counters.promotions == 2 and pins(store) == (0, 0)
        # Fetched again with no lift running, r is lifted; p, in gpu already, asks for none.
        store.release((await store.fetch(r, LAYOUT)).id)
        store.release((await store.fetch(p, LAYOUT)).id)
        await store.lifts_idle()
        assert gpu_bytes(store, p + r) == [payload(k) for k in p + r]
        assert store.counters.promotions == 4 and store.counters.lifts_skipped == 1
        assert pins(store) == (0, 0)

    try:
        asyncio.run(main())
    finally:
        store.close()


def test_the_prompts_next_window_joins_the_running_lift(tmp_path: Path) -> None:
    """A prompt fetched in windows (each call names the keys before it, `prior`): the client
    asks for the next window before it copies (and releases) the first, its blocks join the
    first window's lift, which copies once both leases ended; the whole prompt is lifted,
    ranked root first (the root is gpu's last victim)."""
    store = make_store(tmp_path)
    p = [key(i) for i in range(4)]

    async def main() -> None:
        await publish(store, p)
        gate = Gate(gpu_of(store))
        first = await store.fetch(p[:2], LAYOUT)
        second = await store.fetch(p[2:], LAYOUT, prior=p[:2])
        store.release(first.id)
        await asyncio.sleep(0.05)
        assert not gate.entered.is_set()  # the second window's client still copies
        store.release(second.id)
        await gate.reached()
        gate.open.set()
        await store.lifts_idle()
        assert gpu_bytes(store, p) == [payload(k) for k in p]
        assert store.counters.promotions == 4 and store.counters.lifts_skipped == 0
        assert pins(store) == (0, 0)
        assert list(gpu_of(store).policy.eviction_order()) == p[::-1]  # leaf first

    try:
        asyncio.run(main())
    finally:
        store.close()


@pytest.mark.parametrize("ending", ["release", "reap"])
def test_the_lift_waits_for_its_client_to_finish_copying(tmp_path: Path, ending: str) -> None:
    """No lift copy while the fetch's lease is held (the client copies the same blocks out on
    the same cores); the lease's end, by the client or by the reaper, starts it."""
    store = make_store(tmp_path)
    now = [1000.0]
    store.clock = lambda: now[0]
    p = [key(0), key(1)]

    async def main() -> None:
        await publish(store, p)
        gate = Gate(gpu_of(store))
        gate.open.set()
        lease = await store.fetch(p, LAYOUT)
        await asyncio.sleep(0.1)
        assert not gate.entered.is_set() and store.counters.promotions == 0
        assert store._lifting is not None  # planned and pinned, waiting
        if ending == "release":
            store.release(lease.id)
        else:
            now[0] += 1.0
            assert store.reap_expired() == 1
        await store.lifts_idle()
        assert gpu_bytes(store, p) == [payload(k) for k in p]
        assert store.counters.promotions == 2 and pins(store) == (0, 0)

    try:
        asyncio.run(main())
    finally:
        store.close()


def test_shutdown_flush_cancels_the_running_lift(tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """The daemon's drain: leases released, then `flush`, which first cancels the lift. The
    copy in flight ends before the lift unwinds; its gpu block is given back, as are its pins."""
    store = make_store(tmp_path)
    p = [key(0), key(1)]

    async def main() -> None:
        await publish(store, p)
        gate = Gate(gpu_of(store))
        store.release((await store.fetch(p, LAYOUT)).id)
        await gate.reached()
        flushing = asyncio.ensure_future(store.flush(10.0))
        await asyncio.sleep(0.05)
        assert not flushing.done()  # it waits for the copy in flight
        gate.open.set()
        assert await flushing == 2  # host's blocks, written to disk
        assert store._lifting is None and pins(store) == (0, 0)
        assert not gpu_of(store).entries and store.counters.promotions == 0

    try:
        asyncio.run(main())
    finally:
        store.close()
    assert errors(caplog) == []


def test_close_during_a_lift_leaks_no_pin(tmp_path: Path,
                                          caplog: pytest.LogCaptureFixture) -> None:
    """`close` (synchronous) in the loop while a lift copies: the lift is cancelled and its pins
    given back at once; the pool shutdown waits for the copy in flight; the task then unwinds
    on the closed tiers without an error."""
    store = make_store(tmp_path)
    p = [key(0), key(1)]

    async def main() -> asyncio.Task[None] | None:
        await publish(store, p)
        gate = Gate(gpu_of(store))
        store.release((await store.fetch(p, LAYOUT)).id)
        await gate.reached()
        lift = store._lifting
        threading.Timer(0.1, gate.open.set).start()
        store.close()
        assert pins(store) == (0, 0)
        task = lift.task if lift is not None else None
        if task is not None:
            await asyncio.wait([task])
        return task

    task = asyncio.run(main())
    assert task is not None and task.cancelled()
    assert store._lifting is None and pins(store) == (0, 0)
    assert errors(caplog) == []


def test_failed_lift_is_logged_and_gives_everything_back(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = make_store(tmp_path)
    p = [key(0), key(1)]

    async def main() -> None:
        await publish(store, p)
        gpu = gpu_of(store)
        copy = gpu.write_from
        gate = Gate(gpu, fail=True)
        gate.open.set()
        store.release((await store.fetch(p, LAYOUT)).id)
        await store.lifts_idle()
        assert errors(caplog) == ["promotion into the gpu tier failed"]
        assert not gpu.entries and pins(store) == (0, 0) and store.counters.promotions == 0
        # The store goes on serving, and lifts again once copies work.
        gpu.write_from = copy  # type: ignore[method-assign]
        lease = await store.fetch(p, LAYOUT)
        assert fetched_bytes(store, lease) == [payload(k) for k in p]
        store.release(lease.id)
        await store.lifts_idle()
        assert gpu_bytes(store, p) == [payload(k) for k in p] and pins(store) == (0, 0)

    try:
        asyncio.run(main())
    finally:
        store.close()
