"""Protocol fuzzing against the real gRPC API (item 12), with hypothesis.

Every request a client can send is generated: raw bytes, structurally valid messages with
hostile values (wrong key and namespace sizes, absurd or zero layout fields, unknown dtypes and
enum values, empty and oversized batches, random leases), serialized messages cut short,
messages over the size limit, Publish streams with chunks out of order, overlapping or past
their block. Pass:
- every call ends OK (a valid request), INVALID_ARGUMENT or RESOURCE_EXHAUSTED (NOT_FOUND for a
  Commit naming no lease); never INTERNAL, UNKNOWN, a timeout or a crash;
- the daemon serves correctly afterwards and logged no internal error;
- nothing is allocated before sizes are validated: the daemon's own (anonymous) memory grows by
  less than `MEM_BUDGET` over the whole run, including requests that claim gigabyte blocks and
  thousands of keys; once leases expire nothing is left pinned or in flight.
`KV_SOAK_S` makes it run for that many seconds (new seeds each round).
"""

from __future__ import annotations

import itertools
import socket
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is a dev dependency")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvstore.client import KVClient  # noqa: E402
from kvstore.layout import DTYPE_BYTES  # noqa: E402
from kvstore.proto import kvstore_pb2 as pb  # noqa: E402
from kvstore.server.process import DaemonProcess  # noqa: E402
from tests.conftest import random_kv, same_bytes, small_layout  # noqa: E402
from tests.reliability import (  # noqa: E402
    SOAK_S,
    CapacityWatch,
    layout_pb,
    rss_bytes,
    soak_record,
    stats,
    wait_quiescent,
)

pytestmark = pytest.mark.integration
SERVICE = pb.DESCRIPTOR.services_by_name["KVStore"]
SHAPES = {m.name: (m.client_streaming, m.server_streaming, getattr(pb, m.input_type.name))
          for m in SERVICE.methods}
OK_CODES = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.RESOURCE_EXHAUSTED}
MAX_MESSAGE = 1 << 20
MEM_BUDGET = 48 << 20
LEASE_S = 1.0
LAYOUT = small_layout()
EXAMPLES = 150


# ---- strategies
def u32() -> st.SearchStrategy[int]:
    return st.one_of(st.integers(0, 8), st.sampled_from([16, 64, 128, 256]),
                     st.integers(0, 2**32 - 1))


def layouts() -> st.SearchStrategy[pb.Layout]:
    hostile = st.builds(
        pb.Layout, model=st.text(max_size=12), num_layers=u32(), num_kv_heads=u32(),
        head_dim=u32(), dtype=st.sampled_from([*DTYPE_BYTES, "", "float64", "bf16", "\x00"]),
        block_tokens=u32(), model_revision=st.text(max_size=8),
        kv_kind=st.sampled_from(["", "kv", "mla", "KV", "x"]), tp_rank=u32(), tp_size=u32(),
        pp_rank=u32(), pp_size=u32())
    huge = st.just(pb.Layout(model="huge", num_layers=64, num_kv_heads=32, head_dim=256,
                             dtype="float32", block_tokens=512))  # 1 GiB blocks: valid, absurd
    return st.one_of(st.just(layout_pb(LAYOUT)), hostile, huge, st.just(pb.Layout()))


class Known:
    """Keys and namespace of blocks really stored, so some requests reach the store."""

    keys: list[bytes] = []
    namespace = b""


def key_lists() -> st.SearchStrategy[list[bytes]]:
    return st.one_of(
        st.lists(st.sampled_from(range(8)), max_size=6).map(
            lambda ix: [Known.keys[i % len(Known.keys)] for i in ix]),
        st.lists(st.binary(min_size=32, max_size=32), max_size=6),
        st.lists(st.binary(min_size=0, max_size=40), max_size=6),
        st.integers(4096, 4200).map(lambda n: [bytes(32)] * n),  # at and past the limit
        st.just([]))


def namespaces() -> st.SearchStrategy[bytes]:
    return st.one_of(st.just(b"").map(lambda _: Known.namespace),
                     st.binary(min_size=32, max_size=32), st.binary(max_size=40))


leases = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2, 3]))


