"""EndSession through a real daemon: a client says a conversation ended, and the daemon's
default policy (`prefix`) evicts that conversation's own blocks first, never a prefix other
conversations share, and never another tenant's blocks."""

from __future__ import annotations

import time

import grpc
import pytest

from kvstore import InvalidArgumentError
from kvstore.client import KVClient
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from tests.conftest import random_kv, small_layout
from tests.security.test_hostile import tenant_daemon  # noqa: F401 - a fixture
from tests.security.test_tenants import ADMIN, TOKEN_A, TOKEN_B

pytestmark = pytest.mark.integration

BLOCK = 16  # small_layout's block_tokens
SYSTEM = list(range(BLOCK))  # one block every conversation starts with


def conversation(n: int) -> list[int]:
    """The shared system prompt, then 3 blocks of conversation `n`'s own."""
    return SYSTEM + [n * 1000 + t for t in range(3 * BLOCK)]


def replay(daemon_factory, name: str, end_a: bool) -> dict[str, int]:
    """Host of 8 blocks, no disk: conversations B, then A (7 blocks), optionally A ended,
    then C (3 more blocks: 2 must go). Returns each conversation's cached tokens."""
    d = daemon_factory("--host-bytes", "64KiB", "--disk-bytes", "0", name=name).start()
    layout = small_layout()
    a, b, c = conversation(1), conversation(2), conversation(3)
    with KVClient(d.target, layout) as cl:
        assert cl.publish(b, random_kv(layout, len(b), seed=2)) == len(b)
        time.sleep(0.05)
        assert cl.publish(a, random_kv(layout, len(a), seed=1)) == len(a)
        if end_a:
            # A's own 3 blocks, not the system prompt B hangs from too.
            assert cl.end_session(a) == 3
        assert cl.publish(c, random_kv(layout, len(c), seed=3)) == len(c)
        out = {"a": cl.lookup(a), "b": cl.lookup(b), "c": cl.lookup(c)}
        stats = cl.stats()
        assert stats is not None
        assert stats.sessions_ended == int(end_a)
        assert stats.session_blocks_marked == 3 * int(end_a)
    d.stop()
    return out


def test_an_ended_conversation_goes_first_and_its_shared_prefix_stays(daemon_factory):
    hinted = replay(daemon_factory, "hinted", end_a=True)
    plain = replay(daemon_factory, "plain", end_a=False)
    # Without the hint the older conversation B loses its tail; with it, A does instead,
    # down to the system prompt, which every conversation keeps.
    assert plain == {"a": 4 * BLOCK, "b": 2 * BLOCK, "c": 4 * BLOCK}
    assert hinted == {"a": 2 * BLOCK, "b": 4 * BLOCK, "c": 4 * BLOCK}


def test_a_conversation_that_goes_on_cancels_the_hint(daemon_factory):
    d = daemon_factory("--host-bytes", "64KiB", "--disk-bytes", "0").start()
    layout = small_layout()
    a, b, c = conversation(1), conversation(2), conversation(3)
    with KVClient(d.target, layout) as cl:
        cl.publish(b, random_kv(layout, len(b), seed=2))
        time.sleep(0.05)
        cl.publish(a, random_kv(layout, len(a), seed=1))
        assert cl.end_session(a) == 3
        time.sleep(0.05)
        # The user came back after all: A's next turn reads its prefix, which unmarks it.
        n, _ = cl.fetch(a)
        assert n == len(a)
        cl.publish(c, random_kv(layout, len(c), seed=3))
        assert cl.lookup(a) == len(a)
        assert cl.lookup(b) == 2 * BLOCK


