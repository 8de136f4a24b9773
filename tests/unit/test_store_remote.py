"""TieredStore with a remote tier, in-process: write-through, read-through, demotion, failures.

The remote tier here is an in-memory stand-in with the real framing and breaker, so the store's
decisions can be checked exactly; `tests/integration/test_remote.py` runs the real one against
real Redis servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from kvstore.integrity import HEADER_BYTES, decode_header
from kvstore.server import remote_writer
from kvstore.server.remote_writer import REMOTE_WRITE_ATTEMPTS
from kvstore.server.store import TieredStore
from kvstore.server.tenancy import Scope, owner_tag
from kvstore.tiers.base import PAGE
from kvstore.tiers.breaker import CircuitBreaker
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier
from kvstore.tiers.remote import (
    PutResult,
    RemoteUnavailableError,
    RemoteWrite,
    frame_value,
    read_frame,
    verify_frame,
)
from tests.unit.test_store import LAYOUT, LENGTH, NS_A, fetched_bytes, key, payload, publish


class FakeRemote:
    """The `RemoteTier` calls the store makes, over a dict of framed values."""

    name = "remote"

    def __init__(self) -> None:
        self.values: dict[tuple[bytes, bytes], bytes] = {}
        self.puts: list[bytes] = []
        self.batches: list[int] = []  # sizes of the GET batches asked for
        self.down = False
        self.get_delay_s = 0.0  # each GET takes at least this long (a slow network)
        self.put_delay_s = 0.0  # each write call takes at least this long
        self.putting = asyncio.Event()  # set when a write call begins
        self.transient_once: set[bytes] = set()  # keys whose next write fails transiently
        self.breaker = CircuitBreaker("fake", 0.01, 0.02, 0.1, logging.getLogger("fake"))

    @property
    def available(self) -> bool:
        return not self.breaker.is_open

    def _check(self) -> None:
        if self.down:
            raise RemoteUnavailableError("fake remote is down")

    async def exists(self, namespace: bytes, keys: Sequence[bytes]) -> list[bool]:
        self._check()
        return [(namespace, k) in self.values for k in keys]

    async def held(self, namespace: bytes, keys: Sequence[bytes], layout_digest: bytes,
                   block_bytes: int) -> list[bool]:
        self._check()
        out = []
        for k in keys:
            raw = self.values.get((namespace, k))
            header = decode_header(raw) if raw is not None else None
            out.append(header is not None and header.key == k
                       and header.layout_digest == layout_digest and header.length == block_bytes)
        return out

    async def get_into(self, namespace: bytes, keys: Sequence[bytes], layout_digest: bytes,
                       payloads: Sequence[memoryview]) -> list[bool]:
        self._check()
        self.batches.append(len(keys))
        if self.get_delay_s:
            await asyncio.sleep(self.get_delay_s)
        out = []
        for k, dst in zip(keys, payloads, strict=True):
            raw = self.values.get((namespace, k))
            if raw is None or len(raw) != HEADER_BYTES + len(dst):
                out.append(False)
                continue
            dst[:] = memoryview(raw)[HEADER_BYTES:]
            verify_frame(raw, dst, k, layout_digest)
            out.append(True)
        return out

    async def put(self, writes: Sequence[RemoteWrite]) -> PutResult:
        self._check()
        self.putting.set()
        if self.put_delay_s:
            await asyncio.sleep(self.put_delay_s)
        out = PutResult()
        for w in writes:
            if w.key in self.transient_once:
                self.transient_once.discard(w.key)
                out.transient.append(w.key)
                continue
            self.values[(w.namespace, w.key)] = bytes(w.frame)
            self.puts.append(w.key)
            out.written += 1
        return out

    async def clear(self, namespace: bytes | None) -> int:
        self._check()
        gone = [nk for nk in self.values if namespace is None or nk[0] == namespace]
        for nk in gone:
            del self.values[nk]
        return len(gone)

    def holds(self, k: bytes) -> bool:
        raw = self.values.get((NS_A, k))
        return raw is not None and bytes(read_frame(raw, k, LAYOUT)) == payload(k)


def make(tmp_path: Path, name: str, remote: FakeRemote, host_blocks: int = 8,
         queue: int = 64) -> TieredStore:
    host = HostTier(host_blocks * 2 * PAGE, shm_dir=tmp_path)
    disk = DiskTier(tmp_path / name, 16 * 3 * PAGE, sync="never")
    return TieredStore(host, disk, io_threads=2, remote=remote,  # type: ignore[arg-type]
                       remote_queue_blocks=queue)


async def settle(store: TieredStore) -> None:
    """Run the write-through task until its queue is empty and idle (5 s at most)."""
    assert store.write_queue is not None
    writer = asyncio.create_task(store.remote_writer())
    try:
        for _ in range(2500):
            if store.write_queue.idle():
                return
            if writer.done():
                break
            await asyncio.sleep(0.002)
        raise AssertionError("write-through queue did not drain")
    finally:
        writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await writer  # what the writer raised, if it did, fails the test


@pytest.fixture
def remote() -> FakeRemote:
    return FakeRemote()


@pytest.fixture
def pair(tmp_path: Path, remote: FakeRemote) -> Iterator[tuple[TieredStore, TieredStore]]:
    """Two daemons' stores sharing one remote tier."""
    a, b = make(tmp_path, "a", remote), make(tmp_path, "b", remote)
    yield a, b
    a.close()
    b.close()


