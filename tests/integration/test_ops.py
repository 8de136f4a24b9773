"""Operator surface of a running daemon: CLI, metrics, health, config printing."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.client import KVClient
from tests.conftest import random_kv, same_bytes, small_layout
from tests.metrics_docs import undocumented_exports
from tests.reliability import Worker, wait_until

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvstore_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstore.client.cli", *args], capture_output=True,
                          text=True, timeout=60)


def test_cli_stats_ping_clear(daemon):
    layout = small_layout()
    with KVClient(daemon.target, layout) as c:
        c.publish(list(range(64)), random_kv(layout, 64))
        namespace = c.namespace.digest().hex()  # what `kvstore clear --namespace` takes
    r = kvstore_cli("--target", daemon.target, "ping")
    assert r.returncode == 0 and "ok" in r.stdout
    r = kvstore_cli("--target", daemon.target, "stats")
    assert r.returncode == 0, r.stderr
    assert "host" in r.stdout and "disk" in r.stdout and "hit rate" in r.stdout
    r = kvstore_cli("--target", daemon.target, "--json", "stats")
    stats = json.loads(r.stdout)
    host = next(t for t in stats["tiers"] if t["name"] == "host")
    assert int(host["blocks"]) == 4
    r = kvstore_cli("--target", daemon.target, "clear", "--namespace", "ab")
    assert r.returncode == 2 and "at least 8 hex" in r.stderr
    r = kvstore_cli("--target", daemon.target, "--json", "clear", "--namespace", namespace)
    assert r.returncode == 0 and json.loads(r.stdout)["removed"] == 4
    with KVClient(daemon.target, layout) as c:
        assert c.lookup(list(range(64))) == 0


def test_cli_reports_an_unreachable_daemon(tmp_path):
    r = kvstore_cli("--target", f"unix://{tmp_path}/none.sock", "--timeout", "1", "ping")
    assert r.returncode == 1
    assert "UNAVAILABLE" in r.stderr


def test_metrics_are_exported_after_publish_and_fetch(daemon_factory):
    port = _free_port()
    layout = small_layout()
    d = daemon_factory("--metrics-port", str(port), "--host-bytes",
                       str(2 * layout.block_bytes)).start()  # host holds one 2-block prompt
    with KVClient(d.target, layout) as c:
        c.publish(list(range(32)), random_kv(layout, 32))
        assert c.fetch(list(range(32)))[0] == 32  # from host
        c.publish(list(range(100, 132)), random_kv(layout, 32))  # pushes the first to disk
        assert c.fetch(list(range(32)))[0] == 32  # from disk: its read bandwidth is measured
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    missing = undocumented_exports(text, remote=False)  # the remote tier's: test_remote.py
    assert not missing, f"documented in OPERATIONS.md but not exported: {sorted(missing)}"
    assert 'kvstore_tier_hits_total{tier="host"} 2.0' in text
    assert 'kvstore_tier_hits_total{tier="disk"} 2.0' in text
    assert 'kvstore_tier_read_bandwidth_bytes_per_second{tier="disk"}' in text
    assert 'kvstore_rpc_seconds_count{code="OK",method="Reserve"}' in text


def test_health_serving(daemon):
    with grpc.insecure_channel(daemon.target) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_print_config_redacts_the_token():
    r = subprocess.run([sys.executable, "-m", "kvstore.server", "--print-config", "--listen",
                        "127.0.0.1:7000", "--token", "hunter2", "--host-bytes", "2GiB"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    cfg = json.loads(r.stdout)
    assert cfg["token"] == "***" and "hunter2" not in r.stdout
    assert cfg["host_bytes"] == 2 << 30


def test_invalid_config_names_the_option():
    r = subprocess.run([sys.executable, "-m", "kvstore.server", "--print-config", "--host-bytes",
                        "lots"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "host_bytes" in r.stderr


def test_daemon_killed_during_fetch_is_a_miss_within_deadline(daemon_factory):
    d = daemon_factory("--host-bytes", "64MiB", "--disk-bytes", "0").start()
    layout = small_layout(num_layers=16, block_tokens=256)  # 4 MiB blocks
    tokens = list(range(256 * 8))
    kv = random_kv(layout, len(tokens))
    results: list[tuple[float, int]] = []
    with KVClient(d.target, layout, deadline_s=0.5, transfer="stream") as c:
        assert c.publish(tokens, kv) == len(tokens)

        def fetch_loop() -> None:
            for _ in range(50):
                t = time.monotonic()
                n, got = c.fetch(tokens)
                results.append((time.monotonic() - t, n))
                assert n == 0 or same_bytes(got, kv[:, :, :n])

        worker = Worker(target=fetch_loop)
        worker.start()
        wait_until(lambda: any(n for _, n in results), 10, "a fetch served before the kill")
        d.kill()
        worker.result(60)
    assert any(n == 0 for _, n in results), "the kill never hit a fetch"
    assert max(t for t, _ in results) < 0.5 + 0.3


def test_cli_top_shows_rates(daemon):
    layout = small_layout()
    with KVClient(daemon.target, layout) as c:
        c.publish(list(range(32)), random_kv(layout, 32))
    r = kvstore_cli("--target", daemon.target, "top", "--interval", "0.2", "--count", "2")
    assert r.returncode == 0, r.stderr
    assert "rates:" in r.stdout
    assert r.stdout.count("hit rate") == 2


def test_cli_config_check(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text('[server]\nhost-bytes = "2GiB"\ndisk_sync = "never"\n')
    r = kvstore_cli("--json", "config", "check", str(good))
    assert r.returncode == 0
    assert json.loads(r.stdout)["config"]["host_bytes"] == 2 << 30
    bad = tmp_path / "bad.toml"
    bad.write_text('disk_sync = "sometimes"\n')
    r = kvstore_cli("config", "check", str(bad))
    assert r.returncode == 2
    assert "disk_sync" in r.stderr
    # Tenant weights are checked against the tokens file, as the daemon checks them at start.
    tokens = tmp_path / "tenants"
    tokens.write_text("alpha alpha-token-0123456789\n")
    tokens.chmod(0o600)
    weighted = tmp_path / "weighted.toml"
    for weights, ok in (("alpha=3,@unscoped=2", True), ("alpha=3,aplha=2", False)):
        weighted.write_text(f'listen = "127.0.0.1:7070"\ntenant_tokens_file = "{tokens}"\n'
                            f'tenant_weights = "{weights}"\n')
        r = kvstore_cli("config", "check", str(weighted))
        assert (r.returncode == 0) == ok, r.stderr
        assert ok or "does not list 'aplha'" in r.stderr


def test_cli_inspect_lists_namespaces_and_blocks_per_tier(daemon_factory):
    d = daemon_factory("--host-bytes", "64KiB").start()  # 4 blocks of 16 KiB fit in host
    small, other = small_layout(), small_layout(model="other-model")
    with KVClient(d.target, small) as a, KVClient(d.target, other, salt="s") as b:
        a.publish(list(range(128)), random_kv(small, 128))  # 8 blocks: some demoted to disk
        b.publish(list(range(32)), random_kv(other, 32))
        ns_a, ns_b = a.namespace.digest().hex(), b.namespace.digest().hex()
    r = kvstore_cli("--target", d.target, "--json", "inspect")
    assert r.returncode == 0, r.stderr
    got = {n["namespace"]: n for n in json.loads(r.stdout)["namespaces"]}
    assert set(got) == {ns_a, ns_b}
    blocks = {ns: sum(int(t["blocks"]) for t in n["tiers"]) for ns, n in got.items()}
    assert blocks == {ns_a: 8, ns_b: 2}
    assert {t["tier"] for t in got[ns_a]["tiers"]} == {"host", "disk"}
    assert got[ns_b]["layout"]["model"] == "other-model"
    r = kvstore_cli("--target", d.target, "inspect")
    assert r.returncode == 0 and "other-model" in r.stdout and "2 namespaces, 10 blocks" in r.stdout
    # After a restart the blocks on disk are listed; their layout is learnt again on use.
    d.stop()
    d.start()
    r = kvstore_cli("--target", d.target, "inspect")
    assert r.returncode == 0 and "layout not seen since start" in r.stdout, r.stdout
    r = kvstore_cli("--target", f"unix://{d.data_dir}/none.sock", "--timeout", "1", "inspect")
    assert r.returncode == 1 and "UNAVAILABLE" in r.stderr


def test_cli_clear_takes_the_namespace_inspect_prints(daemon_factory):
    # `kvstore inspect` prints a namespace's first 16 hex characters; `kvstore clear
    # --namespace` took only all 64, so an operator could not clear what inspect showed.
    d = daemon_factory().start()
    small, other = small_layout(), small_layout(model="other-model")
    with KVClient(d.target, small) as a, KVClient(d.target, other) as b:
        a.publish(list(range(64)), random_kv(small, 64))
        b.publish(list(range(32)), random_kv(other, 32))
        ns_a = a.namespace.digest().hex()
        shown = kvstore_cli("--target", d.target, "inspect").stdout
        assert ns_a[:16] in shown
        for bad, why in (("abc", "at least 8"), ("zz" * 8, "hex"), ("0" * 16, "no namespace")):
            if ns_a.startswith(bad):
                continue
            r = kvstore_cli("--target", d.target, "clear", "--namespace", bad)
            assert r.returncode == 2 and why in r.stderr, r.stderr
        assert a.lookup(list(range(64))) == 64  # nothing cleared by the refusals
        r = kvstore_cli("--target", d.target, "clear", "--namespace", ns_a[:16])
        assert r.returncode == 0 and "removed 4 blocks" in r.stdout, r.stdout + r.stderr
        assert a.lookup(list(range(64))) == 0 and b.lookup(list(range(32))) == 32


def test_tier_bytes_count_host_reads_and_promotions_into_host(daemon_factory):
    """Host hits served (an SHM lease, a stream over TCP) are host reads, once per block
    served; promotions from disk are host writes. Both stayed 0: `kvstore stats` showed 0 B
    read from host however much it served, and `kvstore top`'s "moved" left it out."""
    port, metrics, token = _free_port(), _free_port(), "s3cret-0123456789abcdef"
    layout = small_layout()
    bb = layout.block_bytes  # 8 KiB: host holds 8 blocks
    d = daemon_factory("--listen", f"127.0.0.1:{port}", "--token", token, "--metrics-port",
                       str(metrics), "--host-bytes", str(8 * bb), "--disk-bytes", "1MiB").start()
    p, q = list(range(64)), list(range(1000, 1128))  # 4 blocks, 8 blocks
    kv_p, kv_q = random_kv(layout, 64), random_kv(layout, 128, seed=1)

    def tiers() -> dict[str, tuple[int, int]]:
        with KVClient(d.target, layout) as c:
            return {t.name: (t.bytes_read, t.bytes_written) for t in c.stats().tiers}

    with KVClient(d.target, layout, transfer="shm") as c:
        assert c.publish(p, kv_p) == 64
        assert tiers()["host"] == (0, 4 * bb)  # published: written, nothing read yet
        n, got = c.fetch(p)
        assert n == 64 and same_bytes(got, kv_p)
    assert tiers()["host"] == (4 * bb, 4 * bb)  # the SHM lease's 4 host blocks
    with KVClient(f"127.0.0.1:{port}", layout, token=token) as tcp:
        assert tcp.streams
        n, got = tcp.fetch(p)
        assert n == 64 and same_bytes(got, kv_p)
    assert tiers()["host"] == (8 * bb, 4 * bb)  # and the 4 streamed over TCP

    with KVClient(d.target, layout, transfer="shm") as c:
        assert c.publish(q, kv_q) == 128  # fills host: p goes down to disk
        before = tiers()
        assert before["host"] == (8 * bb, 12 * bb) and before["disk"][1] >= 4 * bb
        n, got = c.fetch(p)  # from disk: read there, promoted into host
        assert n == 64 and same_bytes(got, kv_p)
        after = tiers()
        assert after["disk"][0] - before["disk"][0] == 4 * bb
        assert after["host"] == (8 * bb, 16 * bb)  # written by the promotions, not read
        assert c.fetch(p)[0] == 64  # from host now
    stats = tiers()
    assert stats["host"] == (12 * bb, 16 * bb)
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics",
                                  timeout=10).read().decode()
    assert f'kvstore_tier_bytes_total{{direction="read",tier="host"}} {12.0 * bb}' in text
    assert f'kvstore_tier_bytes_total{{direction="write",tier="host"}} {16.0 * bb}' in text
    r = kvstore_cli("--target", d.target, "stats")
    host_row = next(line.split() for line in r.stdout.splitlines() if line.startswith("host "))
    assert host_row[-6:-2] == ["96.0", "KiB", "128.0", "KiB"]  # read, written


