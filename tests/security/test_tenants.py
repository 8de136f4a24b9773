"""Tenant isolation (issue 6, item 13): over TCP the tenant comes from the token, not a field.

Tenant A publishes; tenant B sends the very same keys, namespace and even tenant field and
misses; A hits (the positive control). A tenant cannot clear or inspect another's blocks.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from kvstore.client import KVClient
from kvstore.errors import ConfigError
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.server.tenancy import Scope, TokenTable, load_tenant_tokens
from tests.conftest import random_kv, same_bytes, small_layout

TOKEN_A = "alpha-token-0123456789"
TOKEN_B = "bravo-token-0123456789"
ADMIN = "admin-token-0123456789"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tokens_file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    p = tmp_path / "tenants.txt"
    p.write_text(text)
    os.chmod(p, mode)
    return p


@pytest.fixture
def tenant_daemon(daemon_factory, tmp_path):
    port = _free_port()
    f = _tokens_file(tmp_path, f"# tenant token\nalpha {TOKEN_A}\nbravo {TOKEN_B}\n")
    d = daemon_factory("--listen", f"127.0.0.1:{port}", "--token", ADMIN,
                       "--tenant-tokens-file", str(f)).start()
    return d, f"127.0.0.1:{port}"


@pytest.mark.integration
def test_no_hit_across_tenants_whatever_the_request_says(tenant_daemon):
    daemon, tcp = tenant_daemon
    layout = small_layout()
    tokens = list(range(64))
    kv = random_kv(layout, 64)
    # Both clients claim the same tenant field: the daemon goes by the token alone.
    with KVClient(tcp, layout, token=TOKEN_A, tenant="shared", deadline_s=5) as a:
        assert a.publish(tokens, kv) == 64
        n, got = a.fetch(tokens)
        assert n == 64 and same_bytes(got, kv)  # positive control: a hit within one tenant
        keys = a.keys(tokens)
    with KVClient(tcp, layout, token=TOKEN_B, tenant="shared", deadline_s=5) as b:
        assert b.keys(tokens) == keys  # identical requests on the wire...
        assert b.lookup(tokens) == 0  # ...and no hit, no probe by timing
        assert b.held(tokens) == [False] * 4  # nor block by block
        assert b.fetch(tokens) == (0, None)
        assert b.clear() == 0  # B clearing "the same" namespace removes none of A's blocks
        other = random_kv(layout, 64, seed=7)
        assert b.publish(tokens, other) == 64  # B's own copy, beside A's
    # Unscoped callers (Unix socket, admin token) see the tenants' blocks under other keys.
    with KVClient(daemon.target, layout, tenant="shared") as local:
        assert local.lookup(tokens) == 0
    with KVClient(tcp, layout, token=TOKEN_A, tenant="shared", deadline_s=5) as a:
        n, got = a.fetch(tokens)
        assert n == 64 and same_bytes(got, kv)  # A's blocks untouched by B's publish/clear
    with KVClient(tcp, layout, token=TOKEN_B, tenant="shared", deadline_s=5) as b:
        n, got = b.fetch(tokens)
        assert n == 64 and same_bytes(got, other)


@pytest.mark.integration
def test_tenant_cannot_clear_all_or_inspect_others(tenant_daemon):
    _, tcp = tenant_daemon
    layout = small_layout()
    with KVClient(tcp, layout, token=TOKEN_A, deadline_s=5) as a:
        a.publish(list(range(32)), random_kv(layout, 32))
        ns_a = a.namespace.digest()
    with KVClient(tcp, layout, token=TOKEN_B, salt="b", deadline_s=5) as b:
        b.publish(list(range(48)), random_kv(layout, 48))
    channel = grpc.insecure_channel(tcp)
    stub = pb_grpc.KVStoreStub(channel)
    md_b = (("authorization", f"Bearer {TOKEN_B}"),)
    with pytest.raises(grpc.RpcError) as e:
        stub.Clear(pb.ClearRequest(all=True), metadata=md_b, timeout=5)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    mine = stub.Inspect(pb.InspectRequest(), metadata=md_b, timeout=5)
    assert [n.tenant for n in mine.namespaces] == ["bravo"]
    assert sum(t.blocks for t in mine.namespaces[0].tiers) == 3
    assert ns_a not in {n.namespace for n in mine.namespaces}
    admin = stub.Inspect(pb.InspectRequest(),
                         metadata=(("authorization", f"Bearer {ADMIN}"),), timeout=5)
    assert sorted(n.tenant for n in admin.namespaces) == ["alpha", "bravo"]
    # The admin token may clear everything.
    cleared = stub.Clear(pb.ClearRequest(all=True),
                         metadata=(("authorization", f"Bearer {ADMIN}"),), timeout=5)
    assert cleared.removed == 5
    channel.close()


@pytest.mark.integration
def test_unknown_token_is_unauthenticated(tenant_daemon):
    _, tcp = tenant_daemon
    channel = grpc.insecure_channel(tcp)
    with pytest.raises(grpc.RpcError) as e:
        pb_grpc.KVStoreStub(channel).Inspect(
            pb.InspectRequest(), metadata=(("authorization", "Bearer alpha"),), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    channel.close()


def _tenant_bytes(port: int, metric: str = "kvstore_tier_tenant_bytes",
                  ) -> dict[tuple[str, str], float]:
    """`metric` (per tier and tenant) from the daemon's /metrics: (tier, tenant) -> bytes."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = re.findall(rf'^{metric}\{{tenant="([^"]*)",tier="([^"]*)"\}} (\S+)$', text, re.M)
    return {(tier, tenant): float(v) for tenant, tier, v in found}