def test_publish_writes_through_and_another_store_reads_through(pair, remote) -> None:
    a, b = pair
    keys = [key(i) for i in range(4)]

    async def main() -> None:
        await publish(a, keys)
        await settle(a)
        assert all(remote.holds(k) for k in keys)
        assert b.lookup(keys) == []
        assert await b.lookup_through([*keys, key(9)], NS_A) == ["remote"] * 4
        lease = await b.fetch([*keys, key(9)], LAYOUT, NS_A, LENGTH)
        assert lease.tiers == ["remote"] * 4
        # one batched read for the whole rest of the prompt, of what the headers said is held
        assert remote.batches == [4]
        assert fetched_bytes(b, lease) == [payload(k) for k in keys]
        b.release(lease.id)
        assert b.lookup(keys) == ["host"] * 4  # promoted: now local
        lease = await b.fetch(keys, LAYOUT)  # no namespace: local tiers only
        assert lease.tiers == ["host"] * 4

    asyncio.run(main())
    assert b.counters.promotions == 4 and b.counters.remote_lookup_hits == 4
    assert b.counters.bytes_read == {"remote": 4 * LENGTH}
    assert a.write_queue is not None and a.write_queue.stats().queued == 4


def test_local_blocks_fill_holes_in_the_remote_prefix(pair, remote) -> None:
    a, b = pair
    keys = [key(i) for i in range(5)]

    async def main() -> None:
        await publish(a, keys[:4])
        await settle(a)
        del remote.values[(NS_A, keys[1])]  # a hole in the remote tier...
        await publish(b, keys[1:2])  # ...that B holds itself; block 4 is nowhere
        assert await b.lookup_through(keys, NS_A) == ["remote", "host", "remote", "remote"]
        lease = await b.fetch(keys, LAYOUT, NS_A, LENGTH)
        assert lease.tiers == ["remote", "host", "remote", "remote"]
        assert fetched_bytes(b, lease) == [payload(k) for k in keys[:4]]
        # one batched read from block 0 on served blocks 0, 2 and 3 around B's own block (not
        # read again), block 4 left out of it as its header said it is not there
        assert remote.batches == [3]

    asyncio.run(main())