def test_shared_tokens_keep_a_document_other_readers_use(daemon_factory):
    """Two readers of one document, each with a question shorter than a block: their stored
    chains are the same 3 blocks, so the daemon sees no branch to stop at. A reader's hint
    without `shared_tokens` would mark the document; with it, nothing, and the document
    outlives an older conversation when room is needed."""
    d = daemon_factory("--host-bytes", "64KiB", "--disk-bytes", "0").start()
    layout = small_layout()
    old = [7000 + t for t in range(3 * BLOCK)]
    doc = [5000 + t for t in range(3 * BLOCK)]
    r1, r2 = [*doc, 1, 2, 3], [*doc, 4, 5, 6]
    with KVClient(d.target, layout) as cl:
        cl.publish(old, random_kv(layout, len(old), seed=7))
        time.sleep(0.05)
        assert cl.publish(r1, random_kv(layout, len(r1), seed=5)) == len(doc)
        assert cl.lookup(r2) == len(doc)
        assert cl.end_session(r1, shared_tokens=len(doc)) == 0
        new = [9000 + t for t in range(4 * BLOCK)]  # 4 more blocks in a host of 8: 2 must go
        cl.publish(new, random_kv(layout, len(new), seed=9))
        assert cl.lookup(r2) == len(doc)
        assert cl.lookup(old) == BLOCK
        # The pitfall the parameter exists for: the same hint without it marks the document.
        assert cl.end_session(r1) == 3
        with pytest.raises(InvalidArgumentError, match="shared_tokens"):
            cl.end_session(r1, shared_tokens=len(r1) + 1)
        with pytest.raises(InvalidArgumentError, match="shared_tokens"):
            cl.end_session(r1, shared_tokens=-1)


def test_end_session_names_only_the_callers_own_blocks(tenant_daemon):  # noqa: F811
    _, tcp = tenant_daemon
    layout = small_layout()
    a = conversation(1)
    with KVClient(tcp, layout, token=TOKEN_A, deadline_s=5) as alpha:
        assert alpha.publish(a, random_kv(layout, len(a))) == len(a)
        own = alpha.keys(a)
    with KVClient(tcp, layout, token=TOKEN_B, deadline_s=5) as bravo:
        assert bravo.end_session(a) == 0  # the same tokens are other keys for another tenant
    # Even alpha's raw keys, sent by bravo, are rewritten into bravo's key space.
    with grpc.insecure_channel(tcp) as channel:
        raw = pb_grpc.KVStoreStub(channel)
        reply = raw.EndSession(pb.EndSessionRequest(keys=own), timeout=5,
                               metadata=(("authorization", f"Bearer {TOKEN_B}"),))
        assert reply.marked == 0
        stats = raw.Stats(pb.StatsRequest(), timeout=5,
                          metadata=(("authorization", f"Bearer {ADMIN}"),))
        assert stats.sessions_ended == 2 and stats.session_blocks_marked == 0
    with KVClient(tcp, layout, token=TOKEN_A, deadline_s=5) as alpha:
        assert alpha.end_session(a) == 4  # alpha's own: no other conversation shares them


def test_bad_end_session_requests_name_the_problem(daemon):
    with grpc.insecure_channel(daemon.target) as channel:
        raw = pb_grpc.KVStoreStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            raw.EndSession(pb.EndSessionRequest(keys=[b"short"]), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "keys[0] is 5 bytes, keys are 32" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            raw.EndSession(pb.EndSessionRequest(keys=[bytes(32)] * 100_000), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "the limit is" in e.value.details()
        # Unknown keys are no error: nothing to mark.
        assert raw.EndSession(pb.EndSessionRequest(keys=[bytes(32)]), timeout=5).marked == 0
    with KVClient(daemon.target, small_layout()) as cl, pytest.raises(InvalidArgumentError):
        cl.end_session("not tokens")  # type: ignore[arg-type]


def test_end_session_with_the_daemon_down_is_a_quick_no_op(tmp_path):
    with KVClient(f"unix://{tmp_path}/none.sock", small_layout(), deadline_s=0.5) as cl:
        began = time.monotonic()
        assert cl.end_session(conversation(1)) == 0
        assert time.monotonic() - began < 2.0