def test_a_clear_while_a_client_reads_leaves_nothing_behind(daemon_factory):
    """A Clear while a client holds a fetch lease on the blocks (reading them out of the
    daemon's memory): every later lookup misses at once, the reader still copies the bytes
    it was given, and the blocks' space is freed when it lets go. Before, the blocks it
    held survived the Clear and were served again."""
    d = daemon_factory().start()
    layout = small_layout()
    tokens, kv = list(range(64)), random_kv(layout, 64)
    copied: dict[int, torch.Tensor] = {}
    bt = layout.block_tokens
    with KVClient(d.target, layout, transfer="shm") as reader, \
            KVClient(d.target, layout) as other:
        assert reader.publish(tokens, kv) == 64

        def consume(blocks, views, stop):
            assert other.clear() == 4  # while this lease pins all four
            assert other.lookup(tokens) == 0
            copied.update((b, v.clone()) for b, v in zip(blocks, views, strict=True))
            return None

        assert reader.fetch_with(tokens, consume, whole=True) == 64
        assert other.lookup(tokens) == 0
        host = next(t for t in other.stats().tiers if t.name == "host")
        assert (host.blocks, host.used_bytes, host.pinned_blocks) == (0, 0, 0)
        assert sorted(copied) == [0, 1, 2, 3]  # what the lease was given, intact:
        assert all(same_bytes(copied[b], kv[:, :, b * bt : (b + 1) * bt]) for b in copied)
        assert reader.publish(tokens, kv) == 64  # and it can be stored again
        assert other.lookup(tokens) == 64