def test_demotion_writes_through_what_the_remote_tier_lacks(tmp_path, remote) -> None:
    s = make(tmp_path, "s", remote, host_blocks=3)
    first, second = [key(i) for i in range(3)], [key(i) for i in range(10, 13)]

    async def main() -> None:
        assert s.write_queue is not None
        await publish(s, first)
        lost = await s.write_queue.take(2, 10**9, lambda k: 0)  # a batch whose write is lost
        s.write_queue.done()
        await settle(s)  # first[2] is written
        assert remote.puts == [first[2]]
        await publish(s, second)  # demotes `first` to disk, each queued with a check
        await settle(s)
        # first[0:2] came back from disk; first[2] was checked and not sent again
        assert sorted(remote.puts) == sorted([first[2], *(w.key for w in lost), *second])
        assert all(remote.holds(k) for k in first + second)

    asyncio.run(main())
    assert s.counters.demotions == 3
    s.close()


def test_failed_writes_retry_then_give_up(tmp_path, remote) -> None:
    s = make(tmp_path, "s", remote)

    async def main() -> None:
        remote.transient_once = {key(1)}
        await publish(s, [key(0), key(1)])
        await settle(s)
        assert remote.holds(key(0)) and remote.holds(key(1))  # key(1) on its second attempt
        remote.down = True
        await publish(s, [key(2)])
        await settle(s)  # each failure opens the (fast) breaker; the writer waits it out

    asyncio.run(main())
    assert s.counters.remote_dropped_writes == 1
    assert not remote.holds(key(2))
    assert REMOTE_WRITE_ATTEMPTS == 3
    s.close()


def test_a_remote_read_of_what_remote_lacks_moves_nothing(tmp_path, remote) -> None:
    # Room for a remote read is made only for blocks whose headers came back: a fetch of keys
    # nobody holds (a client may fetch without a lookup) must not demote a full host tier's
    # blocks for nothing, and a value of another size is not read at all.
    s = make(tmp_path, "s", remote, host_blocks=4)
    mine = [key(i) for i in range(4)]

    async def main() -> None:
        await publish(s, mine)  # host full
        other = key(50)
        remote.values[(NS_A, other)] = bytes(frame_value(other, LAYOUT, b"x" * (LENGTH + 1)))
        for keys in ([key(40), key(41)], [other]):
            lease = await s.fetch(keys, LAYOUT, NS_A, LENGTH)
            assert lease.entries == []
            s.release(lease.id)
        assert remote.batches == []  # no GET: the headers said there was nothing to read

    asyncio.run(main())
    assert s.counters.demotions == 0 and all(s.host.contains(k) for k in mine)
    s.close()


def test_remote_down_is_local_service(pair, remote) -> None:
    a, b = pair
    keys = [key(i) for i in range(3)]

    async def main() -> None:
        await publish(a, keys)
        await settle(a)
        await publish(b, keys[:1])
        remote.down = True
        assert await b.lookup_through(keys, NS_A) == ["host"]
        lease = await b.fetch(keys, LAYOUT, NS_A, LENGTH)
        assert lease.tiers == ["host"]
        b.release(lease.id)
        assert await b.clear_remote(NS_A) == 0  # logged, not raised
        remote.down = False
        assert await b.lookup_through(keys, NS_A) == ["host", "remote", "remote"]
        b.clear(NS_A)
        assert await b.clear_remote(NS_A) == 3  # or read-through would bring them back
        assert await b.lookup_through(keys, NS_A) == []

    asyncio.run(main())


def test_write_through_never_blocks_a_commit(tmp_path, remote) -> None:
    s = make(tmp_path, "s", remote, queue=2)
    keys = [key(i) for i in range(5)]

    async def main() -> None:
        await publish(s, keys)  # commits 5 with room for 2 in the queue: no waiting
        assert s.write_queue is not None
        q = s.write_queue.stats()
        assert (q.depth, q.queued, q.shed) == (2, 2, 3)
        assert s.lookup(keys) == ["host"] * 5
        await settle(s)

    asyncio.run(main())
    assert sorted(remote.puts) == keys[:2]
    s.close()