def _tiers(tcp: str, token: str, client: KVClient, tokens: list[int]) -> list[str]:
    """The tier each block of `tokens` is found in, as the tenant of `token` sees it."""
    with grpc.insecure_channel(tcp) as channel:
        reply = pb_grpc.KVStoreStub(channel).Lookup(
            pb.LookupRequest(namespace=client.namespace.digest(), keys=client.keys(tokens)),
            metadata=(("authorization", f"Bearer {token}"),), timeout=10)
    return list(reply.tiers)


@pytest.mark.integration
@pytest.mark.parametrize("weights", ["", "bravo=3"])
def test_a_tenant_flooding_the_daemon_leaves_another_its_share(daemon_factory, tmp_path,
                                                               weights):
    """Alpha publishes three times what host and disk hold together; bravo, holding 3/4 of
    host, gives way to half of it (its deepest blocks, demoted to disk) and no further: every
    block of its prompt still hits, byte for byte. Before tenants shared tiers fairly, alpha's
    flood evicted all of bravo's blocks (host, then disk). With `--tenant-weights bravo=3`
    3/4 of host is bravo's share: it keeps every block there."""
    port, metrics_port = _free_port(), _free_port()
    f = _tokens_file(tmp_path, f"alpha {TOKEN_A}\nbravo {TOKEN_B}\n")
    daemon_factory("--listen", f"127.0.0.1:{port}", "--tenant-tokens-file", str(f),
                   "--host-bytes", "8MiB", "--disk-bytes", "32MiB",
                   "--metrics-port", str(metrics_port),
                   *(("--tenant-weights", weights) if weights else ())).start()
    tcp = f"127.0.0.1:{port}"
    layout = small_layout(num_layers=4, num_kv_heads=4, head_dim=64)  # 128 KiB blocks
    assert layout.block_bytes == 128 << 10
    host_blocks = (8 << 20) // layout.block_bytes  # 64
    prompt = list(range(48 * 16))  # 48 blocks: 3/4 of host
    kv = random_kv(layout, len(prompt), seed=3)
    with KVClient(tcp, layout, token=TOKEN_B, deadline_s=10) as b:
        assert b.publish(prompt, kv) == len(prompt)
        assert _tiers(tcp, TOKEN_B, b, prompt) == ["host"] * 48
    with KVClient(tcp, layout, token=TOKEN_A, deadline_s=10) as a:
        flood = 32 * 16  # 32 blocks a prompt, 30 prompts: 960 blocks, 120 MiB
        for r in range(30):
            tokens = [10**6 + r * flood + i for i in range(flood)]
            assert a.publish(tokens, random_kv(layout, flood, seed=r)) == flood
        assert a.lookup(tokens) == flood  # alpha's own last prompt: the positive control
    with KVClient(tcp, layout, token=TOKEN_B, deadline_s=10) as b:
        tiers = _tiers(tcp, TOKEN_B, b, prompt)
        in_host = tiers.count("host")
        assert tiers == ["host"] * in_host + ["disk"] * (48 - in_host), tiers
        if weights:
            assert in_host == 48, tiers  # within its 3/4 of host: all of it
        else:
            assert in_host >= host_blocks // 2, tiers  # its half of host, its first blocks
        shares = _tenant_bytes(metrics_port)  # what an operator sees, before the fetch
        assert shares[("host", "bravo")] == in_host * layout.block_bytes
        assert shares[("host", "alpha")] == (host_blocks - in_host) * layout.block_bytes  # full
        on_disk = (48 - in_host) * (layout.block_bytes + 4096)  # a header page each
        assert shares.get(("disk", "bravo"), 0) == on_disk
        fair = _tenant_bytes(metrics_port, "kvstore_tier_tenant_share_bytes")
        # Host's owners: alpha, bravo and the unscoped callers (holding nothing: not counted).
        assert fair[("host", "bravo")] == (6 if weights else 4) << 20
        assert fair[("host", "alpha")] == (2 if weights else 4) << 20
        n, got = b.fetch(prompt)
        assert n == len(prompt) and same_bytes(got, kv)


