"""The gpu tier in the daemon's chain, through a real daemon process: gpu over host over disk
(`--gpu-bytes`, with `--gpu-device cpu`: the same code on host memory).

Capacities are 4 gpu, 6 host and 64 disk blocks under LRU, so every step's placement follows
from the rules (`tiers/hierarchy.py`) and is asserted exactly, per tier, by Inspect and Stats:
a fetch copies what it served up into gpu (kept in host too), a publish pushes host's
least-recent blocks down to disk, a block only gpu holds reaches a client that does not map
the slab through host scratch space (one that does reads it where it lies), and gpu victims
go down to host (pushing host's down to disk).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from kvstore.client import KVClient
from kvstore.client.slab import SLAB_ENV
from kvstore.proto import kvstore_pb2 as pb
from tests.conftest import random_kv, same_bytes, small_layout
from tests.reliability import (
    CapacityWatch,
    layout_pb,
    stats,
    stub,
    tier,
    wait_quiescent,
    wait_until,
)

pytestmark = pytest.mark.integration
P1, P2, P3 = (small_layout(model=m) for m in ("p1", "p2", "p3"))  # a namespace each
BB = P1.block_bytes  # 8 KiB: 2 pages
BT = P1.block_tokens
GPU, HOST, DISK = 4, 6, 64  # blocks


def chain_args(gpu_blocks: int = GPU, disk_bytes: int = DISK * BB,
               device: str = "cpu") -> tuple[str, ...]:
    return ("--gpu-bytes", str(gpu_blocks * BB), "--gpu-device", device,
            "--host-bytes", str(HOST * BB), "--disk-bytes", str(disk_bytes),
            "--eviction-policy", "lru")


def placement(target: str) -> dict[str, dict[str, int]]:
    """Blocks per tier of each prompt (its layout's model names its namespace), by Inspect."""
    channel, s = stub(target)
    with channel:
        reply = s.Inspect(pb.InspectRequest(), timeout=5)
    return {ns.layout.model: {t.tier: t.blocks for t in ns.tiers if t.blocks}
            for ns in reply.namespaces}


def counters(target: str) -> dict[str, int | dict[str, list[int]]]:
    """Per tier [blocks, hits, bytes read, bytes written], and the chain's moves."""
    r = stats(target)
    return {"tiers": {t.name: [t.blocks, t.hits, t.bytes_read, t.bytes_written]
                      for t in r.tiers},
            "promotions": r.promotions, "demotions": r.demotions}


def lifted(target: str, promotions: int, within_s: float = 10.0) -> None:
    """Wait for a fetch's lift, which runs after the fetch answered: until the daemon counts
    `promotions` in all, then until nothing is pinned (the lift holds pins until it ends)."""
    wait_until(lambda: stats(target).promotions == promotions, within_s,
               f"{promotions} promotions")
    wait_quiescent(target, within_s)


def prompt(i: int) -> list[int]:
    return list(range(1000 * i, 1000 * i + 4 * BT))


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]),
]