def unary_messages() -> st.SearchStrategy[tuple[str, bytes]]:
    msgs = st.one_of(
        st.builds(pb.InfoRequest).map(lambda m: ("Info", m)),
        st.builds(pb.LookupRequest, namespace=namespaces(), keys=key_lists()).map(
            lambda m: ("Lookup", m)),
        st.builds(pb.FetchRequest, namespace=namespaces(), layout=layouts(), keys=key_lists(),
                  transfer=st.integers(0, 3), prior_keys=key_lists()).map(
            lambda m: ("Fetch", m)),
        st.builds(pb.ReserveRequest, namespace=namespaces(), layout=layouts(),
                  keys=key_lists(), prior_keys=key_lists()).map(lambda m: ("Reserve", m)),
        st.builds(pb.CommitRequest, lease_id=leases).map(lambda m: ("Commit", m)),
        st.builds(pb.ReleaseRequest, lease_id=leases).map(lambda m: ("Release", m)),
        st.builds(pb.StatsRequest).map(lambda m: ("Stats", m)),
        st.builds(pb.ClearRequest, namespace=st.one_of(st.just(b""), st.binary(max_size=40)),
                  all=st.booleans()).map(
            lambda m: ("Clear", m)))
    return msgs.map(lambda nm: (nm[0], nm[1].SerializeToString()))


