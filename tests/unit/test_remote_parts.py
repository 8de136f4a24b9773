"""The remote tier's parts without a server: URLs, key names, framing, breaker, queue."""

from __future__ import annotations

import asyncio
import logging

import pytest
from redis.crc import key_slot

from kvstore.errors import ConfigError, IntegrityError, LayoutMismatchError
from kvstore.integrity import HEADER_BYTES
from kvstore.remote_url import parse_remote_url, redact_url
from kvstore.server.write_through import WriteThroughQueue
from kvstore.tiers.breaker import CircuitBreaker
from kvstore.tiers.remote import frame_value, namespace_pattern, read_frame, redis_key

NS = bytes(range(32))
LAYOUT = b"L" * 32
KEY = b"k" * 32


def test_urls_parse_and_redact() -> None:
    t = parse_remote_url("redis://127.0.0.1:6379/2")
    assert (t.cluster, t.tls, t.nodes, t.db, t.password) == (False, False, (("127.0.0.1", 6379),),
                                                             2, None)
    t = parse_remote_url("rediss+cluster://u:p%40ss@10.0.0.1:7000,10.0.0.2:7001")
    assert (t.cluster, t.tls, t.username, t.password) == (True, True, "u", "p@ss")
    assert t.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 7001))
    for bad, why in (("http://x:1", "expected"), ("redis://host", "host:port"),
                     ("redis://a:1,b:2", "cluster"), ("redis+cluster://a:1/3", "database 0"),
                     ("redis://a:99999", "host:port"), ("redis://a:1/x", "number")):
        with pytest.raises(ConfigError, match=why):
            parse_remote_url(bad)
    assert redact_url("redis://:s3cret@h:1/0") == "redis://:***@h:1/0"
    assert redact_url("redis+cluster://u:s3cret@a:1,b:2") == "redis+cluster://u:***@a:1,b:2"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"


def test_key_names_spread_over_cluster_slots() -> None:
    name = redis_key(NS, KEY)
    assert name.startswith(b"kvs1:" + NS.hex()[:16].encode() + b":") and name.endswith(
        KEY.hex().encode())
    assert b"{" not in name  # no hash tag: the whole name picks the slot
    slots = {key_slot(redis_key(NS, i.to_bytes(32, "big"))) for i in range(200)}
    assert len(slots) > 190
    assert namespace_pattern(NS) == name[: name.rindex(b":") + 1] + b"*"
    assert namespace_pattern(None) == b"kvs1:*"


def test_frames_bind_key_and_layout_and_detect_damage() -> None:
    payload = bytes(range(256)) * 40
    frame = bytes(frame_value(KEY, LAYOUT, payload))
    assert len(frame) == HEADER_BYTES + len(payload)
    assert bytes(read_frame(frame, KEY, LAYOUT)) == payload
    with pytest.raises(LayoutMismatchError):
        read_frame(frame, KEY, b"X" * 32)  # intact, but another layout: not corruption
    with pytest.raises(IntegrityError, match="another key"):
        read_frame(frame, b"o" * 32, LAYOUT)
    for pos in (3, 50, HEADER_BYTES + 7, len(frame) - 1):
        bad = bytearray(frame)
        bad[pos] ^= 0x01
        with pytest.raises(IntegrityError):
            read_frame(bytes(bad), KEY, LAYOUT)
    with pytest.raises(IntegrityError):
        read_frame(frame[:-1], KEY, LAYOUT)
    with pytest.raises(IntegrityError):
        read_frame(frame[:HEADER_BYTES - 1], KEY, LAYOUT)


def test_breaker_opens_skips_probes_and_backs_off() -> None:
    now = [100.0]
    b = CircuitBreaker("remote", retry_s=1.0, max_retry_s=4.0, probe_timeout_s=0.5,
                       log=logging.getLogger("test"), clock=lambda: now[0])
    assert b.allow() and not b.is_open
    b.failure("boom")
    assert b.is_open and b.opens == 1
    assert not b.allow() and not b.allow()
    assert b.skipped == 2 and 0.75 <= b.wait_s() <= 1.0
    now[0] += 1.0
    assert b.allow()  # one probe...
    assert not b.allow()  # ...at a time
    b.failure("still")
    assert b.opens == 1 and 1.5 <= b.wait_s() <= 2.0  # doubled, jittered
    for _ in range(5):
        now[0] += 10
        assert b.allow()
        b.failure("still")
    assert b.wait_s() <= 4.0  # capped
    now[0] += 10
    assert b.allow()
    now[0] += 1.0  # the probe's caller vanished (cancelled): another may probe
    assert b.allow()
    b.success()
    assert not b.is_open and b.allow() and b.wait_s() == 0


def test_write_queue_sheds_dedups_and_requeues_in_order() -> None:
    async def main() -> None:
        q = WriteThroughQueue(3)
        assert q.put(b"a") and q.put(b"b", check_exists=True) and q.put(b"c")
        assert q.put(b"a")  # already queued: not twice, not shed
        assert not q.put(b"d")
        assert q.put(b"b")  # an unconditional write supersedes the check
        assert (len(q), q.queued, q.shed) == (3, 3, 1)
        batch = await q.take(10, 100, lambda k: 60)  # byte limit: 60 + 60 > 100
        assert [w.key for w in batch] == [b"a"]
        batch += await q.take(10, 1000, lambda k: 60)
        assert [(w.key, w.check_exists) for w in batch] == [(b"a", False), (b"b", False),
                                                             (b"c", False)]
        assert not q.idle()
        q.done()
        q.done()
        assert q.idle()
        assert q.put(b"e")
        q.requeue(batch)  # room for 2 of 3: the oldest go back to the front
        assert [w.key for w in await q.take(10, 10**9, lambda k: 0)] == [b"a", b"b", b"e"]
        assert q.shed == 2
        waiter = asyncio.create_task(q.take(1, 1, lambda k: 0))
        await asyncio.sleep(0.01)
        assert not waiter.done()  # waits while empty
        q.put(b"f")
        assert [w.key for w in await waiter] == [b"f"]

    asyncio.run(main())


