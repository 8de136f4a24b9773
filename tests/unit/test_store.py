"""TieredStore in-process: publish, fetch, demotion, promotion, integrity, leases, clear.

pytest-asyncio is not a dependency: each test drives its coroutines with `asyncio.run`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from kvstore.errors import NotFoundError
from kvstore.server.store import Lease, TieredStore
from kvstore.tiers.base import PAGE
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.gpu import GpuTier
from kvstore.tiers.host import HostTier

NS_A = b"A" * 32
NS_B = b"B" * 32
LAYOUT = b"L" * 32
LENGTH = 5000  # 2 pages in host, 3 (header page + 2) on disk


def key(i: int, ns: bytes = NS_A) -> bytes:
    return ns[:1] + i.to_bytes(31, "big")


def payload(k: bytes) -> bytes:
    g = torch.Generator().manual_seed(int.from_bytes(k[-8:], "big") + k[0])
    return bytes(torch.randint(0, 256, (LENGTH,), dtype=torch.uint8, generator=g).numpy())


def make_store(tmp_path: Path, host_blocks: int, disk_blocks: int | None = 16,
               lease_timeout_s: float = 30.0, fetch_window_bytes: int = 64 << 20,
               disk_read_delay_s: float = 0.0) -> TieredStore:
    host = HostTier(host_blocks * 2 * PAGE, shm_dir=tmp_path)
    disk = (DiskTier(tmp_path / "disk", disk_blocks * 3 * PAGE, sync="never",
                     fault_read_delay_s=disk_read_delay_s)
            if disk_blocks is not None else None)
    return TieredStore(host, disk, lease_timeout_s=lease_timeout_s, io_threads=2,
                       fetch_window_bytes=fetch_window_bytes)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TieredStore]:
    s = make_store(tmp_path, host_blocks=8)
    yield s
    s.close()


@pytest.fixture
def tiny(tmp_path: Path) -> Iterator[TieredStore]:
    """Room for 3 blocks in host memory, 16 on disk."""
    s = make_store(tmp_path, host_blocks=3)
    yield s
    s.close()


async def publish(store: TieredStore, keys: Sequence[bytes], ns: bytes = NS_A) -> Lease:
    """Reserve, write each reserved block into the arena as a client would, commit."""
    lease = await store.reserve(ns, LAYOUT, keys, LENGTH)
    for entry in lease.entries:
        store.host.memview(entry)[:] = payload(entry.key)
    store.commit(lease.id)
    return lease


def fetched_bytes(store: TieredStore, lease: Lease) -> list[bytes]:
    return [bytes(store.host.memview(e)) for e in lease.entries]


def test_publish_then_fetch_byte_identical(store: TieredStore) -> None:
    keys = [key(i) for i in range(4)]

    async def main() -> None:
        pub = await publish(store, keys)
        assert pub.needed == [True] * 4
        assert not pub.more
        assert store.lookup([*keys, key(99)]) == ["host"] * 4
        lease = await store.fetch([*keys, key(99)], LAYOUT)
        assert [e.key for e in lease.entries] == keys
        assert lease.tiers == ["host"] * 4
        assert fetched_bytes(store, lease) == [payload(k) for k in keys]
        assert all(store.host.policy.is_pinned(k) for k in keys)
        assert store.release(lease.id)

    asyncio.run(main())
    c = store.counters
    assert (c.stored_blocks, c.hit_blocks, c.miss_blocks) == (4, 4, 1)
    assert c.tier_hits == {"host": 4}
    assert c.bytes_written == {"host": 4 * LENGTH}


def test_reserved_blocks_are_invisible_until_commit(store: TieredStore) -> None:
    async def main() -> None:
        lease = await store.reserve(NS_A, LAYOUT, [key(0), key(1)], LENGTH)
        assert len(lease.entries) == 2
        assert store.lookup([key(0)]) == []
        miss = await store.fetch([key(0)], LAYOUT)
        assert miss.entries == []
        store.release(miss.id)
        again = await store.reserve(NS_A, LAYOUT, [key(0), key(1), key(2)], LENGTH)
        assert again.needed == [False, False, True]  # being written counts as present
        store.release(again.id)
        assert store.commit(lease.id) == 2
        assert store.lookup([key(0), key(1)]) == ["host", "host"]
        with pytest.raises(NotFoundError):
            store.commit(lease.id)  # a lease ends once

    asyncio.run(main())


def test_republish_of_present_blocks_reserves_nothing(store: TieredStore) -> None:
    async def main() -> None:
        await publish(store, [key(0), key(1)])
        lease = await publish(store, [key(0), key(1), key(2)])
        assert lease.needed == [False, False, True]
        assert [e.key for e in lease.entries] == [key(2)]

    asyncio.run(main())
    assert store.counters.stored_blocks == 3


def test_fetch_under_another_layout_is_a_miss(store: TieredStore) -> None:
    async def main() -> None:
        await publish(store, [key(0)])
        lease = await store.fetch([key(0)], b"X" * 32)
        assert lease.entries == []
        assert not store.host.policy.is_pinned(key(0))

    asyncio.run(main())
    assert store.counters.miss_blocks == 1


def test_publish_past_host_capacity_stops_with_more(tiny: TieredStore) -> None:
    keys = [key(i) for i in range(5)]

    async def main() -> None:
        lease = await tiny.reserve(NS_A, LAYOUT, keys, LENGTH)
        assert len(lease.entries) == 3  # everything else in host is in flight
        assert lease.needed == [True] * 3
        assert lease.more
        tiny.release(lease.id)
        assert tiny.host.stats().used_bytes == 0

    asyncio.run(main())


def test_demotion_to_disk_and_promotion_back(tiny: TieredStore) -> None:
    first = [key(i) for i in range(3)]
    second = [key(i) for i in range(3, 6)]

    async def main() -> None:
        await publish(tiny, first)
        await publish(tiny, second)  # host holds 3: the first chain goes to disk
        assert tiny.counters.demotions == 3
        assert tiny.disk is not None
        for k in first:
            assert tiny.disk.contains(k)
            assert not tiny.host.contains(k)
        assert tiny.lookup(first + second) == ["disk"] * 3 + ["host"] * 3
        assert tiny.host.stats().evictions == 3

        lease = await tiny.fetch(first, LAYOUT)
        assert lease.tiers == ["disk"] * 3
        assert fetched_bytes(tiny, lease) == [payload(k) for k in first]
        assert tiny.counters.promotions == 3
        assert all(tiny.host.contains(k) for k in first)
        assert all(tiny.disk.contains(k) for k in first)  # promotion copies, keeps the disk copy
        tiny.release(lease.id)

        # The second chain was demoted in its turn, and comes back byte-identical too.
        lease = await tiny.fetch(second, LAYOUT)
        assert lease.tiers == ["disk"] * 3
        assert fetched_bytes(tiny, lease) == [payload(k) for k in second]
        tiny.release(lease.id)

    asyncio.run(main())
    c = tiny.counters
    assert c.demotions == 6
    assert c.promotions == 6
    assert c.bytes_read == {"disk": 6 * LENGTH}
    assert c.tier_hits == {"disk": 6}
    assert c.integrity_failures == 0


def test_demotion_order_is_leaf_first(tiny: TieredStore) -> None:
    chain = [key(i) for i in range(3)]

    async def main() -> None:
        await publish(tiny, chain)
        await publish(tiny, [key(10)])  # one block of room needed: the leaf goes
        assert tiny.disk is not None
        assert tiny.disk.contains(key(2))
        assert tiny.host.contains(key(0))
        assert tiny.host.contains(key(1))

    asyncio.run(main())


def test_partial_republish_keeps_parents_last_in_lru(store: TieredStore) -> None:
    """A chain extended by a later publish must still lose its leaves before its root."""

    async def main() -> None:
        await publish(store, [key(0)])
        await publish(store, [key(0), key(1), key(2)])

    asyncio.run(main())
    assert list(store.host.policy.lru_order()) == [key(2), key(1), key(0)]


def test_fetch_stops_when_host_is_pinned_full(tiny: TieredStore) -> None:
    keys = [key(i) for i in range(5)]

    async def main() -> None:
        await publish(tiny, keys[:3])
        await publish(tiny, keys[3:])  # 0-2 on disk, 3-4 in host
        lease = await tiny.fetch(keys, LAYOUT)
        assert len(lease.entries) == 3  # host room for three pinned blocks
        assert lease.more
        assert fetched_bytes(tiny, lease) == [payload(k) for k in keys[:3]]
        tiny.release(lease.id)
        rest = await tiny.fetch(keys[3:], LAYOUT)  # the client asks again for the rest
        assert fetched_bytes(tiny, rest) == [payload(k) for k in keys[3:]]
        tiny.release(rest.id)

    asyncio.run(main())


def _flip_disk_byte(store: TieredStore, k: bytes, where: int) -> None:
    assert store.disk is not None
    entry = store.disk.get(k)
    assert entry is not None
    with open(store.disk.directory / "blocks.dat", "r+b") as f:
        f.seek(entry.offset + where)
        b = f.read(1)
        f.seek(entry.offset + where)
        f.write(bytes([b[0] ^ 0x04]))


@pytest.mark.parametrize("where", [20, PAGE + 17])  # header, payload
def test_corrupt_disk_record_is_a_counted_miss_and_deleted(tiny: TieredStore, where: int) -> None:
    chain = [key(i) for i in range(3)]

    async def main() -> None:
        await publish(tiny, chain)
        await publish(tiny, [key(i) for i in range(3, 6)])  # demote the chain
        _flip_disk_byte(tiny, key(1), where)
        lease = await tiny.fetch(chain, LAYOUT)
        assert [e.key for e in lease.entries] == [key(0)]  # the prefix stops at the bad block
        assert fetched_bytes(tiny, lease) == [payload(key(0))]
        tiny.release(lease.id)
        assert tiny.counters.integrity_failures == 1
        assert tiny.disk is not None
        assert not tiny.disk.contains(key(1))
        assert key(1) not in tiny.disk.entries
        assert key(1) not in tiny.host.entries  # the host slot it was read into was returned
        assert all(e.committed for e in tiny.host.entries.values())
        assert tiny.host.stats().used_bytes == 2 * len(tiny.host.entries) * PAGE
        assert tiny.lookup(chain) == ["host"]
        # The key can be published again and then fetched whole.
        again = await publish(tiny, chain)
        assert again.needed == [False, True, False]
        lease = await tiny.fetch(chain, LAYOUT)
        assert fetched_bytes(tiny, lease) == [payload(k) for k in chain]
        tiny.release(lease.id)

    asyncio.run(main())
    assert tiny.counters.miss_blocks == 2


def test_concurrent_fetches_of_a_disk_block(tmp_path: Path) -> None:
    """Two clients asking at once for a prefix being promoted: the second waits for the
    first's reads and is served from host, whole. (It used to miss what was in flight: two
    requests sharing a prefix on disk, and one recomputed it.)"""
    store = make_store(tmp_path, host_blocks=6)
    chain = [key(i) for i in range(2)]

    async def main() -> None:
        await publish(store, chain)
        await publish(store, [key(i) for i in range(2, 8)])  # demote the chain
        a, b = await asyncio.gather(store.fetch(chain, LAYOUT), store.fetch(chain, LAYOUT))
        for lease in (a, b):
            assert fetched_bytes(store, lease) == [payload(k) for k in chain]
            store.release(lease.id)
        # one reads both (whichever made room first), the other waits for its reads
        assert sorted([a.tiers, b.tiers]) == [["disk", "disk"], ["host", "host"]]
        assert store.counters.promotions == 2  # read once
        assert not any(store.host.policy.is_pinned(k) for k in chain)
        assert store._promoting == {}

    asyncio.run(main())
    store.close()


def test_a_fetch_waits_for_a_promotion_only_until_its_answer_is_due(tmp_path: Path) -> None:
    """A stalled disk read of another fetch holds a second fetch only until the share of its
    deadline (`answer_within`): then the block is a miss, not a wait for the whole read."""
    store = make_store(tmp_path, host_blocks=3, disk_read_delay_s=3.0)
    chain = [key(i) for i in range(2)]

    async def main() -> None:
        await publish(store, chain)
        await publish(store, [key(i) for i in range(2, 5)])  # demote the chain
        slow = asyncio.ensure_future(store.fetch(chain, LAYOUT))
        await asyncio.sleep(0.1)  # the first fetch's reservations are made, its reads stall
        began = time.monotonic()
        quick = await store.fetch(chain, LAYOUT, answer_within=0.3)
        # waited (not a miss at once), but not for the 3 s read: margin for a loaded machine
        assert 0.25 < time.monotonic() - began < 2.0
        assert quick.entries == []
        store.release(quick.id)
        lease = await slow
        assert fetched_bytes(store, lease) == [payload(k) for k in chain]
        store.release(lease.id)

    asyncio.run(main())
    store.close()


def test_concurrent_publishes_of_the_same_chain(tiny: TieredStore) -> None:
    """Two engines publishing one prefix at once, while room is made by demotion: no error,
    each block reserved once, and the chain readable afterwards."""
    chain = [key(i) for i in range(2)]

    async def main() -> None:
        await publish(tiny, [key(i) for i in range(10, 13)])  # host full: reserving demotes
        a, b = await asyncio.gather(publish(tiny, chain), publish(tiny, chain))
        assert len(a.entries) + len(b.entries) == 2
        assert sorted(e.key for e in a.entries + b.entries) == chain
        assert all(x or y for x, y in zip(a.needed, b.needed, strict=True))
        lease = await tiny.fetch(chain, LAYOUT)
        assert fetched_bytes(tiny, lease) == [payload(k) for k in chain]
        tiny.release(lease.id)

    asyncio.run(main())


def test_release_unpins(store: TieredStore) -> None:
    keys = [key(i) for i in range(2)]

    async def main() -> None:
        await publish(store, keys)
        a = await store.fetch(keys, LAYOUT)
        b = await store.fetch(keys[:1], LAYOUT)
        assert store.host.next_victim() is None
        assert store.release(a.id)
        assert store.host.policy.is_pinned(keys[0])  # b still holds it
        assert not store.host.policy.is_pinned(keys[1])
        assert store.host.next_victim() == keys[1]  # the leaf
        assert store.release(b.id)
        assert not store.host.policy.is_pinned(keys[0])
        assert not store.release(b.id)  # ends once
        assert not store.release(12345)
        assert store.leases == {}

    asyncio.run(main())


def test_release_of_publish_lease_frees_reservation(store: TieredStore) -> None:
    async def main() -> None:
        lease = await store.reserve(NS_A, LAYOUT, [key(0), key(1)], LENGTH)
        assert store.host.stats().used_bytes == 4 * PAGE
        assert store.release(lease.id)
        assert store.host.stats().used_bytes == 0
        assert not store.present(key(0))
        with pytest.raises(NotFoundError):
            store.commit(lease.id)

    asyncio.run(main())


def test_reap_expired_reclaims_publish_and_fetch_leases(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4, lease_timeout_s=0.5)
    now = [1000.0]
    store.clock = lambda: now[0]  # stepped by hand: no sleeping past the timeout

    async def main() -> None:
        await publish(store, [key(0)])
        fetch = await store.fetch([key(0)], LAYOUT)
        pub = await store.reserve(NS_A, LAYOUT, [key(1), key(2)], LENGTH)
        assert store.host.stats().used_bytes == 6 * PAGE
        assert store.reap_expired() == 0  # not yet
        assert store.host.policy.is_pinned(key(0))
        now[0] += 0.49
        assert store.reap_expired() == 0  # still not
        now[0] += 0.02
        assert store.reap_expired() == 2
        assert store.leases == {}
        assert not store.host.policy.is_pinned(key(0))  # the fetch lease let go
        assert store.host.contains(key(0))  # unpinned, not deleted
        assert store.host.stats().used_bytes == 2 * PAGE  # the reservation's space is back
        assert key(1) not in store.host.entries
        with pytest.raises(NotFoundError):
            store.commit(pub.id)
        assert not store.release(fetch.id)
        again = await publish(store, [key(1), key(2)])  # the keys are writable again
        assert again.needed == [True, True]
        assert store.lookup([key(0), key(1), key(2)]) == ["host"] * 3

    try:
        asyncio.run(main())
    finally:
        store.close()


def test_clear_namespace_removes_only_that_namespace(tiny: TieredStore) -> None:
    a = [key(i, NS_A) for i in range(3)]
    b = [key(i, NS_B) for i in range(2)]

    async def main() -> None:
        await publish(tiny, a, NS_A)  # these end up on disk
        await publish(tiny, b, NS_B)
        await publish(tiny, [key(9, NS_A)], NS_A)
        assert tiny.disk is not None
        assert tiny.host.contains(key(9, NS_A))
        assert all(tiny.disk.contains(k) for k in a)  # demoted, leaf first, then the root
        assert tiny.clear(NS_A) == 4
        for k in [*a, key(9, NS_A)]:
            assert not any(t.contains(k) for t in tiny.tiers)
        assert tiny.lookup(b) == ["host", "host"]
        assert list(tiny.host.keys(NS_A)) == []
        assert list(tiny.disk.keys(NS_A)) == []
        lease = await tiny.fetch(b, LAYOUT)
        assert fetched_bytes(tiny, lease) == [payload(k) for k in b]
        # Blocks a reader pins go too: gone for every lookup at once, their bytes the
        # reader's until it lets go, their space freed then.
        used = tiny.host.stats().used_bytes
        assert tiny.clear(None) == 2
        assert tiny.lookup(b) == []
        assert not any(tiny.host.contains(k) for k in b)
        assert list(tiny.host.keys()) == [] and tiny.host.stats().blocks == 0
        assert tiny.host.stats().used_bytes == used  # still the reader's
        assert fetched_bytes(tiny, lease) == [payload(k) for k in b]
        assert (await tiny.fetch(b, LAYOUT)).entries == []
        assert tiny.clear(None) == 0  # counted once
        tiny.release(lease.id)
        assert tiny.host.stats().used_bytes == 0
        assert tiny.host.entries == {}
        assert (await publish(tiny, b, NS_B)).needed == [True, True]  # writable again
        assert tiny.lookup(b) == ["host", "host"]

    asyncio.run(main())


def test_a_clear_during_a_promotion_leaves_nothing_once_the_reader_lets_go(
        tmp_path: Path) -> None:
    """A Clear while a fetch reads a prefix from disk into host: the fetch still gets the
    bytes it asked for, and neither the disk records it read nor the host copies it
    promoted them into outlive it (they came back, as host blocks, before)."""
    store = make_store(tmp_path, host_blocks=4, disk_read_delay_s=0.5)
    chain = [key(i) for i in range(2)]

    async def main() -> None:
        await publish(store, chain)
        await publish(store, [key(i) for i in range(2, 6)])  # demote the chain
        assert store.disk is not None and all(store.disk.contains(k) for k in chain)
        reading = asyncio.ensure_future(store.fetch(chain, LAYOUT))
        await asyncio.sleep(0.2)  # its host reservations made, its disk reads stalled
        assert store.clear(None) >= 2
        assert store.lookup(chain) == []
        lease = await reading
        assert lease.tiers == ["disk", "disk"]
        assert fetched_bytes(store, lease) == [payload(k) for k in chain]
        await asyncio.sleep(0)  # the landed promotions' removal runs on the next turn
        assert store.lookup(chain) == []
        store.release(lease.id)
        for tier in store.tiers:
            assert tier.entries == {}, tier.name
            assert tier.stats().used_bytes == 0, tier.name

    asyncio.run(main())
    store.close()
    reopened = DiskTier(tmp_path / "disk", 16 * 3 * PAGE, sync="never")
    assert list(reopened.keys()) == []  # the index forgot them too
    reopened.close()


def test_flush_writes_host_only_blocks_to_disk(store: TieredStore) -> None:
    keys = [key(i) for i in range(4)]

    async def main() -> None:
        await publish(store, keys)
        assert store.disk is not None
        assert list(store.disk.keys()) == []
        assert await store.flush(0) == 0  # no budget, nothing written
        assert await store.flush(10.0) == 4
        assert set(store.disk.keys()) == set(keys)
        assert all(store.host.contains(k) for k in keys)  # copies: host keeps them
        assert not any(store.host.policy.is_pinned(k) for k in keys)
        assert await store.flush(10.0) == 0  # already on disk
        for k in keys:
            entry = store.disk.prepare_load(k)
            dst = bytearray(entry.length)
            store.disk.read_into(entry, memoryview(dst))
            store.disk.complete_load(entry)
            assert bytes(dst) == payload(k)

    asyncio.run(main())


def _parents_outlive_children(store: TieredStore, keys: Sequence[bytes]) -> bool:
    """Every block of the chain `keys` that the host holds comes after its descendants in the
    eviction order (so it is evicted after them, and a flush writes it before them)."""
    order = [k for k in store.host.policy.eviction_order() if k in keys]
    return order == sorted(order, key=keys.index, reverse=True) and len(order) > 1


@pytest.mark.parametrize("policy", ["lru", "prefix", "arc", "s3fifo"])
def test_prompt_in_rounds_keeps_its_head_freshest(tmp_path: Path, policy: str) -> None:
    # Publish and fetch a 9-block prompt a block per round (windows of one, as a prompt larger
    # than the client's staging does) after another prompt. Each round names the rounds before
    # it (`prior`), so the chain is ranked whole: ranking only the round's own blocks made the
    # tail fresher than the head, so the head was evicted (and flushed) last-first.
    store = make_store(tmp_path, host_blocks=16, fetch_window_bytes=LENGTH)
    store.host.use_eviction(policy)
    keys = [key(i) for i in range(9)]
    other = [key(i, NS_B) for i in range(3)]

    async def main() -> None:
        await publish(store, other)
        done = 0
        while done < len(keys):  # a round per block: each reserves one and names the rest
            lease = await store.reserve(NS_A, LAYOUT, keys[done : done + 1], LENGTH,
                                        prior=keys[:done])
            store.host.memview(lease.entries[0])[:] = payload(keys[done])
            store.commit(lease.id)
            done += 1
        assert _parents_outlive_children(store, keys)
        await store.flush(60.0)  # as after a restart: on disk only, so the fetch promotes
        for k in keys:
            store.host.remove(k)
        await publish(store, other)
        got, tiers = await fetch_whole(store, keys)  # 9 windows of one promotion each
        assert got == [payload(k) for k in keys] and tiers == ["disk"] * 9
        # A window's end is not a miss: the rest comes in the next call (every block a hit; it
        # used to count 36 misses here, and `kvstore stats` showed a 14% hit rate for 100%).
        assert (store.counters.hit_blocks, store.counters.miss_blocks) == (9, 0)
        assert _parents_outlive_children(store, keys)
        assert nothing_held(store)

    try:
        asyncio.run(main())
    finally:
        store.close()


def timed_disk_writes(store: TieredStore) -> list[bytes]:
    """Make every disk write of `store` take one second of its (stepped) clock; returns the
    keys written, in order, as they are written."""
    now = [0.0]
    written: list[bytes] = []
    write_disk = store._write_disk

    async def timed_write(disk: DiskTier, src, seq=None, tier=None):  # type: ignore[no-untyped-def]
        written.append(src.key)
        now[0] += 1.0  # each block takes a second of the budget
        return await write_disk(disk, src, seq, tier)

    store.clock = lambda: now[0]
    store._write_disk = timed_write  # type: ignore[method-assign]
    return written


@pytest.mark.parametrize("policy", ["lru", "prefix", "arc", "s3fifo"])
def test_flush_cut_short_keeps_a_prefix(tmp_path: Path, policy: str) -> None:
    # A prompt larger than the host tier, published in rounds and fetched in windows, leaves
    # its head and a later segment in host with blocks between them on disk only (under
    # `prefix`: host 0-11 and 16, disk 12-15 and 17-19). A flush whose budget runs out after 3
    # blocks must write the head's first 3: the eviction order alone (the old flush order)
    # ranked the later segment first, and after a restart the prompt had a hole at block 2.
    store = make_store(tmp_path, host_blocks=16, disk_blocks=32, fetch_window_bytes=2 * LENGTH)
    store.host.use_eviction(policy)
    keys = [key(i) for i in range(20)]
    async def main() -> None:
        await publish_whole(store, keys)
        for _ in range(2):
            got, _ = await fetch_whole(store, keys)
            assert got == [payload(k) for k in keys]
        assert store.disk is not None
        host_only = [k for k in keys if store.host.contains(k) and k not in store.disk.entries]
        assert len(host_only) >= 4
        written = timed_disk_writes(store)
        assert await store.flush(2.5) == 3
        assert written == host_only[:3]
        for k in list(store.host.entries):
            store.host.remove(k)  # as after a restart
        on_disk = [k in store.disk.entries for k in keys]
        assert on_disk[: keys.index(host_only[3])] == [True] * keys.index(host_only[3])

    try:
        asyncio.run(main())
    finally:
        store.close()


def test_flush_cut_short_never_spends_its_budget_past_a_hole(tmp_path: Path) -> None:
    # Disk full (4 blocks, LRU): prompt B's start (b0, b1) on disk, its tail (b2, b3) in host
    # only; Z on disk; A, the newest, in host only. Writing A evicts B's start from disk. The
    # old order, planned before any write, then wrote b2 and b3: worth nothing after a
    # restart (their parents were gone), while B's start, still in host, was not written.
    store = make_store(tmp_path, host_blocks=8, disk_blocks=4)
    b, z, a = [key(i) for i in range(4)], [key(10), key(11)], [key(20), key(21)]
    async def main() -> None:
        await publish(store, b[:2])
        await publish(store, z)
        assert await store.flush(10.0) == 4  # disk full: b0, b1, z0, z1
        await publish(store, b)  # B's tail, host only
        await publish(store, z)
        await publish(store, a)
        written = timed_disk_writes(store)
        assert await store.flush(3.5) == 4
        assert written == [a[0], a[1], b[0], b[1]]
        for k in list(store.host.entries):
            store.host.remove(k)  # as after a restart
        assert store.lookup(a) == ["disk"] * 2 and store.lookup(b) == ["disk"] * 2

    try:
        asyncio.run(main())
    finally:
        store.close()


def test_store_without_disk_drops_victims(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=2, disk_blocks=None)

    async def main() -> None:
        await publish(store, [key(0), key(1)])
        await publish(store, [key(2)])
        assert store.counters.demotions == 0
        assert store.lookup([key(0), key(1)]) == ["host"]  # the leaf was dropped, not the root
        assert not store.host.contains(key(1))
        assert store.host.contains(key(2))
        assert len(store.host.entries) == 2
        assert store.host.stats().evictions == 1

    try:
        asyncio.run(main())
    finally:
        store.close()


def test_close_releases_leases_and_removes_arena(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=2)
    arena = store.host.arena.path

    async def main() -> None:
        await publish(store, [key(0)])
        await store.fetch([key(0)], LAYOUT)
        await store.reserve(NS_A, LAYOUT, [key(1)], LENGTH)

    asyncio.run(main())
    assert arena.exists()
    store.close()
    assert store.leases == {}
    assert not arena.exists()


def test_expired_lease_timing_is_monotonic(store: TieredStore) -> None:
    async def main() -> Lease:
        return await store.reserve(NS_A, LAYOUT, [key(0)], LENGTH)

    before = time.monotonic()
    lease = asyncio.run(main())
    assert before + 30.0 <= lease.expires <= time.monotonic() + 30.0


def test_disk_read_bandwidth_is_measured_and_host_never_is(tmp_path: Path) -> None:
    host = HostTier(3 * 2 * PAGE, shm_dir=tmp_path)
    delay = 0.05
    disk = DiskTier(tmp_path / "disk", 16 * 3 * PAGE, sync="never", fault_read_delay_s=delay)
    s = TieredStore(host, disk, io_threads=2)
    first = [key(i) for i in range(3)]
    second = [key(i) for i in range(3, 6)]

    async def main() -> None:
        await publish(s, first)
        await publish(s, second)  # the first chain is demoted to disk
        lease = await s.fetch(second, LAYOUT)  # host hits: a pin moves no bytes
        s.release(lease.id)
        assert s.read_bandwidth() == {}
        lease = await s.fetch(first, LAYOUT)
        assert lease.tiers == ["disk"] * 3
        s.release(lease.id)

    try:
        asyncio.run(main())
        bw = s.read_bandwidth()
        assert set(bw) == {"disk"}
        # 3 reads on 2 I/O threads, each stalled `delay`: at least two rounds of it
        assert 0 < bw["disk"] <= 3 * LENGTH / (2 * delay)
    finally:
        s.close()


# ---- prompts larger than the host tier (`_Room`): served without pushing themselves out

async def publish_whole(store: TieredStore, keys: Sequence[bytes]) -> None:
    """Publish as the client does: reserve, write, commit, and again while `more`."""
    done = 0
    while done < len(keys):
        lease = await publish(store, keys[done:])
        done += len(lease.needed)
        if not lease.more:
            break


async def fetch_whole(store: TieredStore, keys: Sequence[bytes]) -> tuple[list[bytes], list[str]]:
    """Fetch as the client does: a window at a time, each asked for with the keys before it
    (`prior`) while the window before is still held, then that one released."""
    got: list[bytes] = []
    tiers: list[str] = []
    held: Lease | None = None
    while len(got) < len(keys):
        lease = await store.fetch(keys[len(got) :], LAYOUT, prior=keys[: len(got)])
        if held is not None:
            store.release(held.id)
        got += fetched_bytes(store, lease)
        tiers += lease.tiers
        held = lease
        if not lease.more:
            break
    if held is not None:
        store.release(held.id)
    return got, tiers


def nothing_held(store: TieredStore) -> bool:
    """No lease, no pin, and no scratch space left: the host's used bytes are its blocks'."""
    host = store.host.stats()
    return (not store.leases and host.pinned_blocks == 0
            and host.used_bytes == 2 * PAGE * len(store.host.entries))


async def on_disk_only(store: TieredStore, keys: Sequence[bytes]) -> None:
    """The state after a restart: the blocks on disk, the host tier empty."""
    await publish_whole(store, keys)
    await store.flush(60.0)
    for k in keys:
        store.host.remove(k)


def test_prompt_larger_than_the_host_tier_is_read_past_its_share(tmp_path: Path) -> None:
    # Host room for 6 blocks, windows of one: the prompt's share is 4 (6 less two windows).
    store = make_store(tmp_path, host_blocks=6, fetch_window_bytes=LENGTH)
    keys = [key(i) for i in range(9)]

    async def main() -> None:
        await on_disk_only(store, keys)
        c, host = store.counters, store.host
        for round_ in range(3):
            demoted, promoted, evicted = c.demotions, c.promotions, host.stats().evictions
            got, tiers = await fetch_whole(store, keys)
            assert got == [payload(k) for k in keys]
            assert tiers == ["disk"] * 9 if round_ == 0 else ["host"] * 4 + ["disk"] * 5
            assert c.promotions - promoted == (4 if round_ == 0 else 0)
            assert c.demotions == demoted and host.stats().evictions == evicted
            assert store.lookup(keys) == ["host"] * 4 + ["disk"] * 5
            assert nothing_held(store)
        assert c.scratch_reads == 5 * 3
        assert c.bytes_written.get("disk", 0) == 9 * LENGTH  # publish and flush only

    try:
        asyncio.run(main())
    finally:
        store.close()


def test_prompt_published_past_the_host_tier_gives_way_once(tmp_path: Path) -> None:
    # Published whole, the prompt fills the host tier (its first blocks demoted to disk). The
    # first fetch needs scratch room: the prompt's deepest host blocks are demoted for it, down
    # to its share (4 of 6), once; later fetches demote, evict and promote nothing.
    store = make_store(tmp_path, host_blocks=6, fetch_window_bytes=LENGTH)
    keys = [key(i) for i in range(9)]

    async def main() -> None:
        await publish_whole(store, keys)
        c, host = store.counters, store.host
        assert host.stats().blocks == 6
        demoted = c.demotions
        for round_ in range(3):
            evicted, promoted = host.stats().evictions, c.promotions
            got, _ = await fetch_whole(store, keys)
            assert got == [payload(k) for k in keys]
            assert c.demotions - demoted == 2 and c.promotions == promoted
            assert host.stats().evictions - evicted == (2 if round_ == 0 else 0)
            assert host.stats().blocks == 4 and nothing_held(store)

    try:
        asyncio.run(main())
    finally:
        store.close()


def test_corrupt_block_in_scratch_ends_the_prefix_and_frees_the_space(tmp_path: Path) -> None:
    # One call (no windows), host room for 4: blocks 0-1 promoted (its share: 4 less two
    # blocks), 2-3 read into scratch; block 2 is corrupt, so the prefix ends at it and both
    # scratch blocks are freed (3 was read fine, past the failure).
    store = make_store(tmp_path, host_blocks=4, fetch_window_bytes=0)
    keys = [key(i) for i in range(6)]

    async def main() -> None:
        await on_disk_only(store, keys)
        _flip_disk_byte(store, key(2), PAGE + 17)
        lease = await store.fetch(keys, LAYOUT)
        assert [e.key for e in lease.entries] == keys[:2] and lease.scratch == []
        assert fetched_bytes(store, lease) == [payload(k) for k in keys[:2]]
        assert store.counters.integrity_failures == 1
        store.release(lease.id)
        assert nothing_held(store)

    try:
        asyncio.run(main())
    finally:
        store.close()


def test_scratch_space_is_freed_by_the_reaper_and_on_cancellation(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4, fetch_window_bytes=0, lease_timeout_s=0.5,
                       disk_read_delay_s=0.0)
    now = [1000.0]
    store.clock = lambda: now[0]
    keys = [key(i) for i in range(6)]

    async def main() -> None:
        await on_disk_only(store, keys)
        lease = await store.fetch(keys, LAYOUT)  # handed over; its client never releases it
        assert len(lease.scratch) == 2
        now[0] += 1.0
        assert store.reap_expired() == 1
        assert nothing_held(store)
        assert store.disk is not None
        store.disk.fault_read_delay_s = 0.2  # reads in flight when the call is cancelled
        call = asyncio.ensure_future(store.fetch(keys[2:], LAYOUT, prior=keys[:2]))
        await asyncio.sleep(0.05)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert nothing_held(store)

    try:
        asyncio.run(main())
    finally:
        store.close()


# ---------------------------------------------------------------- a gpu level (on cpu) above host
def gpu_store(tmp_path: Path, gpu_blocks: int, host_blocks: int,
              disk_blocks: int | None = 16) -> TieredStore:
    host = HostTier(host_blocks * 2 * PAGE, shm_dir=tmp_path)
    disk = (DiskTier(tmp_path / "disk", disk_blocks * 3 * PAGE, sync="never")
            if disk_blocks is not None else None)
    return TieredStore(host, disk, io_threads=2, gpu=GpuTier(gpu_blocks * 2 * PAGE, "cpu"))


def test_flush_writes_blocks_only_the_gpu_tier_holds(tmp_path: Path) -> None:
    store = gpu_store(tmp_path, gpu_blocks=4, host_blocks=8)
    keys = [key(i) for i in range(3)]

    async def main() -> None:
        await publish(store, keys)
        lease = await store.fetch(keys, LAYOUT)
        store.release(lease.id)
        await store.lifts_idle()  # the lift runs after the fetch answered
        assert store.gpu is not None and store.disk is not None
        assert all(store.gpu.contains(k) for k in keys)  # lifted, host keeps its copies
        for k in keys:
            store.host.remove(k)
        store.host.buffer[:] = 0  # their old host bytes gone: only gpu has them
        assert store.lookup(keys) == ["gpu"] * 3
        assert await store.flush(10.0) == 3  # through a host buffer: the gpu may be a device
        for k in keys:
            store.gpu.remove(k)
        lease = await store.fetch(keys, LAYOUT)
        assert lease.tiers == ["disk"] * 3 and fetched_bytes(store, lease) == [
            payload(k) for k in keys]
        store.release(lease.id)

    try:
        asyncio.run(main())
    finally:
        store.close()


def test_a_slab_fetch_reads_gpu_blocks_in_place_and_promotes_the_rest(tmp_path: Path) -> None:
    # A 9-block prompt: its first 4 blocks only in gpu, the other 5 only on disk, host (6
    # blocks) empty. A client mapping the slab reads the 4 where they lie (pinned in gpu), so
    # the 5 disk blocks fit host and are promoted; counting the gpu blocks as host space (as
    # for a client that does not map the slab) would put all 9 past the host's share and send
    # the disk blocks to scratch space.
    store = gpu_store(tmp_path, gpu_blocks=4, host_blocks=6)
    keys = [key(i) for i in range(9)]

    async def main() -> None:
        assert store.gpu is not None and store.disk is not None
        await publish(store, keys[:4])
        store.release((await store.fetch(keys[:4], LAYOUT)).id)
        await store.lifts_idle()
        await publish(store, keys[4:])
        await store.flush(10.0)  # whatever host's demotions did not write yet
        assert all(store.disk.contains(k) for k in keys)
        for k in keys:
            store.host.remove(k)
        for k in keys[:4]:
            assert store.disk.remove(k)
        lease = await store.fetch(keys, LAYOUT, slab_ok=True)
        assert lease.tiers == ["gpu"] * 4 + ["disk"] * 5
        assert lease.in_slab == [True] * 4 + [False] * 5 and not lease.scratch
        assert [bytes(store.gpu.memview(e)) if s else bytes(store.host.memview(e))
                for e, s in zip(lease.entries, lease.in_slab, strict=True)] == [
            payload(k) for k in keys]
        assert store.gpu.stats().pinned_blocks == 4
        assert [store.host.contains(k) for k in keys] == [False] * 4 + [True] * 5  # promoted
        store.release(lease.id)
        await store.lifts_idle()
        assert nothing_held(store) and store.gpu.stats().pinned_blocks == 0

    try:
        asyncio.run(main())
    finally:
        store.close()


def test_a_slab_block_past_a_corrupt_disk_block_is_unpinned(tmp_path: Path) -> None:
    # Block 0 only on disk (corrupt), block 1 only in gpu: a slab fetch pins block 1 in the
    # slab, then the prefix ends at block 0's failed read, so the pin goes back at once.
    store = gpu_store(tmp_path, gpu_blocks=4, host_blocks=6)
    keys = [key(0), key(1)]

    async def main() -> None:
        assert store.gpu is not None and store.disk is not None
        await publish(store, keys)
        store.release((await store.fetch(keys, LAYOUT)).id)
        await store.lifts_idle()
        await store.flush(10.0)
        for k in keys:
            store.host.remove(k)
        assert store.gpu.remove(keys[0]) and store.disk.contains(keys[0])
        _flip_disk_byte(store, keys[0], PAGE + 17)
        lease = await store.fetch(keys, LAYOUT, slab_ok=True)
        assert lease.entries == [] and store.counters.integrity_failures == 1
        store.release(lease.id)
        assert store.gpu.stats().pinned_blocks == 0 and nothing_held(store)
        assert store.gpu.contains(keys[1])

    try:
        asyncio.run(main())
    finally:
        store.close()


def test_gpu_victim_host_cannot_take_stays_in_gpu(tmp_path: Path) -> None:
    # Host (2 blocks) is pinned full by the lift of B (its own pins, past the fetch's lease):
    # gpu's victims (A, only in gpu) have nowhere to go, so they stay and the lift stops;
    # nothing is dropped.
    store = gpu_store(tmp_path, gpu_blocks=2, host_blocks=2, disk_blocks=None)
    a, b = [key(0), key(1)], [key(2), key(3)]

    async def main() -> None:
        await publish(store, a)
        store.release((await store.fetch(a, LAYOUT)).id)
        await store.lifts_idle()
        assert store.gpu is not None
        for k in a:
            assert store.host.remove(k)
        await publish(store, b)
        lease = await store.fetch(b, LAYOUT)
        assert fetched_bytes(store, lease) == [payload(k) for k in b]
        store.release(lease.id)  # the lift copies once its fetch's client is done
        await store.lifts_idle()
        assert [store.gpu.contains(k) for k in a + b] == [True, True, False, False]
        # A later fetch reads A from gpu through scratch space, byte-identical.
        lease = await store.fetch(a, LAYOUT)
        assert lease.tiers == ["gpu", "gpu"] and fetched_bytes(store, lease) == [
            payload(k) for k in a]
        store.release(lease.id)
        assert nothing_held(store) and store.gpu.stats().pinned_blocks == 0

    try:
        asyncio.run(main())
    finally:
        store.close()