@pytest.mark.parametrize("device", DEVICES)
def test_chain_demotes_down_promotes_back_and_counts_per_tier(daemon_factory, device,
                                                              monkeypatch):
    # With `cuda` the slab is device memory: every move up and down crosses the bus. These
    # clients do not map the slab, so gpu-only blocks come through host scratch space (a
    # client that maps it: test_a_client_mapping_the_slab_reads_gpu_blocks_where_they_lie).
    monkeypatch.setenv(SLAB_ENV, "0")
    d = daemon_factory(*chain_args(device=device)).start()
    t1, t2, t3 = prompt(1), prompt(2), prompt(3)
    kv1, kv2, kv3 = (random_kv(lay, len(t), seed)
                     for seed, (lay, t) in enumerate(((P1, t1), (P2, t2), (P3, t3))))
    with (CapacityWatch(d) as watch, KVClient(d.target, P1) as c1,
          KVClient(d.target, P2, deadline_s=20) as c2, KVClient(d.target, P3) as c3):
        assert c1.publish(t1, kv1) == len(t1)
        assert placement(d.target) == {"p1": {"host": 4}}
        # A fetch serves host's blocks and copies them up into gpu; host keeps them.
        n, got = c1.fetch(t1)
        assert n == len(t1) and same_bytes(got, kv1)
        lifted(d.target, 4)
        assert placement(d.target) == {"p1": {"gpu": 4, "host": 4}}
        assert counters(d.target) == {
            "tiers": {"gpu": [4, 0, 0, 4 * BB], "host": [4, 4, 4 * BB, 4 * BB],
                      "disk": [0, 0, 0, 0]}, "promotions": 4, "demotions": 0}
        # Host full: a publish pushes its least-recent blocks (P1's tail) down to disk.
        assert c2.publish(t2, kv2) == len(t2)
        assert placement(d.target) == {"p1": {"gpu": 4, "host": 2, "disk": 2},
                                       "p2": {"host": 4}}
        # P1's tail is read from gpu (before disk) through host scratch space: no copy is
        # placed in host; the scratch space pushes P2's tail down to disk and is freed.
        n, got = c1.fetch(t1)
        assert n == len(t1) and same_bytes(got, kv1)
        assert placement(d.target) == {"p1": {"gpu": 4, "host": 2, "disk": 2},
                                       "p2": {"host": 2, "disk": 2}}
        assert counters(d.target) == {
            "tiers": {"gpu": [4, 2, 2 * BB, 4 * BB], "host": [4, 6, 6 * BB, 8 * BB],
                      "disk": [4, 0, 0, 4 * BB]}, "promotions": 4, "demotions": 4}
        assert tier(wait_quiescent(d.target, 2.0), "host").used_bytes == 4 * BB
        # P2: its tail promoted from disk into host, then all of it copied up into gpu. gpu's
        # victims (P1) go down to host, whose victims (P1 again) go down to disk, written once.
        n, got = c2.fetch(t2)
        assert n == len(t2) and same_bytes(got, kv2)
        lifted(d.target, 4 + 2 + 4)
        assert placement(d.target) == {"p1": {"host": 2, "disk": 4},
                                       "p2": {"gpu": 4, "host": 4, "disk": 2}}
        # Written: into gpu by lifts, into host by publishes, gpu's demotions and promotions
        # from disk (read: disk's), into disk by host's demotions. Read from host: its hits,
        # each block once as its fetch served it.
        assert counters(d.target) == {
            "tiers": {"gpu": [4, 2, 2 * BB, 8 * BB], "host": [6, 8, 8 * BB, 14 * BB],
                      "disk": [6, 2, 2 * BB, 6 * BB]},
            "promotions": 4 + 2 + 4, "demotions": 4 + 4 + 2}

        # Pins: while P2's fetch lease is held, its host blocks are never evicted. P3 gets
        # host's two unpinned blocks (P1's, already on disk: dropped) and, published in
        # rounds, pushes its own first half down to disk to take them again.
        during: list[object] = []

        def consume(blocks, views, stop: threading.Event) -> None:
            during.append(c3.publish(t3, kv3))
            during.append(placement(d.target))
            for b, view in zip(blocks, views, strict=True):  # the arena under the lease
                assert same_bytes(view, kv2[:, :, b * BT : (b + 1) * BT])

        assert c2.fetch_with(t2, consume) == len(t2)
        assert during == [len(t3), {"p1": {"disk": 4}, "p2": {"gpu": 4, "host": 4, "disk": 2},
                                    "p3": {"host": 2, "disk": 2}}]
        # The lease ended: P3 is promoted into host and copied up into gpu, P2 going down the
        # chain as P1 did.
        n, got = c3.fetch(t3)
        assert n == len(t3) and same_bytes(got, kv3)
        lifted(d.target, 10 + 2 + 4)
        assert placement(d.target) == {"p1": {"disk": 4}, "p2": {"host": 2, "disk": 4},
                                       "p3": {"gpu": 4, "host": 4, "disk": 2}}
        wait_quiescent(d.target, 2.0)
        watch.check()
        before = stats(d.target)
        assert all(t.used_bytes <= t.capacity_bytes for t in before.tiers)
        assert [(t.name, t.capacity_bytes) for t in before.tiers] == [
            ("gpu", GPU * BB), ("host", HOST * BB), ("disk", DISK * BB)]

    # A restart keeps the disk tier (the SIGTERM flush writes what only memory held); gpu and
    # host start empty, and every prompt comes back byte-identical from disk.
    assert d.stop() == 0
    d.start()
    after = stats(d.target)
    assert [(t.name, t.blocks) for t in after.tiers] == [("gpu", 0), ("host", 0), ("disk", 12)]
    for lay, t, kv in ((P1, t1, kv1), (P2, t2, kv2), (P3, t3, kv3)):
        with KVClient(d.target, lay) as c:
            n, got = c.fetch(t)
            assert n == len(t) and same_bytes(got, kv)
    assert tier(stats(d.target), "disk").hits == 12
    # Stopped with the last fetch's lift possibly running: cancelled, its pins given back.
    assert d.stop() == 0
    assert "Traceback" not in d.log.read_text()


