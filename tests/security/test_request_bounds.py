"""What one request can make the daemon keep: bounded, whatever its size.

A daemon keeps some of what calls tell it beyond the call: descriptions of blocks for the KV
events (`DescribeBlocks`), and the layout of each namespace a call names (Inspect's book).
Both were once bounded in count only, so calls well under `max_message_bytes` grew the
daemon by ~130 MiB (16 MiB of token ids) or ~20 MiB (a 16 MiB `layout.model`, or any
Publish's first message: the book kept the request's own layout message, and with it the
whole request) each, for good. Oversize input is now refused with INVALID_ARGUMENT naming
the field and the limit; what is kept is bounded in bytes. Checked on a real daemon's RSS.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from tests.conftest import small_layout
from tests.reliability import layout_pb, rss_bytes
from tests.security.test_tenants import _free_port

pytestmark = [pytest.mark.integration, pytest.mark.fault]
MiB = 1 << 20
# The documented limits (docs/API.md; `kvstore.layout.MAX_STRING_BYTES`,
# `server.service.DESCRIBED_TOKENS` and `DESCRIBE_CALL_TOKENS`, `server.kv_events.PENDING_BYTES`).
MAX_STRING_BYTES = 4096
DESCRIBED_TOKENS = 1 << 16
DESCRIBE_CALL_TOKENS = 1 << 21
PENDING_BYTES = 64 * MiB
BIG_MESSAGES = [("grpc.max_send_message_length", 64 * MiB)]


def _rss(pid: int) -> int:
    return rss_bytes(pid)["VmRSS"]


def _growth(pid: int, call: Callable[[], Any], calls: int, warmup: int) -> int:
    """RSS gained over `calls` calls after `warmup` of them: the memory allocator keeps some of
    a large request's transient copies (~140 MiB for 16 MiB requests, then no more), while what
    the daemon keeps of each call grows it call after call."""
    for _ in range(warmup):
        call()
    base = _rss(pid)
    for _ in range(calls):
        call()
    return _rss(pid) - base


def _code(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def _events_daemon(daemon_factory: Any) -> Any:
    return daemon_factory("--host-bytes", "1MiB", "--disk-bytes", "0",
                          "--kv-events", f"tcp://127.0.0.1:{_free_port()}").start()


def test_oversize_block_descriptions_are_refused_and_cost_the_daemon_nothing(daemon_factory):
    """16 descriptions of 1M token ids each (~16 MiB a call) for one engine block of 16
    tokens: refused, naming `token_ids`; the daemon keeps nothing of them. (Before: accepted,
    ~130 MiB more RSS a call, never given back.)"""
    d = _events_daemon(daemon_factory)
    channel = grpc.insecure_channel(d.target, options=BIG_MESSAGES)
    raw = pb_grpc.KVStoreStub(channel)
    tokens = [7] * MiB
    answers = []

    def oversize() -> None:
        blocks = [pb.EngineBlocks(key=os.urandom(32), block_hashes=[b"h" * 32],
                                  token_ids=tokens, block_size=16) for _ in range(16)]
        answers.append(_code(lambda: raw.DescribeBlocks(
            pb.DescribeBlocksRequest(namespace=b"n" * 32, blocks=blocks), timeout=60)))

    grown = _growth(d.proc.pid, oversize, calls=6, warmup=4)
    assert grown < 64 * MiB, f"the daemon grew by {grown / MiB:.0f} MiB; {answers[0]}"
    for code, details in answers:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert "blocks[0].token_ids" in details and "(16)" in details, details

    # Each other limit names its field too.
    def describe(**fields: Any) -> tuple[grpc.StatusCode, str]:
        block = pb.EngineBlocks(**{"key": os.urandom(32), "block_hashes": [b"h" * 32],
                                   "block_size": 16, **fields})
        return _code(lambda: raw.DescribeBlocks(
            pb.DescribeBlocksRequest(namespace=b"n" * 32, blocks=[block]), timeout=10))

    for fields, named in [
            (dict(block_size=DESCRIBED_TOKENS + 1), "blocks[0].block_hashes"),
            (dict(block_hashes=[b"h" * 65]), "blocks[0].block_hashes"),
            (dict(parent_block_hash=b"p" * 65), "blocks[0].parent_block_hash"),
            (dict(lora_name="l" * (MAX_STRING_BYTES + 1)), "blocks[0].lora_name"),
            (dict(kv_cache_spec_kind="k" * (MAX_STRING_BYTES + 1)),
             "blocks[0].kv_cache_spec_kind")]:
        code, details = describe(**fields)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and named in details, (fields, details)
    # A call covering more tokens than DESCRIBE_CALL_TOKENS, in blocks each within the limit.
    n = DESCRIBE_CALL_TOKENS // DESCRIBED_TOKENS + 1
    code, details = _code(lambda: raw.DescribeBlocks(pb.DescribeBlocksRequest(
        namespace=b"n" * 32, blocks=[pb.EngineBlocks(key=os.urandom(32), block_hashes=[b"h"],
                                                     block_size=DESCRIBED_TOKENS)
                                     for _ in range(n)]), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "in one call" in details, details
    # Once a call has named the namespace's layout, a description covers one of its blocks.
    layout = small_layout()  # 16-token blocks
    ns = b"m" * 32
    list(raw.Fetch(pb.FetchRequest(namespace=ns, keys=[os.urandom(32)], layout=layout_pb(layout)),
                   timeout=10))
    ok = pb.EngineBlocks(key=os.urandom(32), block_hashes=[b"a" * 32, b"b" * 32],
                         token_ids=list(range(16)), block_size=8)
    assert raw.DescribeBlocks(pb.DescribeBlocksRequest(namespace=ns, blocks=[ok]),
                              timeout=10).described == 1
    over = pb.EngineBlocks(key=os.urandom(32), block_hashes=[b"a" * 32, b"b" * 32],
                           block_size=16)
    code, details = _code(lambda: raw.DescribeBlocks(
        pb.DescribeBlocksRequest(namespace=ns, blocks=[over]), timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "block_tokens" in details, details
    channel.close()


def test_descriptions_of_blocks_never_stored_are_bounded_in_bytes(daemon_factory):
    """Descriptions within every limit, of blocks nobody publishes: the daemon keeps at most
    PENDING_BYTES (64 MiB) of them, the oldest dropped. 8 calls describe 16M tokens (~600 MiB
    as Python lists); before, all of it was kept (the bound was 65,536 descriptions)."""
    d = _events_daemon(daemon_factory)
    channel = grpc.insecure_channel(d.target, options=BIG_MESSAGES)
    raw = pb_grpc.KVStoreStub(channel)
    per_block = DESCRIBED_TOKENS
    tokens = [1000 + i % 30000 for i in range(per_block)]  # real ids: an int object each
    hashes = [os.urandom(32) for _ in range(per_block // 4096)]
    base = _rss(d.proc.pid)
    for _ in range(8):
        blocks = [pb.EngineBlocks(key=os.urandom(32), block_hashes=hashes, token_ids=tokens,
                                  block_size=4096)
                  for _ in range(DESCRIBE_CALL_TOKENS // per_block)]
        reply = raw.DescribeBlocks(pb.DescribeBlocksRequest(namespace=b"n" * 32, blocks=blocks),
                                   timeout=60)
        assert reply.described == len(blocks)
    grown = _rss(d.proc.pid) - base
    # What is kept, and one call's transient lists (~80 MiB, reused by the next call).
    assert grown < PENDING_BYTES + 128 * MiB, f"the daemon grew by {grown / MiB:.0f} MiB"
    channel.close()


def test_oversize_layout_strings_are_refused_by_every_call_and_never_kept(daemon_factory):
    """20 missed fetches, each naming a new namespace with a 16 MiB `layout.model`: refused,
    naming the field and the limit, and the daemon keeps nothing (before: ~24 MiB each, for
    Inspect). Every call taking a layout refuses it; a model path of the limit's length is
    taken, and shown by Inspect."""
    d = daemon_factory("--host-bytes", "1MiB", "--disk-bytes", "0").start()
    channel = grpc.insecure_channel(d.target, options=BIG_MESSAGES)
    raw = pb_grpc.KVStoreStub(channel)
    huge = layout_pb(small_layout())
    huge.model = "m" * (16 * MiB)
    answers = []
    grown = _growth(d.proc.pid, lambda: answers.append(_code(lambda: list(raw.Fetch(
        pb.FetchRequest(namespace=os.urandom(32), keys=[os.urandom(32)],
                        transfer=pb.TRANSFER_SHM, layout=huge), timeout=30)))),
        calls=20, warmup=20)
    assert grown < 64 * MiB, f"the daemon grew by {grown / MiB:.0f} MiB; {answers[0]}"
    for code, details in answers:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        assert f"KVLayout.model is {16 * MiB} bytes; the limit is {MAX_STRING_BYTES}" in details

    over = layout_pb(small_layout())
    over.model_revision = "r" * (MAX_STRING_BYTES + 1)
    ns, key = os.urandom(32), os.urandom(32)
    for name, call in [
            ("Fetch", lambda: list(raw.Fetch(pb.FetchRequest(namespace=ns, keys=[key],
                                                             layout=over), timeout=10))),
            ("Reserve", lambda: raw.Reserve(pb.ReserveRequest(namespace=ns, keys=[key],
                                                              layout=over), timeout=10)),
            ("Publish", lambda: raw.Publish(iter([pb.PublishChunk(namespace=ns, keys=[key],
                                                                  layout=over)]), timeout=10)),
            ("Lookup", lambda: raw.Lookup(pb.LookupRequest(namespace=ns, keys=[key],
                                                           prefetch=True, layout=over),
                                          timeout=10))]:
        code, details = _code(call)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, code, details)
        assert "KVLayout.model_revision" in details and str(MAX_STRING_BYTES) in details, (
            name, details)

    path = layout_pb(small_layout())
    path.model = "/" + "p" * (MAX_STRING_BYTES - 1)  # as long as a local path may be
    reply = raw.Reserve(pb.ReserveRequest(namespace=ns, keys=[key], layout=path), timeout=10)
    raw.Commit(pb.CommitRequest(lease_id=reply.lease_id), timeout=10)
    listed = raw.Inspect(pb.InspectRequest(), timeout=10).namespaces
    assert [n.layout.model for n in listed if n.namespace == ns] == [path.model]

    channel.close()


def test_inspect_keeps_the_layout_not_the_request_that_named_it(tmp_path):
    """Inspect's book kept the request's own `layout` message, and a protobuf field keeps its
    whole message alive: every Publish naming a new namespace left its first message behind,
    data chunk included (~22 MiB each for 16 MiB chunks, up to 4,096 namespaces). It keeps
    the validated `KVLayout` now."""
    import asyncio

    from kvstore import KVLayout
    from kvstore.server.metrics import Metrics
    from kvstore.server.service import KVStoreService
    from kvstore.server.store import TieredStore
    from kvstore.tiers.host import HostTier

    store = TieredStore(HostTier(1 << 20, shm_dir=tmp_path), None)
    service = KVStoreService(store, Metrics(store), max_blocks_per_call=64,
                             max_message_bytes=64 * MiB)

    class Context:
        def peer(self) -> str:
            return "unix:test"

        def set_code(self, code: grpc.StatusCode) -> None:
            self.code = code

        def set_details(self, details: str) -> None:
            pass

    async def publish(first: pb.PublishChunk) -> Context:
        async def messages() -> Any:
            yield first

        context = Context()
        await service.Publish(messages(), context)
        return context

    layout, ns = small_layout(), os.urandom(32)
    first = pb.PublishChunk(namespace=ns, layout=layout_pb(layout), data=b"x" * MiB)
    context = asyncio.run(publish(first))  # refused: a chunk for a block it does not name
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    seen = service.namespaces.get(ns)
    assert seen is not None and type(seen.layout) is KVLayout and seen.layout == layout
    store.close()


def test_the_limits_are_the_documented_ones():
    from kvstore import layout
    from kvstore.server import kv_events, service

    assert layout.MAX_STRING_BYTES == MAX_STRING_BYTES
    assert (service.DESCRIBED_TOKENS, service.DESCRIBE_CALL_TOKENS) == (
        DESCRIBED_TOKENS, DESCRIBE_CALL_TOKENS)
    assert kv_events.PENDING_BYTES == PENDING_BYTES


def test_refused_large_publishes_are_not_kept_until_the_collector_happens_to_run(
        daemon_factory):
    """Publish streams refused for their first message (a malformed key), each carrying a
    16 MiB chunk: gRPC keeps each call's state in a reference cycle, so every refused
    request stayed in memory until Python's cyclic collector ran, which counts objects, not
    bytes (+426 MiB over 35 such calls before; about one collection per second now)."""
    import time

    d = daemon_factory("--host-bytes", "16MiB", "--disk-bytes", "0").start()
    layout = small_layout()
    with grpc.insecure_channel(d.target, options=BIG_MESSAGES) as channel:
        stub = pb_grpc.KVStoreStub(channel)
        payload = os.urandom(16 * MiB)

        def refused() -> None:
            msg = pb.PublishChunk(namespace=bytes(32), layout=layout_pb(layout), keys=[b"short"],
                                  block_index=0, chunk_offset=0, data=payload)
            code, details = _code(lambda: stub.Publish(iter([msg]), timeout=30))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
            time.sleep(0.05)

        grown = _growth(d.proc.pid, refused, calls=35, warmup=10)
    assert grown < 192 * MiB, f"+{grown / MiB:.0f} MiB over 35 refused 16 MiB publishes"