def test_write_queue_shares_room_and_turns_between_tenants() -> None:
    """A tenant that fills the queue gives up its newest block to another's, down to an equal
    share, and batches take from each tenant in turn: its backlog delays no one else."""
    alpha, bravo = b"\xa7kvTaaaa", b"\xa7kvTbbbb"

    async def main() -> None:
        q = WriteThroughQueue(6)
        for i in range(8):
            q.put(b"a%d" % i, owner=alpha)
        assert (len(q), q.shed) == (6, 2)  # alone, alpha fills it; the rest is shed
        for i in range(3):
            assert q.put(b"b%d" % i, owner=bravo)  # each sheds alpha's newest
        assert not q.put(b"b3", owner=bravo)  # 3 and 3: an equal share, its own is shed
        assert not q.put(b"a9", owner=alpha)  # and alpha takes nothing back
        assert (len(q), q.shed) == (6, 7)
        batch = await q.take(10, 10**9, lambda k: 0)
        assert [w.key for w in batch] == [b"a0", b"b0", b"a1", b"b1", b"a2", b"b2"]
        assert {w.key: w.owner for w in batch}[b"b2"] == bravo
        q.requeue(batch[:2])
        assert sorted(w.key for w in await q.take(10, 10**9, lambda k: 0)) == [b"a0", b"b0"]
        q.requeue(batch[2:3])
        q.discard(b"a1")
        assert len(q) == 0 and q.stats().depth == 0 and q._owners == {}
        # A batch of bravo's fails while alpha fills the queue: its retries get their share.
        for i in range(2):
            q.put(b"b%d" % i, owner=bravo)
        out = await q.take(10, 10**9, lambda k: 0)
        for i in range(10):
            q.put(b"x%d" % i, owner=alpha)
        assert len(q) == 6 and q.shed == 11
        q.requeue(out)
        assert len(q) == 6 and q.shed == 13  # two of alpha's newest gave way
        assert [w.key for w in await q.take(10, 10**9, lambda k: 0)] == [
            b"x0", b"b0", b"x1", b"b1", b"x2", b"x3"]

    asyncio.run(main())


def test_write_queue_weights_turns_and_room() -> None:
    """`tenant_weights` in the queue: alpha at 3 gets three blocks written per turn to
    bravo's one, the fraction of a weight carried over; a full queue keeps alpha 3/4 of it."""
    alpha, bravo, carol = b"\xa7kvTaaaa", b"\xa7kvTbbbb", b"\xa7kvTcccc"

    async def main() -> None:
        q = WriteThroughQueue(8)
        q.set_weights({alpha: 3.0, carol: 1.5})
        for i in range(20):
            q.put(b"b%d" % i, owner=bravo)
        assert len(q) == 8
        for i in range(20):  # shed bravo's newest down to its quarter: 6 and 2
            q.put(b"a%d" % i, owner=alpha)
        assert [len(q._owners[o]) for o in (alpha, bravo)] == [6, 2]
        assert not q.put(b"b99", owner=bravo) and not q.put(b"a99", owner=alpha)
        batch = await q.take(100, 10**9, lambda k: 0)
        assert [w.key for w in batch] == [b"b0", b"a0", b"a1", b"a2", b"b1", b"a3", b"a4",
                                          b"a5"]
        q.done()
        # Carol at 1.5 against bravo at 1: 1.5 blocks a turn, 3 every 2 turns of bravo's.
        q3 = WriteThroughQueue(100)
        q3.set_weights({alpha: 3.0, carol: 1.5})
        for i in range(9):
            q3.put(b"c%d" % i, owner=carol)
            q3.put(b"d%d" % i, owner=bravo)
        order = [w.owner for w in await q3.take(10, 10**9, lambda k: 0)]
        assert order == [carol, bravo, carol, carol, bravo, carol, bravo, carol, carol, bravo]
        # A batch that ends in an owner's turn goes on with it in the next batch.
        q2 = WriteThroughQueue(100)
        q2.set_weights({alpha: 3.0})
        for i in range(5):
            q2.put(b"a%d" % i, owner=alpha)
            q2.put(b"b%d" % i, owner=bravo)
        first = [w.key for w in await q2.take(2, 10**9, lambda k: 0)]
        second = [w.key for w in await q2.take(3, 10**9, lambda k: 0)]
        assert first + second == [b"a0", b"a1", b"a2", b"b0", b"a3"]
        with pytest.raises(ValueError, match="positive"):
            q2.set_weights({alpha: 0.0})

    asyncio.run(main())


@pytest.mark.parametrize("hiredis", [True, False])
def test_the_tier_warns_when_hiredis_would_copy_every_value(hiredis: bool, monkeypatch,
                                                            caplog) -> None:
    # With hiredis importable, redis-py packs each value with two more copies (write-through
    # twice as slow: docs/OPERATIONS.md, "Remote tier"). Nothing connects here.
    import redis.utils

    from kvstore.tiers.remote import RemoteTier

    monkeypatch.setattr(redis.utils, "HIREDIS_AVAILABLE", hiredis)
    with caplog.at_level(logging.WARNING, logger="kvstore.tiers.remote"):
        tier = RemoteTier("redis://127.0.0.1:1/0")
        asyncio.run(tier.close())
    warned = [r for r in caplog.records if "hiredis" in r.getMessage()]
    assert len(warned) == (1 if hiredis else 0)
