"""The spine end to end: a real daemon in its own process, the client, real files."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import grpc
import pytest
import torch

from kvstore import InvalidArgumentError
from kvstore.client import KVClient
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from tests.conftest import random_kv, same_bytes, small_layout
from tests.reliability import arena_path, wait_until

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("transfer", ["shm", "stream"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_is_byte_identical(daemon, dtype, transfer):
    layout = small_layout(dtype)
    tokens = list(range(100, 100 + 5 * 16 + 7))  # 5 full blocks and a partial one
    kv = random_kv(layout, len(tokens))
    with KVClient(daemon.target, layout, transfer=transfer) as c:
        assert c.lookup(tokens) == 0
        assert c.fetch(tokens) == (0, None)
        assert c.publish(tokens, kv) == 80
        assert c.lookup(tokens) == 80
        n, kv2 = c.fetch(tokens)
        assert n == 80
        assert same_bytes(kv2, kv[:, :, :80])
        # token tensors and lists are the same prompt
        assert c.lookup(torch.tensor(tokens)) == 80


def test_shared_prefix_and_isolation(daemon):
    layout = small_layout()
    a = list(range(64))  # 4 blocks
    b = a[:32] + [9999] * 32  # shares 2 blocks, then diverges
    with KVClient(daemon.target, layout) as c:
        c.publish(a, random_kv(layout, 64))
        assert c.lookup(b) == 32
        n, kv = c.fetch(b)
        assert n == 32
        assert kv is not None
    for other in (small_layout(model="other"), small_layout(torch.float16),
                  small_layout(num_layers=3)):
        with KVClient(daemon.target, other) as c:
            assert c.lookup(a) == 0
    with KVClient(daemon.target, layout, salt="tenant-b") as c:
        assert c.lookup(a) == 0
        assert c.fetch(a) == (0, None)


def test_publish_skips_blocks_already_stored(daemon):
    layout = small_layout()
    tokens = list(range(48))
    kv = random_kv(layout, 48)
    with KVClient(daemon.target, layout) as c:
        c.publish(tokens[:32], kv[:, :, :32])
        before = c.stats().stored_blocks
        assert c.publish(tokens, kv) == 48
        assert c.stats().stored_blocks == before + 1
        assert same_bytes(c.fetch(tokens)[1], kv)


def test_held_answers_for_each_block_and_is_only_a_probe(daemon, tmp_path):
    """`held`: one flag per block, not counted as a lookup; a daemon that is gone answers all
    False. (Flags past a missing block, which chained token keys cannot make: the SGLang
    sidecar tests, `tests/sglang/test_hicache_hybrid.py`.)"""
    layout = small_layout()
    tokens = list(range(64))
    kv = random_kv(layout, 64)
    with KVClient(daemon.target, layout) as c:
        c.publish(tokens[:32], kv[:, :, :32])
        lookups = c.stats().lookups
        assert c.held(tokens) == [True, True, False, False]
        assert c.lookup(tokens) == 32
        assert c.stats().lookups == lookups + 1  # the lookup, not the probe
        assert c.held([]) == []
    with KVClient(f"unix://{tmp_path}/nobody.sock", layout, deadline_s=0.5) as gone:
        assert gone.held(tokens) == [False] * 4


def test_held_falls_back_to_one_lookup_each_on_an_older_daemon(daemon, monkeypatch, caplog):
    """A daemon older than `Lookup.each` ignores the field and answers a plain lookup, with
    no `found`: the client then asks key by key (logged once), never reads `hits` as flags.
    (An older daemon binary is not at hand: its reply is made by leaving `each` unset.)"""
    from kvstore.client.aio import AsyncKVClient

    async def plain(self, keys):  # what an older daemon answers
        return await self._lookup(keys)

    monkeypatch.setattr(AsyncKVClient, "_lookup_each", plain)
    layout = small_layout()
    tokens = list(range(64))
    with KVClient(daemon.target, layout) as c:
        c.publish(tokens[:32], random_kv(layout, 32))
        assert c.held(tokens) == [True, True, False, False]
        assert c.held(tokens) == [True, True, False, False]
    assert caplog.text.count("predates Lookup.each") == 1


def test_demotion_to_disk_keeps_hits_and_disk_within_capacity(daemon_factory):
    # 8 KiB blocks + page rounding: host holds 8 blocks, disk holds ~30 (12 KiB per record)
    d = daemon_factory("--host-bytes", "64KiB", "--disk-bytes", "384KiB").start()
    layout = small_layout()
    prompts = [[p * 1000 + t for t in range(64)] for p in range(6)]  # 6 x 4 blocks = 24 blocks
    kvs = [random_kv(layout, 64, seed=p) for p in range(6)]
    with KVClient(d.target, layout) as c:
        for tokens, kv in zip(prompts, kvs, strict=True):
            assert c.publish(tokens, kv) == 64
        stats = c.stats()
        host, disk = (next(t for t in stats.tiers if t.name == n) for n in ("host", "disk"))
        assert stats.demotions > 0
        assert disk.blocks > 0
        assert host.used_bytes <= host.capacity_bytes
        for tokens, kv in zip(prompts, kvs, strict=True):
            n, got = c.fetch(tokens)
            assert n == 64
            assert same_bytes(got, kv)
        assert c.stats().promotions > 0
    data = Path(d.data_dir) / "disk" / "blocks.dat"
    assert data.stat().st_size <= 384 * 1024 + layout.block_bytes


def test_sigkill_restart_keeps_disk_blocks(daemon_factory):
    d = daemon_factory("--host-bytes", "32KiB", "--disk-bytes", "1MiB").start()
    layout = small_layout()
    tokens = list(range(128))  # 8 blocks; host holds 4
    kv = random_kv(layout, 128)
    with KVClient(d.target, layout) as c:
        assert c.publish(tokens, kv) == 128
        on_disk = next(t for t in c.stats().tiers if t.name == "disk").blocks
    assert on_disk > 0
    d.kill()
    d.start()
    with KVClient(d.target, layout) as c:
        # only demoted blocks survive a crash; they form a prefix only if the first did
        stats = c.stats()
        assert next(t for t in stats.tiers if t.name == "disk").blocks == on_disk
        keys = c.keys(tokens)
        survivors = [k for k in keys if c.lookup(tokens[: (keys.index(k) + 1) * 16]) > 0]
        assert survivors, "no block survived the restart"
    # the first blocks were demoted first (LRU leaf-first means parents are freshest...):
    # whatever survived must come back byte-identical
    with KVClient(d.target, layout) as c:
        n, got = c.fetch(tokens)
        if n:
            assert same_bytes(got, kv[:, :, :n])


def test_a_killed_daemon_leaves_no_arena_in_shared_memory(daemon_factory, tmp_path):
    # `DaemonProcess.kill` is a crash, for tests and benchmarks; the arena a crash leaves is
    # removed by the next daemon to start, and until then held memory (2 GiB per daemon in
    # `benchmarks.vllm_disagg`). A live daemon's arena in the same directory stays.
    shm = tmp_path / "shm"
    shm.mkdir()
    a = daemon_factory("--host-bytes", "8MiB", "--shm-dir", str(shm), name="a").start()
    b = daemon_factory("--host-bytes", "8MiB", "--shm-dir", str(shm), name="b").start()
    arenas = sorted(shm.glob("kvstore-*.arena"))
    assert len(arenas) == 2
    a.kill()
    assert sorted(shm.glob("kvstore-*.arena")) == [p for p in arenas if str(b.proc.pid) in p.name]
    with KVClient(b.target, small_layout()) as c:  # its arena still serves
        tokens = list(range(32))
        assert c.publish(tokens, random_kv(small_layout(), 32)) == 32 and c.fetch(tokens)[0] == 32


def test_corrupt_disk_value_is_a_counted_miss(daemon_factory):
    d = daemon_factory("--host-bytes", "16KiB", "--disk-bytes", "1MiB").start()
    layout = small_layout()
    tokens = list(range(16))
    kv = random_kv(layout, 16)
    with KVClient(d.target, layout) as c:
        c.publish(tokens, kv)
        c.publish(list(range(500, 516)), random_kv(layout, 16, seed=1))  # evicts the first
        c.publish(list(range(600, 616)), random_kv(layout, 16, seed=2))
        disk = next(t for t in c.stats().tiers if t.name == "disk")
        assert disk.blocks >= 1
    d.stop()
    data = Path(d.data_dir) / "disk" / "blocks.dat"
    raw = bytearray(data.read_bytes())
    raw[4096 + 100] ^= 0xFF  # inside the first record's payload
    data.write_bytes(raw)
    d.start()
    with KVClient(d.target, layout) as c:
        results = [c.fetch(t) for t in (tokens, list(range(500, 516)))]
        stats = c.stats()
    assert stats.integrity_failures == 1
    for (n, got), want in zip(results, (kv, random_kv(layout, 16, seed=1)), strict=True):
        assert n == 0 or same_bytes(got, want)  # never the corrupt bytes
    assert sum(n for n, _ in results) == 16  # the intact one is still a hit


def test_daemon_down_is_a_quick_miss(tmp_path):
    layout = small_layout()
    tokens = list(range(32))
    with KVClient(f"unix://{tmp_path}/nobody.sock", layout, deadline_s=0.5) as c:
        t0 = time.monotonic()
        assert c.lookup(tokens) == 0
        assert c.fetch(tokens) == (0, None)
        assert c.publish(tokens, random_kv(layout, 32)) == 0
        assert time.monotonic() - t0 < 1.5


def test_daemon_killed_then_back(daemon_factory):
    d = daemon_factory("--host-bytes", "8MiB", "--disk-bytes", "0").start()
    layout = small_layout()
    tokens = list(range(32))
    kv = random_kv(layout, 32)
    with KVClient(d.target, layout, deadline_s=0.5) as c:
        c.publish(tokens, kv)
        d.kill()
        t0 = time.monotonic()
        assert c.fetch(tokens) == (0, None)
        assert c.lookup(tokens) == 0
        assert time.monotonic() - t0 < 1.2
        d.start()
        wait_until(c.ping, 5, "the restarted daemon answers a ping", period_s=0.05)
        assert c.publish(tokens, kv) == 32  # a new arena: the client remaps
        n, got = c.fetch(tokens)
        assert n == 32
        assert same_bytes(got, kv)


def test_bad_input_names_the_problem_and_daemon_keeps_serving(daemon):
    layout = small_layout()
    tokens = list(range(32))
    kv = random_kv(layout, 32)
    with KVClient(daemon.target, layout) as c:
        with pytest.raises(InvalidArgumentError, match="dtype"):
            c.publish(tokens, kv.to(torch.float16))
        with pytest.raises(InvalidArgumentError, match="shape"):
            c.publish(tokens, kv[:, :, :16])
        with pytest.raises(InvalidArgumentError, match="not an int"):
            c.lookup([1, 2, "x"])
        with pytest.raises(InvalidArgumentError, match="integers"):
            c.lookup(torch.tensor([1.0, 2.0]))
        assert c.publish(tokens, kv) == 32
    channel = grpc.insecure_channel(daemon.target)
    stub = pb_grpc.KVStoreStub(channel)
    with pytest.raises(grpc.RpcError) as e:
        stub.Lookup(pb.LookupRequest(keys=[b"short"]), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "32" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.Lookup(pb.LookupRequest(keys=[b"k" * 32] * 5000), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "limit" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.Lookup(pb.LookupRequest(keys=[b"k" * 32] * 3_000_000), timeout=10)  # ~100 MB
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    bad = pb.Layout(model="tiny", num_layers=0, num_kv_heads=2, head_dim=16, dtype="float32",
                    block_tokens=16)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Fetch(pb.FetchRequest(layout=bad, keys=[b"k" * 32]), timeout=5))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "num_layers" in e.value.details()
    good = pb.Layout(model="tiny", num_layers=1, num_kv_heads=2, head_dim=16, dtype="float32",
                     block_tokens=16)
    ns = b"n" * 32
    for name, call in (  # prior_keys are checked like keys, and count against the same limit
            ("Reserve", lambda **kw: stub.Reserve(pb.ReserveRequest(
                namespace=ns, layout=good, **kw), timeout=5)),
            ("Fetch", lambda **kw: list(stub.Fetch(pb.FetchRequest(
                namespace=ns, layout=good, **kw), timeout=5)))):
        with pytest.raises(grpc.RpcError) as e:
            call(keys=[b"k" * 32], prior_keys=[b"k" * 32, b"short"])
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert "prior_keys[1] is 5 bytes" in e.value.details(), name
        with pytest.raises(grpc.RpcError) as e:
            call(keys=[b"k" * 32] * 4000, prior_keys=[b"p" * 32] * 100)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert "4100 keys in one call" in e.value.details(), name
    channel.close()
    with KVClient(daemon.target, layout) as c:  # still serving
        assert c.lookup(tokens) == 32


def test_socket_mode_and_clean_sigterm(daemon_factory, tmp_path):
    # Its own shm_dir: under pytest-xdist another test's daemon, started in a shared
    # /dev/shm with the same host_bytes, may take over the arena this one leaves.
    shm = tmp_path / "shm"
    shm.mkdir()
    daemon = daemon_factory("--host-bytes", "8MiB", "--disk-bytes", "32MiB",
                            "--shm-dir", str(shm)).start()
    # The data directory (disk tier, its index, the socket) is the daemon user's alone.
    for path in (daemon.data_dir, daemon.data_dir / "disk"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    mode = stat.S_IMODE(os.stat(daemon.socket).st_mode)
    assert mode & 0o077 == 0, oct(mode)
    arena = arena_path(daemon.target)
    assert os.path.dirname(arena) == str(shm)
    assert set(os.listdir(shm)) == {os.path.basename(arena)}
    assert daemon.stop() == 0
    # Its arena is left for the next daemon (`host_handover_s`), marked so; nothing else.
    name = os.path.basename(arena)
    assert set(os.listdir(shm)) == {name, f"{name}.handover"}
    assert not os.path.exists(daemon.socket)


def test_tcp_requires_token_and_streams(daemon_factory):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    daemon_factory("--listen", f"127.0.0.1:{port}", "--token", "s3cret-0123456789abcdef").start()
    layout = small_layout()
    tokens = list(range(48))
    kv = random_kv(layout, 48)
    with KVClient(f"127.0.0.1:{port}", layout, token="s3cret-0123456789abcdef") as c:
        assert c.publish(tokens, kv) == 48
        n, got = c.fetch(tokens)
        assert n == 48
        assert same_bytes(got, kv)
    with KVClient(f"127.0.0.1:{port}", layout, token="wrong", deadline_s=0.5) as c:
        assert c.lookup(tokens) == 0  # UNAUTHENTICATED is a miss for the engine...
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    with pytest.raises(grpc.RpcError) as e:  # ...and a clear status on the wire
        pb_grpc.KVStoreStub(channel).Stats(pb.StatsRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    channel.close()


def test_listen_without_token_refuses_to_start(daemon_factory):
    d = daemon_factory("--listen", "127.0.0.1:1")
    with pytest.raises(RuntimeError, match="token"):
        d.start(timeout=10)


def test_new_client_after_restart_does_not_inherit_an_old_clients_backoff(daemon_factory):
    # gRPC shares subchannels between a process's channels by default: a client created
    # after a restart would start inside the old client's reconnect backoff and miss.
    d = daemon_factory().start()
    layout = small_layout()
    tokens = list(range(32))
    old = KVClient(d.target, layout, deadline_s=2)
    assert old.publish(tokens, random_kv(layout, 32)) == 32
    assert d.stop() == 0  # flushed to disk: the blocks survive the restart
    for _ in range(3):
        assert old.lookup(tokens) == 0  # down: misses, and the old channel backs off
    d.start()
    with KVClient(d.target, layout, deadline_s=2) as new:
        assert new.lookup(tokens) == 32  # the first call already reaches the daemon
    old.close()


def test_the_daemon_prefaults_its_arena_unless_told_not_to(daemon_factory):
    """`host_prefault`: by default the daemon backs its whole arena in the background (Stats
    counts it), and a block published meanwhile reads back intact; `off` backs none."""
    layout = small_layout()
    tokens = list(range(64))
    kv = random_kv(layout, len(tokens))
    on = daemon_factory("--host-bytes", "64MiB", "--disk-bytes", "0", name="on").start()
    with KVClient(on.target, layout) as c:
        assert c.publish(tokens, kv) == 64
        wait_until(lambda: c.stats().host_prefaulted_bytes == 64 << 20, 60,
                   "the arena prefaulted")
        n, back = c.fetch(tokens)
        assert n == 64 and same_bytes(back, kv)
    off = daemon_factory("--host-bytes", "64MiB", "--disk-bytes", "0", "--host-prefault", "off",
                         name="off").start()
    with KVClient(off.target, layout) as c:
        assert c.publish(tokens, kv) == 64
        time.sleep(0.5)  # longer than the whole 64 MiB prefault of the daemon above took
        # Where a GPU driver pins the arena (cudaHostRegister), pinning backed every page:
        # Stats counts it whole (seen on the H100, docs/GPU.md).
        pinned = torch.cuda.is_available()
        assert c.stats().host_prefaulted_bytes == (64 << 20 if pinned else 0)


def test_a_stopped_daemon_frees_its_arena_while_a_client_still_maps_it(daemon_factory):
    """At shutdown a daemon that does not leave its arena to the next (`--host-handover-s 0`,
    or a client still writing: tests/integration/test_arena_handover.py) frees its pages
    itself (`Arena.free_pages`), after its
    server stopped: not when the last client lets go of its mapping, which may be during the
    next daemon's prefault (half the rate beside such a free, docs/PERFORMANCE.md). The
    client's copies of the blocks it fetched before are intact, and the next daemon serves
    them from disk."""
    from tests.unit.test_arena_prefault import resident_bytes

    layout = small_layout()
    tokens = list(range(64))
    kv = random_kv(layout, len(tokens))
    d = daemon_factory("--host-bytes", "16MiB", "--disk-bytes", "64MiB",
                       "--host-handover-s", "0", name="frees").start()
    with KVClient(d.target, layout) as c:
        assert c.publish(tokens, kv) == 64
        n, back = c.fetch(tokens)
        assert n == 64 and same_bytes(back, kv)
        arena = c._aio._arena
        assert arena is not None
        arena.populate(0, arena.size)  # every page backed through the client's mapping
        assert resident_bytes(arena.path) >= 16 << 20
        assert d.stop() == 0
        assert resident_bytes(arena.path) == 0  # freed, though this process maps it still
        assert same_bytes(back, kv)  # what was copied out before is the client's own
        d.start()
        n, again = c.fetch(tokens)  # the next daemon, from disk
        assert n == 64 and same_bytes(again, kv)


def _start_fails(tmp_path: Path, *args: str, prelude: str = "") -> str:
    """Start a daemon that must fail: its stderr, after checking that it exited 2 with one
    clear line (no traceback) and left neither arena nor socket behind."""
    import subprocess
    import sys

    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    data = tmp_path / "data"
    code = (f"import sys\n{prelude}\nfrom kvstore.server.__main__ import main\n"
            f"sys.exit(main())")
    p = subprocess.run([sys.executable, "-c", code, "--data-dir", str(data), "--shm-dir",
                        str(shm), "--host-bytes", "16MiB", "--disk-bytes", "0", *args],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert not list(shm.iterdir()), "the arena was left behind"
    assert not (data / "kv.sock").exists(), "the socket was left behind"
    return p.stderr.strip().splitlines()[-1]


def test_a_port_in_use_is_one_clear_line_and_leaves_nothing_behind(tmp_path):
    """A metrics or TCP port another process holds, a metrics host that is not this
    machine's: the daemon says which option and why in one line and gives the arena and
    the socket back (it used to end in a traceback, leaving both for the next daemon)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = _start_fails(tmp_path, "--metrics-port", str(port))
        assert f"metrics_port {port} on 127.0.0.1: cannot bind it: Address already in use" \
            in line, line
        line = _start_fails(tmp_path, "--listen", f"127.0.0.1:{port}", "--token", "t" * 32)
        assert f"listen 127.0.0.1:{port}: cannot bind it" in line, line
    line = _start_fails(tmp_path, "--metrics-port", "9", "--metrics-host", "192.0.2.1")
    assert "metrics_port 9 on 192.0.2.1: cannot bind it" in line, line


def test_kv_events_without_the_events_extra_names_the_extra(tmp_path):
    """`kv_events` where msgspec is not installed (made unimportable here): the daemon says
    which extra to install, and gives the arena back."""
    line = _start_fails(tmp_path, "--kv-events", "tcp://127.0.0.1:0",
                        prelude="sys.modules['msgspec'] = None")
    assert "kv_events needs the events extra (msgspec is not installed)" in line, line
    assert "pip install 'kvstore-cache[events]'" in line, line
