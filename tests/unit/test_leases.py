"""Lease rules of `TieredStore` in-process (issue 13): held leases are never reaped, a lease is
checked before it is touched, and only its owner ends it. A stepped clock, no sleeping."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvstore.errors import InvalidArgumentError, NotFoundError
from tests.unit.test_store import LAYOUT, LENGTH, NS_A, key, make_store, publish


def test_a_held_lease_is_never_reaped_until_handed_over(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4, lease_timeout_s=1.0)
    now = [0.0]
    store.clock = lambda: now[0]

    async def main() -> None:
        await publish(store, [key(0)])
        held = await store.fetch([key(0)], LAYOUT, hold=True)  # a stream moving its bytes
        pub = await store.reserve(NS_A, LAYOUT, [key(1)], LENGTH, hold=True)
        now[0] += 100.0
        assert store.reap_expired() == 0  # long past expiry, but their calls still run
        assert store.host.policy.is_pinned(key(0)) and key(1) in store.host.entries
        store.hand_over(held)  # now the client's: lease_timeout_s from now
        now[0] += 0.99
        assert store.reap_expired() == 0
        now[0] += 0.02
        assert store.reap_expired() == 1
        assert not store.host.policy.is_pinned(key(0))
        assert pub.id in store.leases  # still held
        assert store.release(pub.id)
        assert store.host.stats().used_bytes == 2 * 4096  # key(0) alone: 5000 B in 2 pages

    asyncio.run(main())
    store.close()


def test_commit_checks_kind_and_owner_before_touching_the_lease(tmp_path: Path) -> None:
    store = make_store(tmp_path, host_blocks=4)

    async def main() -> None:
        await publish(store, [key(0)])
        fetch = await store.fetch([key(0)], LAYOUT)
        with pytest.raises(InvalidArgumentError, match="fetch lease"):
            store.commit(fetch.id)
        assert fetch.id in store.leases and store.host.policy.is_pinned(key(0))
        assert store.release(fetch.id)  # ends as a fetch lease should: unpinned
        assert not store.host.policy.is_pinned(key(0))

        mine = await store.reserve(NS_A, LAYOUT, [key(1)], LENGTH, owner="alpha")
        with pytest.raises(NotFoundError):
            store.commit(mine.id, owner="bravo")  # another tenant's: as if absent
        with pytest.raises(NotFoundError):
            store.commit(mine.id)  # nor may an unscoped caller commit it by its id
        assert not store.release(mine.id, owner="bravo")
        assert mine.id in store.leases
        store.host.memview(mine.entries[0])[:] = b"\x01" * LENGTH
        assert store.commit(mine.id, owner="alpha") == 1
        assert store.host.contains(key(1))

    asyncio.run(main())
    store.close()