def test_frames_from_host_and_disk_are_identical(tmp_path, remote) -> None:
    """The writer frames host blocks from memory and demoted ones from disk (verified)."""
    s = make(tmp_path, "s", remote, host_blocks=1)

    async def main() -> None:
        await publish(s, [key(0)])
        await publish(s, [key(1)])  # demotes key(0)
        await settle(s)

    asyncio.run(main())
    for i in range(2):
        assert remote.values[(NS_A, key(i))] == bytes(frame_value(key(i), LAYOUT, payload(key(i))))
    s.close()


def test_clear_drops_queued_write_through(tmp_path, remote) -> None:
    s = make(tmp_path, "s", remote)

    async def main() -> None:
        await publish(s, [key(0), key(1)])
        assert s.clear(NS_A) == 2
        assert s.write_queue is not None and len(s.write_queue) == 0
        await settle(s)

    asyncio.run(main())
    assert remote.values == {} and s.counters.remote_lost_writes == 0
    s.close()


def test_remote_read_bandwidth_is_measured_from_the_gets(pair, remote) -> None:
    a, b = pair
    keys = [key(i) for i in range(4)]
    remote.get_delay_s = 0.05

    async def main() -> None:
        await publish(a, keys)
        await settle(a)
        assert b.read_bandwidth() == {}
        lease = await b.fetch(keys, LAYOUT, NS_A, LENGTH)
        assert lease.tiers == ["remote"] * 4
        b.release(lease.id)

    asyncio.run(main())
    bw = b.read_bandwidth()
    assert set(bw) == {"remote"}  # the host tier (where the blocks now are) is never measured
    # one batched GET of 4 blocks that took at least its delay: the rate cannot be higher
    assert 0 < bw["remote"] <= 4 * LENGTH / remote.get_delay_s


# ---- prefetch: a lookup's hit promoted into host in the background (`TieredStore.prefetch`)
async def _prefetched(store: TieredStore, keys: list[bytes]) -> None:
    assert store.prefetch(keys, LAYOUT, NS_A, LENGTH)
    await asyncio.wait([store._prefetching[b""].task])  # NS_A is unscoped


def test_prefetch_promotes_the_hit_into_host_and_counts_no_hit(pair, remote) -> None:
    a, b = pair
    keys = [key(i) for i in range(4)]

    async def main() -> None:
        await publish(a, keys)
        await settle(a)
        assert await b.lookup_through(keys, NS_A) == ["remote"] * 4
        await _prefetched(b, keys)
        assert b.lookup(keys) == ["host"] * 4
        assert not b.leases  # its lease is ended: nothing pinned
        remote.down = True  # now served from host alone
        lease = await b.fetch(keys, LAYOUT, NS_A, LENGTH)
        assert lease.tiers == ["host"] * 4
        assert fetched_bytes(b, lease) == [payload(k) for k in keys]

    asyncio.run(main())
    c = b.counters
    assert (c.prefetches, c.prefetched_blocks, c.promotions) == (1, 4, 4)
    assert c.hit_blocks == 4 and c.tier_hits == {"host": 4}  # the fetch's, not the prefetch's


def test_a_fetch_during_a_prefetch_waits_for_it_and_reads_nothing_twice(pair, remote) -> None:
    """Without the wait the fetch would find the blocks in flight (being promoted by the
    prefetch) and answer a miss."""
    a, b = pair
    keys = [key(i) for i in range(4)]

    async def main() -> None:
        await publish(a, keys)
        await settle(a)
        remote.get_delay_s = 0.1
        assert b.prefetch(keys[:3], LAYOUT, NS_A, LENGTH)
        await asyncio.sleep(0.01)  # the prefetch's GET is in flight
        lease = await b.fetch(keys, LAYOUT, NS_A, LENGTH)
        assert lease.tiers == ["host"] * 3 + ["remote"]
        assert fetched_bytes(b, lease) == [payload(k) for k in keys]
        assert remote.batches == [3, 1]  # the prefetch's GET, then the fetch's for the rest

    asyncio.run(main())