def publish_streams() -> st.SearchStrategy[list[bytes]]:
    first = st.builds(pb.PublishChunk, namespace=namespaces(), layout=layouts(),
                      keys=key_lists(), prior_keys=key_lists())
    size = LAYOUT.block_bytes
    chunk = st.builds(
        pb.PublishChunk, block_index=st.one_of(st.integers(0, 3), u32()),
        chunk_offset=st.one_of(st.sampled_from([0, size // 2, size, size - 1]),
                               st.integers(0, 2**64 - 1)),
        data=st.one_of(st.just(b""), st.binary(max_size=64),
                       st.sampled_from([size // 2, size, size + 1]).map(lambda n: b"\x5a" * n)))
    return st.tuples(first, st.lists(chunk, max_size=5)).map(
        lambda fc: [m.SerializeToString() for m in (fc[0], *fc[1])])


# ---- calls with raw bytes
Metadata = tuple[tuple[str, str], ...] | None


def raw_call(channel: grpc.Channel, method: str, payload: bytes | list[bytes],
             metadata: Metadata = None) -> grpc.RpcError | None:
    """Send `payload` (serialized messages) to `method`; the error it ended with, if any."""
    path = f"/{SERVICE.full_name}/{method}"
    client_stream, server_stream, _ = SHAPES[method]
    try:
        if client_stream:
            msgs = payload if isinstance(payload, list) else [payload]
            channel.stream_unary(path)(iter(msgs), timeout=10, metadata=metadata)
        elif server_stream:
            for _ in channel.unary_stream(path)(payload, timeout=10, metadata=metadata):
                pass
        else:
            channel.unary_unary(path)(payload, timeout=10, metadata=metadata)
    except grpc.RpcError as e:
        return e
    return None


def call(channel: grpc.Channel, method: str, payload: bytes | list[bytes],
         metadata: Metadata = None) -> grpc.StatusCode:
    error = raw_call(channel, method, payload, metadata)
    return grpc.StatusCode.OK if error is None else error.code()


@pytest.fixture
def fuzz_daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path / "fuzz", "--host-bytes", "8MiB", "--disk-bytes", "32MiB",
                      "--max-message-bytes", str(MAX_MESSAGE), "--lease-timeout-s",
                      str(LEASE_S)).start()
    yield d
    d.kill()


TENANT_TOKEN = "fuzzing-tenant-0123456789"


@pytest.fixture(params=["unix", "tenant-tcp"])
def fuzz_target(request, tmp_path: Path) -> Iterator[tuple[DaemonProcess, str, Metadata]]:
    """The daemon, where the fuzzer connects, and its metadata: the Unix socket, or TCP as a
    tenant (its calls go through the token interceptor and the tenant's key scoping)."""
    args = ["--host-bytes", "8MiB", "--disk-bytes", "32MiB", "--max-message-bytes",
            str(MAX_MESSAGE), "--lease-timeout-s", str(LEASE_S)]
    metadata: Metadata = None
    if request.param == "tenant-tcp":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            tcp = f"127.0.0.1:{s.getsockname()[1]}"
        tokens = tmp_path / "tenants"
        tokens.write_text(f"fuzzer {TENANT_TOKEN}\n")
        tokens.chmod(0o600)
        args += ["--listen", tcp, "--tenant-tokens-file", str(tokens)]
        metadata = (("authorization", f"Bearer {TENANT_TOKEN}"),)
    d = DaemonProcess(tmp_path / "fuzz", *args).start()
    yield d, (tcp if metadata else d.target), metadata
    d.kill()


def test_fuzzed_requests_get_clear_statuses_and_the_daemon_survives(fuzz_target):
    d, target, metadata = fuzz_target
    tokens = list(range(128))
    kv = random_kv(LAYOUT, 128)
    with KVClient(d.target, LAYOUT, deadline_s=5) as c:
        assert c.publish(tokens, kv) == 128
        Known.keys, Known.namespace = c.keys(tokens), c.namespace.digest()
    anon0 = rss_bytes(d.proc.pid)["RssAnon"]
    codes: Counter[str] = Counter()
    bad: list[str] = []
    channel = grpc.insecure_channel(target, options=[
        ("grpc.max_send_message_length", 4 * MAX_MESSAGE)])

    def check(method: str, payload: bytes | list[bytes]) -> None:
        code = call(channel, method, payload, metadata)
        codes[f"{method}:{code.name}"] += 1
        allowed = OK_CODES | ({grpc.StatusCode.NOT_FOUND} if method == "Commit" else set())
        if metadata and method == "Clear":  # a tenant's Clear(all) is refused
            allowed |= {grpc.StatusCode.PERMISSION_DENIED}
        if metadata and method in ("Reserve", "Fetch"):  # zero-copy is for the Unix socket
            allowed |= {grpc.StatusCode.PERMISSION_DENIED}
        if code not in allowed:
            bad.append(f"{method} -> {code.name}: {payload!r:.200}")

    fuzz = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))

    @fuzz
    @given(st.sampled_from(sorted(SHAPES)), st.binary(max_size=200))
    def raw_bytes(method: str, payload: bytes) -> None:
        check(method, payload)

    @fuzz
    @given(unary_messages())
    def messages(msg: tuple[str, bytes]) -> None:
        check(*msg)

    @fuzz
    @given(unary_messages(), st.data())
    def truncated(msg: tuple[str, bytes], data: st.DataObject) -> None:
        method, raw = msg
        if raw:
            check(method, raw[: data.draw(st.integers(0, len(raw) - 1))])

    @fuzz
    @given(publish_streams(), st.data())
    def publish(stream: list[bytes], data: st.DataObject) -> None:
        if data.draw(st.booleans()) and stream:  # sometimes a message cut short mid-stream
            i = data.draw(st.integers(0, len(stream) - 1))
            stream = [*stream[:i], stream[i][: len(stream[i]) // 2]]
        check("Publish", stream)

    oversized = [("Lookup", pb.LookupRequest(namespace=b"n" * (MAX_MESSAGE + 1))),
                 ("Fetch", pb.FetchRequest(keys=[bytes(32)] * (MAX_MESSAGE // 32 + 1))),
                 ("Commit", pb.CommitRequest(lease_id=1).SerializeToString()
                  + b"\x00" * MAX_MESSAGE)]
    t0 = time.monotonic()
    rounds = 0
    for seed in itertools.count():
        for fn in (raw_bytes, messages, truncated, publish):
            hypothesis.seed(seed)(fn)()
        for method, msg in oversized:
            check(method, msg if isinstance(msg, bytes) else msg.SerializeToString())
        check("Publish", [pb.PublishChunk(layout=layout_pb(LAYOUT), namespace=Known.namespace,
                                          keys=Known.keys[:1]).SerializeToString(),
                          pb.PublishChunk(data=b"x" * (MAX_MESSAGE + 1)).SerializeToString()])
        rounds += 1
        if time.monotonic() - t0 >= SOAK_S:
            break
    channel.close()
    sent = sum(codes.values())
    peak = rss_bytes(d.proc.pid)
    soak_record("fuzz[tenant-tcp]" if metadata else "fuzz", operations=sent, faults=sent,
                rounds=rounds, wrong=0, crashes=int(d.proc.poll() is not None), unexpected=len(bad),
                anon_growth_mib=round((peak["RssAnon"] - anon0) / 2**20, 1))
    assert not bad, bad[:10]
    assert d.proc.poll() is None, "the daemon died"
    assert codes["Lookup:RESOURCE_EXHAUSTED"] > 0 and codes["Fetch:INVALID_ARGUMENT"] > 0
    assert sum(n for k, n in codes.items() if k.endswith(":OK")) > 0
    assert peak["RssAnon"] - anon0 < MEM_BUDGET, "the daemon allocated for invalid requests"
    # Still serving, correctly; nothing left behind once the fuzzer's leases expire.
    with KVClient(d.target, LAYOUT, deadline_s=5) as c:
        c.publish(tokens, kv)
        n, got = c.fetch(tokens)
        assert n == 128 and same_bytes(got, kv)
    wait_quiescent(d.target, LEASE_S + 1.5)
    CapacityWatch(d).check()
    assert stats(d.target).integrity_failures == 0
    log = d.log.read_text()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]


def test_undecodable_requests_are_invalid_argument(fuzz_daemon):
    """A request that does not decode is the caller's error, named as such, on every method;
    a Publish stream that turns to garbage after a valid block keeps that block and holds
    nothing of the rest."""
    d = fuzz_daemon
    with grpc.insecure_channel(d.target) as channel:
        for method, (_, _, message) in SHAPES.items():
            error = raw_call(channel, method, b"\xff\xff\xff\xff")
            assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            assert message.DESCRIPTOR.full_name in error.details()
        with KVClient(d.target, LAYOUT) as c:
            keys, ns = c.keys(list(range(32))), c.namespace.digest()
        block = random_kv(LAYOUT, 16).contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        stream = [pb.PublishChunk(namespace=ns, layout=layout_pb(LAYOUT), keys=keys),
                  pb.PublishChunk(block_index=0, data=block),
                  pb.PublishChunk(block_index=1, data=block[:100])]
        error = raw_call(channel, "Publish", [m.SerializeToString() for m in stream] + [b"\xff"])
        assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    with KVClient(d.target, LAYOUT) as c:
        assert c.lookup(list(range(32))) == 16  # the whole block committed, the torn one not
    end = wait_quiescent(d.target, 1.0)  # released at once, not by the lease timeout
    assert end.expired_leases == 0
    assert "Traceback" not in d.log.read_text()


def test_refused_requests_are_not_retained(fuzz_daemon):
    """Refusing a request frees it at once: 400 refused requests of almost 1 MiB each leave the
    daemon's memory within allocator noise. (A refusal that left a reference cycle kept each
    one until the cyclic garbage collector ran: hundreds of MiB here.)"""
    d = fuzz_daemon
    big = b"\x5a" * (MAX_MESSAGE - 4096)
    with KVClient(d.target, LAYOUT) as c:
        keys, ns = c.keys(list(range(32))), c.namespace.digest()
    head = pb.PublishChunk(namespace=ns, layout=layout_pb(LAYOUT), keys=keys).SerializeToString()
    bad_chunk = pb.PublishChunk(block_index=0, chunk_offset=7, data=big).SerializeToString()
    lookup = pb.LookupRequest(keys=[big]).SerializeToString()
    anon0 = rss_bytes(d.proc.pid)["RssAnon"]
    codes: Counter[str] = Counter()
    with grpc.insecure_channel(d.target) as channel:
        for i in range(400):
            if i % 4 == 0:
                codes[call(channel, "Publish", [head, bad_chunk]).name] += 1
            else:
                codes[call(channel, "Lookup", lookup).name] += 1
    growth = rss_bytes(d.proc.pid)["RssAnon"] - anon0
    assert codes == {"INVALID_ARGUMENT": 400}, codes
    assert growth < 96 << 20, f"{growth >> 20} MiB retained after 400 refused 1 MiB requests"


def test_refused_unauthenticated_requests_are_not_retained(daemon_factory):
    """The same over TCP for callers without the token: refused, and not kept in memory."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = daemon_factory("--listen", f"127.0.0.1:{port}", "--token", "s3cret-0123456789abcdef",
                       "--max-message-bytes", str(MAX_MESSAGE)).start()
    lookup = pb.LookupRequest(keys=[b"\x5a" * (MAX_MESSAGE - 4096)]).SerializeToString()
    anon0 = rss_bytes(d.proc.pid)["RssAnon"]
    codes: Counter[str] = Counter()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        for i in range(400):
            method, payload = ("Publish", [lookup]) if i % 4 == 0 else ("Lookup", lookup)
            codes[call(channel, method, payload).name] += 1
    growth = rss_bytes(d.proc.pid)["RssAnon"] - anon0
    assert codes == {"UNAUTHENTICATED": 400}, codes
    assert growth < 96 << 20, f"{growth >> 20} MiB retained after 400 refused 1 MiB requests"