def slab_fetch(target: str, layout, tokens: list[int], **request) -> pb.FetchChunk:
    """One raw Fetch's header (a lease left to the caller), over the Unix socket."""
    keys = KVClient(target, layout).keys(tokens)
    channel, s = stub(target)
    with channel:
        call = s.Fetch(pb.FetchRequest(namespace=namespace(layout), layout=layout_pb(layout),
                                       keys=keys, **request), timeout=5)
        return next(iter(call))


def namespace(layout) -> bytes:
    from kvstore.keys import Namespace

    return Namespace(layout).digest()


@pytest.mark.parametrize("device", DEVICES)
def test_a_client_mapping_the_slab_reads_gpu_blocks_where_they_lie(daemon_factory, device):
    """A same-node client maps the gpu slab (CUDA IPC; on the CPU a shared file, the same
    protocol): every block gpu holds is served to it where it lies (a block host holds too
    as well: device to device beats across the bus), pinned by its lease, byte-identical,
    with no host scratch space taken and nothing pushed down for it. A client that does not
    ask (or a streamed fetch) still gets host's copy, or a gpu-only block through host."""
    # Leases short enough that the two left unreleased below expire within the test, long
    # enough that the client's own fetches finish under theirs on a loaded machine (2 s
    # failed once beside the vLLM suite).
    d = daemon_factory(*chain_args(device=device), "--lease-timeout-s", "5").start()
    t1, t2 = prompt(1), prompt(2)
    kv1, kv2 = random_kv(P1, len(t1), 0), random_kv(P2, len(t2), 1)
    with CapacityWatch(d) as watch, KVClient(d.target, P1) as c1, KVClient(d.target, P2) as c2:
        assert c1.prepare()  # maps the arena and the slab
        assert c1.publish(t1, kv1) == len(t1)
        n, got = c1.fetch(t1)
        assert n == len(t1) and same_bytes(got, kv1)
        lifted(d.target, 4)
        assert c2.publish(t2, kv2) == len(t2)
        before = {"p1": {"gpu": 4, "host": 2, "disk": 2}, "p2": {"host": 4}}
        assert placement(d.target) == before
        calls: list[tuple[object, ...]] = []

        def consume(blocks, views, stop: threading.Event) -> None:
            calls.append((list(blocks), placement(d.target),
                          tier(stats(d.target), "gpu").pinned_blocks,
                          [v.device.type for v in views],
                          [same_bytes(v, kv1[:, :, b * BT : (b + 1) * BT])
                           for b, v in zip(blocks, views, strict=True)]))

        assert c1.fetch_with(t1, consume) == len(t1)
        # All of P1 from the slab, its head too (host holds it as well), pinned while the
        # lease lasts: no scratch space, so P2 keeps its host blocks.
        slab = "cuda" if device == "cuda" else "cpu"
        assert calls == [([0, 1, 2, 3], before, 4, [slab] * 4, [True] * 4)]
        n, got = c1.fetch(t1)  # `fetch` (into a new tensor) reads the slab too
        assert n == len(t1) and same_bytes(got, kv1)
        r = wait_quiescent(d.target, 2.0)
        assert placement(d.target) == before
        assert [tier(r, "gpu").hits, tier(r, "gpu").bytes_read] == [8, 0]  # zero-copy

        # The raw protocol: a client that does not ask gets the tail through host scratch
        # space; a streamed fetch never gets slab offsets; an SHM fetch that asks does, with
        # the slab's id, and a lease it never releases gives its pins back when it expires.
        info_slab = stub(d.target)[1].Info(pb.InfoRequest(), timeout=5).slab
        assert info_slab.id and info_slab.size == GPU * BB and info_slab.device == device
        plain = slab_fetch(d.target, P1, t1, transfer=pb.TRANSFER_SHM)
        assert [(b.tier, b.in_slab) for b in plain.blocks] == [
            ("host", False), ("host", False), ("gpu", False), ("gpu", False)]
        assert not plain.slab_id
        streamed = slab_fetch(d.target, P1, t1, transfer=pb.TRANSFER_STREAM, slab_ok=True)
        assert [b.in_slab for b in streamed.blocks] == [False] * 4
        asked = slab_fetch(d.target, P1, t1, transfer=pb.TRANSFER_SHM, slab_ok=True)
        assert [(b.tier, b.in_slab) for b in asked.blocks] == [("gpu", True)] * 4
        assert asked.slab_id == info_slab.id
        assert tier(stats(d.target), "gpu").pinned_blocks == 4
        r = wait_quiescent(d.target, 20.0)  # both SHM leases expire (5 s): every pin back
        assert r.expired_leases == 2 and tier(r, "gpu").pinned_blocks == 0
        watch.check()

        # A restart makes a new slab: the clients map it in place of the old one (whose file
        # the stopped daemon removed) and read the new daemon's gpu-only blocks from it.
        old = c1._aio._slab_id
        assert d.stop() == 0
        d.start()
        wait_until(lambda: c1.clear(all_namespaces=True) > 0, 10, "the daemon back")
        assert c1.publish(t1, kv1) == len(t1)  # the same steps as above, on the new daemon
        n, got = c1.fetch(t1)
        assert n == len(t1) and same_bytes(got, kv1)
        lifted(d.target, 4)
        assert c2.publish(t2, kv2) == len(t2)
        assert placement(d.target) == before
        n, got = c1.fetch(t1)
        assert n == len(t1) and same_bytes(got, kv1)
        assert c1._aio._slab_id not in ("", old)
        assert tier(stats(d.target), "gpu").hits == 4
    assert d.stop() == 0
    assert "Traceback" not in d.log.read_text()


def torch_loaded(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_daemon_imports_torch_only_with_a_gpu_tier_or_a_driver(daemon_factory):
    plain = daemon_factory("--host-bytes", str(HOST * BB), name="plain").start()
    gpu = daemon_factory(*chain_args(), name="gpu").start()
    assert plain.proc is not None and gpu.proc is not None
    # Where a GPU driver exists the daemon pins its host arena (cudaHostRegister, through
    # torch): a plain daemon then loads torch too (seen on the H100, docs/GPU.md).
    assert torch_loaded(plain.proc.pid) == torch.cuda.is_available()
    assert torch_loaded(gpu.proc.pid)
    assert [t.name for t in stats(plain.target).tiers] == ["host", "disk"]
    plain.stop()
    gpu.stop()


def test_gpu_tier_that_cannot_be_allocated_stops_start_up(daemon_factory):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device exists here: the slab would be allocated")
    d = daemon_factory("--gpu-bytes", str(GPU * BB), "--gpu-device", "cuda", name="nocuda")
    with pytest.raises(RuntimeError, match="did not start"):
        d.start(timeout=20)
    assert "gpu_bytes: cannot allocate" in d.log.read_text()