@pytest.mark.integration
def test_weights_of_tenants_the_tokens_file_does_not_list_stop_startup(daemon_factory,
                                                                       tmp_path):
    """A misspelt tenant in `tenant_weights` would weigh nothing, silently: refused."""
    f = _tokens_file(tmp_path, f"alpha {TOKEN_A}\n")
    d = daemon_factory("--listen", f"127.0.0.1:{_free_port()}", "--tenant-tokens-file", str(f),
                       "--tenant-weights", "alpha=2,aplha=3")
    with pytest.raises(RuntimeError, match=r"tenant_weights: .*does not list 'aplha'"):
        d.start(timeout=15)


@pytest.mark.integration
def test_world_readable_tokens_file_stops_startup(daemon_factory, tmp_path):
    f = _tokens_file(tmp_path, f"alpha {TOKEN_A}\n", mode=0o644)
    d = daemon_factory("--listen", f"127.0.0.1:{_free_port()}", "--tenant-tokens-file", str(f))
    with pytest.raises(RuntimeError, match=r"tenant_tokens_file.*chmod 600"):
        d.start(timeout=15)


def test_print_config_takes_tenants_without_admin_token(tmp_path):
    f = _tokens_file(tmp_path, f"alpha {TOKEN_A}\n")
    r = subprocess.run([sys.executable, "-m", "kvstore.server", "--print-config", "--listen",
                        "127.0.0.1:7001", "--tenant-tokens-file", str(f)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tenant_tokens_file"] == str(f)
    assert TOKEN_A not in r.stdout


@pytest.mark.parametrize(("text", "match"), [
    ("alpha\n", "expected `TENANT TOKEN`"),
    ("al/pha " + TOKEN_A + "\n", "tenant name"),
    ("alpha short\n", "shorter than 16"),
    (f"alpha {TOKEN_A}\nbravo {TOKEN_A}\n", "already given to 'alpha'"),
    ("# nothing\n", "names no tenants"),
])
def test_tokens_file_errors_name_the_problem(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        load_tenant_tokens(_tokens_file(tmp_path, text))


def test_tenants_whose_tags_collide_are_refused(tmp_path, monkeypatch):
    """Two tenants whose 4-byte tags match (1 in 2^32 a pair: forced here) would share one
    eviction share and see each other's Stats: the tokens file is refused, naming both."""
    import kvstore.server.tenancy as tenancy

    monkeypatch.setattr(tenancy, "owner_tag", lambda tenant: b"\xa7kvTsame")
    with pytest.raises(ConfigError, match="'alpha' and 'bravo' have the same 4-byte tag"):
        load_tenant_tokens(_tokens_file(tmp_path, f"alpha {TOKEN_A}\nbravo {TOKEN_B}\n"))


def test_missing_tokens_file(tmp_path):
    with pytest.raises(ConfigError, match="tenant_tokens_file: cannot read"):
        load_tenant_tokens(tmp_path / "absent")


def test_a_tokens_file_that_is_not_text_is_a_config_error(tmp_path):
    """Not a raw UnicodeDecodeError: at start that was a traceback, at a reload (SIGHUP) no
    `tokens not reloaded` line."""
    f = _tokens_file(tmp_path, "")
    f.write_bytes(b"alpha \xff\xfe" + TOKEN_A.encode() + b"\n")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_tenant_tokens(f)


def test_token_table_maps_tokens_to_tenants():
    table = TokenTable(ADMIN, {TOKEN_A: "alpha", TOKEN_A + "x": "alpha", TOKEN_B: "bravo"})
    assert table.tenant_for(f"Bearer {TOKEN_A}".encode()) == "alpha"
    assert table.tenant_for(f"Bearer {TOKEN_A}x".encode()) == "alpha"  # rotation: two tokens
    assert table.tenant_for(f"Bearer {TOKEN_B}".encode()) == "bravo"
    assert table.tenant_for(f"Bearer {ADMIN}".encode()) == ""
    assert table.tenant_for(TOKEN_A.encode()) is None  # no "Bearer "
    assert table.tenant_for(b"") is None
    with pytest.raises(ConfigError, match="admin token is also a tenant"):
        TokenTable(TOKEN_A, {TOKEN_A: "alpha"})


def test_scope_separates_tenants_and_keeps_unscoped_calls_as_sent():
    key, ns = bytes(range(32)), bytes(32)
    a, b, none = Scope("alpha"), Scope("bravo"), Scope("")
    assert none.keys([key]) == [key] and none.namespace(ns) == ns
    assert a.keys([key]) != b.keys([key]) and a.keys([key])[0] != key
    assert a.namespace(ns) != b.namespace(ns)
    assert a.keys([key]) == Scope("alpha").keys([key])  # deterministic
    assert a.namespace(b"short") == b"short"  # validation still sees what was sent


def _log_of(daemon) -> str:
    """The daemon's log so far ("" before its start has created it)."""
    try:
        return daemon.log.read_text()
    except FileNotFoundError:
        return ""


def _wait_log(daemon, text: str, within_s: float = 10.0, count: int = 1) -> None:
    deadline = time.monotonic() + within_s
    while _log_of(daemon).count(text) < count:
        assert time.monotonic() < deadline, f"{text!r} not logged: {_log_of(daemon)[-2000:]}"
        time.sleep(0.05)


@pytest.mark.integration
def test_sighup_reloads_the_tokens_and_a_bad_file_changes_nothing(daemon_factory, tmp_path):
    """A leaked token is revoked without a restart (the host tier's blocks stay): SIGHUP
    reads the tokens file again. The revoked token is refused at its next call, on a
    connection opened before; the tenant's new token finds the blocks its old one published;
    a tenant added is admitted. A file that fails a check (readable by others) changes
    nothing; one that leaves out a tenant `tenant_weights` names revokes it all the same,
    with a warning (that used to fail the reload: a weighted tenant could not be revoked)."""
    import signal

    port = _free_port()
    tcp = f"127.0.0.1:{port}"
    f = _tokens_file(tmp_path, f"alpha {TOKEN_A}\n")
    d = daemon_factory("--listen", tcp, "--tenant-tokens-file", str(f),
                       "--tenant-weights", "alpha=2").start()
    layout = small_layout()
    tokens = list(range(64))
    kv = random_kv(layout, 64)
    new_a = "alpha-token-rotated-0123"
    old_a = KVClient(tcp, layout, token=TOKEN_A, deadline_s=5)
    try:
        assert old_a.publish(tokens, kv) == 64
        f.write_text(f"alpha {new_a}\nbravo {TOKEN_B}\n")
        d.proc.send_signal(signal.SIGHUP)
        _wait_log(d, "tokens reloaded: 2 tokens, 2 tenants; added bravo")
        assert d.proc.poll() is None, "SIGHUP ended the daemon"
        channel = grpc.insecure_channel(tcp)
        stub = pb_grpc.KVStoreStub(channel)
        with pytest.raises(grpc.RpcError) as e:  # the revoked token
            stub.Inspect(pb.InspectRequest(), metadata=(("authorization", f"Bearer {TOKEN_A}"),),
                         timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert old_a.lookup(tokens) == 0  # its client, connected before: refused, a miss
    finally:
        old_a.close()
    with KVClient(tcp, layout, token=new_a, deadline_s=5) as a:
        n, got = a.fetch(tokens)
        assert n == 64 and same_bytes(got, kv), "the new token does not find alpha's blocks"
    with KVClient(tcp, layout, token=TOKEN_B, deadline_s=5) as b:
        assert b.lookup(tokens) == 0 and b.publish(tokens, kv) == 64
    mine = stub.Inspect(pb.InspectRequest(), metadata=(("authorization", f"Bearer {TOKEN_B}"),),
                        timeout=5)
    assert [n.tenant for n in mine.namespaces] == ["bravo"]  # named, not "?<tag>"
    # A file that fails a check: the tokens in use stay.
    f.write_text(f"alpha {new_a}\n")
    os.chmod(f, 0o644)
    d.proc.send_signal(signal.SIGHUP)
    _wait_log(d, "accessible by group or others")
    _wait_log(d, "tokens not reloaded")
    for token in (new_a, TOKEN_B):
        with KVClient(tcp, layout, token=token, deadline_s=5) as c:
            assert c.lookup(tokens) == 64, f"a refused reload changed {token[:5]}'s access"
    # The weighted tenant left out: revoked, and the weights named in a warning.
    f.write_text(f"bravo {TOKEN_B}\n")
    os.chmod(f, 0o600)
    d.proc.send_signal(signal.SIGHUP)
    _wait_log(d, "tenant_weights names 'alpha', which the tokens file no longer lists")
    _wait_log(d, "tokens reloaded: 1 tokens, 1 tenants; removed alpha")
    with pytest.raises(grpc.RpcError) as e:
        stub.Inspect(pb.InspectRequest(), metadata=(("authorization", f"Bearer {new_a}"),),
                     timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with KVClient(tcp, layout, token=TOKEN_B, deadline_s=5) as b:
        assert b.lookup(tokens) == 64
    channel.close()


@pytest.mark.integration
def test_a_sighup_while_the_daemon_starts_does_not_end_it(daemon_factory, tmp_path):
    """Config management may reload (SIGHUP) a daemon that is still starting (imports, the
    arena reserved, a disk index rebuilt): it must not die of SIGHUP's default action, and
    the tokens are read again once it serves."""
    import signal
    import threading

    f = _tokens_file(tmp_path, f"alpha {TOKEN_A}\n")
    d = daemon_factory("--listen", f"127.0.0.1:{_free_port()}", "--tenant-tokens-file",
                       str(f), "--host-bytes", "512MiB")  # a reservation that takes a while
    started: list[BaseException | None] = []

    def start() -> None:
        try:
            d.start()
            started.append(None)
        except BaseException as e:  # reported by the assertion below
            started.append(e)

    t = threading.Thread(target=start)
    t.start()
    _wait_log(d, "malloc:")  # its first line: logging set up, the daemon being made
    assert d.proc is not None
    d.proc.send_signal(signal.SIGHUP)
    t.join(60)
    assert started == [None], f"the daemon did not start: {started}"
    assert d.proc.poll() is None, "SIGHUP during start-up ended the daemon"
    _wait_log(d, "tokens reloaded: 1 tokens, 1 tenants")


def _k8s_secret(secrets: Path, version: str, text: str | None) -> None:
    """Publish a version of a Kubernetes-style secret volume: `tenants` -> `..data/tenants`,
    `..data` -> `..VERSION`, swapped atomically (as the kubelet does). `text` None: a FIFO
    (mode 0600) in the file's place."""
    d = secrets / f"..{version}"
    d.mkdir(parents=True)
    if text is None:
        os.mkfifo(d / "tenants", 0o600)
    else:
        _tokens_file(d, text).rename(d / "tenants")
    (secrets / "..data_tmp").symlink_to(d.name)
    os.replace(secrets / "..data_tmp", secrets / "..data")
    if not (secrets / "tenants").is_symlink():
        (secrets / "tenants").symlink_to("..data/tenants")


def _stats_within(daemon, seconds: float) -> None:
    """A Stats call over the Unix socket answers within `seconds`: the event loop serves."""
    with grpc.insecure_channel(daemon.target) as channel:
        pb_grpc.KVStoreStub(channel).Stats(pb.StatsRequest(), timeout=seconds)


@pytest.mark.integration
def test_a_fifo_swapped_in_at_sighup_leaves_the_daemon_serving(daemon_factory, tmp_path):
    """The tokens file, mounted as Kubernetes mounts secrets (symlinks), becomes a FIFO and
    the daemon gets SIGHUP: the reload refuses it (it used to open it on the event loop and
    wait there for a writer: every call stalled, Stats included). The tokens in use stay; a
    regular file swapped in later is reloaded through the same symlinks."""
    import signal

    secrets = tmp_path / "secrets"
    _k8s_secret(secrets, "v1", f"alpha {TOKEN_A}\n")
    tcp = f"127.0.0.1:{_free_port()}"
    d = daemon_factory("--listen", tcp, "--tenant-tokens-file", str(secrets / "tenants")).start()
    layout = small_layout()
    tokens = list(range(64))
    with KVClient(tcp, layout, token=TOKEN_A, deadline_s=5) as a:
        assert a.publish(tokens, random_kv(layout, 64)) == 64
    _k8s_secret(secrets, "v2", None)
    d.proc.send_signal(signal.SIGHUP)
    time.sleep(0.5)  # the signal handled: before the fix, the loop is now stuck in open()
    _stats_within(d, 2)
    with KVClient(tcp, layout, token=TOKEN_A, deadline_s=2) as a:
        assert a.lookup(tokens) == 64, "the old token lost its access"
    _wait_log(d, "tenants is a FIFO, not a regular file")
    _wait_log(d, "tokens not reloaded")
    _k8s_secret(secrets, "v3", f"bravo {TOKEN_B}\n")
    d.proc.send_signal(signal.SIGHUP)
    _wait_log(d, "tokens reloaded: 1 tokens, 1 tenants; added bravo; removed alpha")
    with KVClient(tcp, layout, token=TOKEN_B, deadline_s=5) as b:
        assert b.lookup(tokens) == 0 and b.publish(tokens, random_kv(layout, 64)) == 64


def _bad_tokens_file(f: Path, kind: str) -> str:
    """Put a bad `kind` of file at `f`; the message its refusal logs."""
    f.unlink(missing_ok=True)
    if kind == "oversized":  # valid lines, then a comment past 1 MiB
        _tokens_file(f.parent, f"alpha {TOKEN_A}\n# {'x' * (1 << 20)}\n").rename(f)
        return f"tenant_tokens_file: {f} is larger than 1 MiB"
    if kind == "fifo":
        os.mkfifo(f, 0o600)
        return f"tenant_tokens_file: {f} is a FIFO, not a regular file"
    f.symlink_to("/dev/zero")  # its mode is 0666, but it was read to the end first: never
    return f"tenant_tokens_file: {f} is a character device, not a regular file"


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["oversized", "dev_zero"])
def test_an_oversized_or_device_tokens_file_is_refused_at_sighup(daemon_factory, tmp_path,
                                                                 kind):
    import signal

    f = _tokens_file(tmp_path, f"alpha {TOKEN_A}\n")
    tcp = f"127.0.0.1:{_free_port()}"
    d = daemon_factory("--listen", tcp, "--tenant-tokens-file", str(f)).start()
    message = _bad_tokens_file(f, kind)
    d.proc.send_signal(signal.SIGHUP)
    _wait_log(d, f"SIGHUP: tokens not reloaded, the ones in use stay: {message}")
    _stats_within(d, 2)
    layout = small_layout()
    with KVClient(tcp, layout, token=TOKEN_A, deadline_s=5) as a:
        assert a.publish(list(range(16)), random_kv(layout, 16)) == 16


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["oversized", "fifo", "dev_zero"])
def test_an_oversized_fifo_or_device_tokens_file_stops_startup(daemon_factory, tmp_path,
                                                               kind):
    """With the one-line error of any file that fails a check: not a hang on the FIFO, nor
    memory filled from /dev/zero, nor a daemon started with a 1 MiB+ file."""
    f = tmp_path / "tenants.txt"
    message = _bad_tokens_file(f, kind)
    d = daemon_factory("--listen", f"127.0.0.1:{_free_port()}", "--tenant-tokens-file", str(f))
    with pytest.raises(RuntimeError, match="did not start") as e:
        d.start(timeout=20)
    assert f"kvstore-server: {message}" in str(e.value)
    assert "Traceback" not in str(e.value)


def test_the_admin_token_file_gets_the_same_checks(tmp_path):
    """`token_file` is read by the same code (the CLI's `--token-file` too). /dev/null, not
    /dev/zero: the code before the fix read a device to its end."""
    from kvstore.config import read_token_file

    f = tmp_path / "admin.token"
    f.write_text(ADMIN + "\n" + " " * (1 << 20))
    os.chmod(f, 0o600)
    with pytest.raises(ConfigError, match=f"^token_file: {re.escape(str(f))} is larger than 1 MiB"):
        read_token_file(f)
    f.unlink()
    f.symlink_to("/dev/null")
    with pytest.raises(ConfigError, match=f"^token_file: {re.escape(str(f))} is a "
                                          "character device, not a regular file$"):
        read_token_file(f)
    real = tmp_path / "..data" / "admin.token"
    real.parent.mkdir()
    real.write_text(ADMIN + "\n")
    os.chmod(real, 0o600)
    f.unlink()
    f.symlink_to(real)  # a secret mounted as a symlink works
    assert read_token_file(f) == ADMIN


@pytest.mark.timeout(20)
def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    from kvstore.config import read_token_file

    f = tmp_path / "fifo"
    os.mkfifo(f, 0o600)
    with pytest.raises(ConfigError, match=f"^tenant_tokens_file: {re.escape(str(f))} is a FIFO"):
        load_tenant_tokens(f)
    with pytest.raises(ConfigError, match=f"^token_file: {re.escape(str(f))} is a FIFO"):
        read_token_file(f)


def test_a_reload_whose_reading_hangs_gives_up_and_reads_no_more_until_it_returns(monkeypatch):
    """A hung secrets mount (NFS, FUSE), simulated: the reload's reading, off the event loop,
    gives up after `RELOAD_READ_TIMEOUT_S` (a SIGHUP then changes nothing), and while it
    hangs a later reload starts no second reading (no thread piled up per SIGHUP)."""
    import asyncio
    import threading

    import kvstore.server.app as app
    from kvstore.config import ServerConfig

    monkeypatch.setattr(app, "RELOAD_READ_TIMEOUT_S", 0.2)
    release = threading.Event()
    reads: list[int] = []
    daemon = app.Daemon.__new__(app.Daemon)  # no tiers, arena or servers: reading alone
    daemon.config = ServerConfig(listen="127.0.0.1:7070", tenant_tokens_file="/mnt/tenants")
    daemon._reader = None
    table = TokenTable(tenant_tokens={TOKEN_A: "alpha"})

    def hung_read() -> TokenTable:
        reads.append(1)
        release.wait(10)
        return table

    monkeypatch.setattr(daemon, "_token_table", hung_read)

    async def reloads() -> None:
        with pytest.raises(ConfigError, match=r"^reading /mnt/tenants took over 0\.2 s"):
            await daemon._read_token_table()
        with pytest.raises(ConfigError, match="previous reload's reading of /mnt/tenants has "
                                              "not returned yet"):
            await daemon._read_token_table()
        release.set()
        assert daemon._reader is not None
        daemon._reader.join(5)
        assert await daemon._read_token_table() is table

    asyncio.run(reloads())
    assert len(reads) == 2