def test_one_prefetch_at_a_time_and_none_for_nothing(pair, remote) -> None:
    a, b = pair
    keys = [key(i) for i in range(4)]

    async def main() -> None:
        await publish(a, keys)
        await settle(a)
        remote.get_delay_s = 0.05
        assert b.prefetch(keys[:2], LAYOUT, NS_A, LENGTH)
        assert not b.prefetch(keys[2:], LAYOUT, NS_A, LENGTH)  # one runs: none started
        assert not b.prefetch([], LAYOUT, NS_A, LENGTH)
        await asyncio.wait([b._prefetching[b""].task])
        await _prefetched(b, keys[2:])  # the first is over: this one starts
        assert b.lookup(keys) == ["host"] * 4

    asyncio.run(main())
    assert b.counters.prefetches == 2 and b.counters.prefetched_blocks == 4


def test_one_prefetch_per_tenant_so_one_looking_up_without_end_leaves_the_others_theirs(
        pair, remote) -> None:
    """Alpha's prefetch runs (a slow remote read), and alpha's next is refused; bravo's starts
    beside it and promotes bravo's blocks. With one slot for the daemon, a tenant whose
    lookups kept a prefetch running would leave the others none."""
    a, b = pair
    ns_alpha, ns_bravo = Scope("alpha").namespace(NS_A), Scope("bravo").namespace(NS_A)
    alpha, bravo = [key(i) for i in range(2)], [key(10 + i) for i in range(2)]

    async def main() -> None:
        await publish(a, alpha, ns_alpha)
        await publish(a, bravo, ns_bravo)
        await settle(a)
        remote.get_delay_s = 0.2
        assert b.prefetch(alpha, LAYOUT, ns_alpha, LENGTH, owner="alpha")
        assert not b.prefetch(alpha, LAYOUT, ns_alpha, LENGTH, owner="alpha")  # one at a time
        # Keyed by the tenant, not the namespace sent: alpha's with an unscoped namespace
        # (a Lookup's need not be 32 bytes) is still alpha's, and leaves the unscoped slot.
        assert not b.prefetch(alpha, LAYOUT, NS_A, LENGTH, owner="alpha")
        assert b.prefetch(bravo, LAYOUT, ns_bravo, LENGTH, owner="bravo")  # beside alpha's
        runs = [b._prefetching[owner_tag(t)].task for t in ("alpha", "bravo")]
        assert b"" not in b._prefetching
        assert not any(t.done() for t in runs)
        await asyncio.wait(runs)
        assert b.lookup(alpha + bravo) == ["host"] * 4

    asyncio.run(main())
    assert b.counters.prefetches == 2 and b.counters.prefetched_blocks == 4


def test_prefetch_stays_within_the_prompts_share_of_host(tmp_path, remote) -> None:
    """A prompt larger than host: a prefetch promotes what the prompt's share holds and stops;
    it never reads into scratch space (freed at its release: read for nothing), where a fetch
    would."""
    a = make(tmp_path, "a", remote, host_blocks=12)
    b = make(tmp_path, "b", remote, host_blocks=8)
    b.fetch_window_bytes = 2 * PAGE  # one block: the prompt's share is 6 of host's 8 blocks
    keys = [key(i) for i in range(10)]

    async def main() -> None:
        await publish(a, keys)
        await settle(a)
        await publish(b, keys[:7])  # B holds the prompt's head already, past its share
        await _prefetched(b, keys)
        # nothing promoted past the share, nothing read into scratch space (a fetch would)
        assert (b.counters.scratch_reads, b.counters.demotions) == (0, 0) and not b.leases
        assert b.counters.prefetched_blocks == 0 and "remote" not in b.counters.bytes_read
        assert b.lookup(keys) == ["host"] * 7
        got: list[str] = []
        data: list[bytes] = []
        more = True
        while more:  # asked for in parts, as a client does
            lease = await b.fetch(keys[len(got):], LAYOUT, NS_A, LENGTH, prior=keys[:len(got)])
            got += lease.tiers
            data += fetched_bytes(b, lease)
            more = lease.more
            b.release(lease.id)
        assert got == ["host"] * 7 + ["remote"] * 3 and data == [payload(k) for k in keys]
        assert b.counters.scratch_reads == 3  # the fetch's, past the share

    try:
        asyncio.run(main())
    finally:
        a.close()
        b.close()


def test_a_prefetch_stopped_at_shutdown_leaves_nothing_pinned(pair, remote) -> None:
    a, b = pair
    keys = [key(i) for i in range(4)]

    async def main() -> None:
        await publish(a, keys)
        await settle(a)
        remote.get_delay_s = 0.2
        assert b.prefetch(keys, LAYOUT, NS_A, LENGTH)
        await asyncio.sleep(0.02)
        await b.stop_prefetch()
        assert not b.leases
        assert b.lookup(keys) == []  # nothing half-promoted is visible
        remote.get_delay_s = 0.0
        lease = await b.fetch(keys, LAYOUT, NS_A, LENGTH)  # and nothing in the way
        assert lease.tiers == ["remote"] * 4

    asyncio.run(main())
    assert b.counters.prefetched_blocks == 0


def test_the_writer_frames_the_next_batch_while_one_is_sent(tmp_path: Path, remote: FakeRemote,
                                                            monkeypatch) -> None:
    # A consumer waiting for a producer's blocks gets the last one after the framing of one
    # batch and the sending of all, not after both of every batch.
    monkeypatch.setattr(remote_writer, "WRITE_BATCH_BLOCKS", 2)
    remote.put_delay_s = 3.0  # the first write call: long enough for a loaded machine
    store = make(tmp_path, "a", remote)
    keys = [key(i) for i in range(6)]

    async def main() -> int:
        await publish(store, keys)
        queue = store.write_queue
        assert queue is not None and len(queue) == 6
        writer = asyncio.create_task(store.remote_writer())
        try:
            await asyncio.wait_for(remote.putting.wait(), 5)  # the first batch is being sent
            for _ in range(1000):  # meanwhile the second is taken and framed
                if len(queue) == 2:
                    break
                await asyncio.sleep(0.002)
            await asyncio.sleep(0.3)  # and no third: one batch framed ahead at most
            depth = len(queue)
            assert remote.puts == []  # still within the first write call
            remote.put_delay_s = 0.0  # the later calls
            for _ in range(1000):
                if queue.idle():
                    break
                await asyncio.sleep(0.005)
            return depth
        finally:
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer

    try:
        assert asyncio.run(main()) == 2
        assert remote.puts == keys and all(remote.holds(k) for k in keys)
    finally:
        store.close()


def test_a_cancelled_writer_leaves_its_batches_queued(tmp_path: Path, remote: FakeRemote,
                                                      monkeypatch) -> None:
    # Cancelled with one batch being sent and the next framed: both go back in the queue
    # (nothing counted busy for ever, which would hold up every later drain), and a writer
    # started later writes all of them.
    monkeypatch.setattr(remote_writer, "WRITE_BATCH_BLOCKS", 2)
    remote.put_delay_s = 3.0
    store = make(tmp_path, "a", remote)
    keys = [key(i) for i in range(6)]

    async def main() -> int:
        await publish(store, keys)
        queue = store.write_queue
        assert queue is not None
        writer = asyncio.create_task(store.remote_writer())
        await asyncio.wait_for(remote.putting.wait(), 5)
        for _ in range(1000):
            if len(queue) == 2:
                break
            await asyncio.sleep(0.002)
        assert len(queue) == 2 and remote.puts == []  # one batch sending, one framed
        writer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await writer
        left = len(queue)
        remote.put_delay_s = 0.0
        await settle(store)  # a new writer; fails unless the queue becomes idle
        return left

    try:
        assert asyncio.run(main()) == 6
        assert sorted(remote.puts) == sorted(keys) and all(remote.holds(k) for k in keys)
    finally:
        store.close()
