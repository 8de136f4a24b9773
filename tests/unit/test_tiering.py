"""TierPolicy: exact LRU order, leaf before parent, pins, capacity, accounting."""

from __future__ import annotations

import pytest

from kvstore.errors import CapacityError, InvalidArgumentError
from kvstore.tiering import TierPolicy


def k(name: str) -> bytes:
    return name.encode()


def policy(capacity: int = 100, keys: str = "", size: int = 10) -> TierPolicy:
    p = TierPolicy("t", capacity)
    for name in keys.split():
        p.add(k(name), size)
    return p


def names(keys: list[bytes] | object) -> list[str]:
    return [x.decode() for x in keys]  # type: ignore[attr-defined]


def test_negative_capacity_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="capacity"):
        TierPolicy("t", -1)


def test_add_accounts_bytes_and_order() -> None:
    p = policy(100, "a b c")
    assert len(p) == 3
    assert p.used_bytes == 30
    assert k("b") in p
    assert k("z") not in p
    assert p.size_of(k("b")) == 10
    assert names(p.lru_order()) == ["a", "b", "c"]
    assert p.fits(70)
    assert not p.fits(71)


def test_add_existing_moves_to_end_without_double_counting() -> None:
    p = policy(100, "a b c")
    p.add(k("a"), 10)
    assert names(p.lru_order()) == ["b", "c", "a"]
    assert p.used_bytes == 30
    assert len(p) == 3


def test_add_larger_than_capacity_raises() -> None:
    p = policy(100)
    with pytest.raises(CapacityError, match="exceeds"):
        p.add(k("x"), 101)
    assert p.used_bytes == 0
    assert len(p) == 0


def test_exact_lru_eviction_order() -> None:
    p = policy(50, "a b c d e")
    assert p.victims(0) == []
    assert names(p.victims(10)) == ["a"]
    assert names(p.victims(11)) == ["a", "b"]
    assert names(p.victims(50)) == ["a", "b", "c", "d", "e"]
    p.touch_chain([k("a")])
    p.touch_chain([k("c")])
    assert names(p.victims(30)) == ["b", "d", "e"]
    assert p.victims(10) == [k("b")]
    # victims() does not remove anything
    assert len(p) == 5
    assert p.used_bytes == 50


def test_victims_with_room_returns_nothing() -> None:
    p = policy(100, "a b")
    assert p.victims(80) == []
    assert names(p.victims(81)) == ["a"]


def test_victims_sized_by_bytes() -> None:
    p = TierPolicy("t", 100)
    p.add(k("small"), 5)
    p.add(k("big"), 60)
    p.add(k("mid"), 30)
    assert p.used_bytes == 95
    assert p.victims(5) == []
    assert names(p.victims(10)) == ["small"]
    assert names(p.victims(11)) == ["small", "big"]  # 5 bytes of room are not enough


def test_touch_chain_leaf_is_first_victim() -> None:
    p = policy(40, "p0 p1 p2 p3")  # added root first: root would be the first victim
    assert names(p.victims(10)) == ["p0"]
    p.touch_chain([k("p0"), k("p1"), k("p2"), k("p3")])
    assert names(p.victims(40)) == ["p3", "p2", "p1", "p0"]


def test_two_chains_sharing_a_parent() -> None:
    p = TierPolicy("t", 1000)
    root, a1, a2, b1 = k("root"), k("a1"), k("a2"), k("b1")
    for key in (root, a1, a2, b1):
        p.add(key, 10)
    p.touch_chain([root, a1, a2])
    p.touch_chain([root, b1])
    order = list(p.lru_order())
    # Every child leaves before the shared parent, whichever chain was used last.
    assert order.index(root) == len(order) - 1
    assert order.index(a2) < order.index(a1) < order.index(root)
    assert order == [a2, a1, b1, root]
    p.touch_chain([root, a1])  # a shorter prefix use keeps the parent last, a2 first
    assert list(p.lru_order()) == [a2, b1, a1, root]


def test_touch_chain_skips_unknown_keys() -> None:
    p = policy(100, "a b")
    p.touch_chain([k("a"), k("missing"), k("b")])
    assert names(p.lru_order()) == ["b", "a"]
    assert len(p) == 2


def test_pinned_never_victims() -> None:
    p = policy(30, "a b c")
    p.pin(k("a"))
    assert p.is_pinned(k("a"))
    assert names(p.victims(10)) == ["b"]
    assert names(p.victims(20)) == ["b", "c"]
    assert names(p.lru_order()) == ["b", "c"]
    p.unpin(k("a"))
    assert not p.is_pinned(k("a"))
    assert names(p.victims(10)) == ["a"]


def test_pin_counts() -> None:
    p = policy(20, "a b")
    p.pin(k("a"))
    p.pin(k("a"))
    p.unpin(k("a"))
    assert p.is_pinned(k("a"))
    assert names(p.victims(10)) == ["b"]
    with pytest.raises(CapacityError):
        p.victims(20)
    p.unpin(k("a"))
    assert not p.is_pinned(k("a"))
    assert names(p.victims(20)) == ["a", "b"]
    p.unpin(k("a"))  # unpinning an unpinned block is harmless
    assert not p.is_pinned(k("a"))
    assert p.stats().pinned_blocks == 0


def test_pin_unknown_block_rejected() -> None:
    p = policy(20, "a")
    with pytest.raises(InvalidArgumentError, match="cannot pin"):
        p.pin(k("nope"))


def test_capacity_error_when_everything_pinned() -> None:
    p = policy(30, "a b c")
    for name in "abc":
        p.pin(k(name))
    assert p.victims(0) == []
    with pytest.raises(CapacityError, match="3 pinned"):
        p.victims(1)


def test_capacity_error_when_unpinned_are_not_enough() -> None:
    p = policy(30, "a b c")
    p.pin(k("a"))
    p.pin(k("b"))
    assert names(p.victims(10)) == ["c"]
    with pytest.raises(CapacityError):
        p.victims(11)


def test_remove_updates_used_bytes_and_pins() -> None:
    p = TierPolicy("t", 100)
    p.add(k("a"), 10)
    p.add(k("b"), 25)
    p.pin(k("b"))
    assert p.remove(k("b")) == 25
    assert p.used_bytes == 10
    assert k("b") not in p
    assert not p.is_pinned(k("b"))
    assert p.remove(k("b")) == 0  # absent
    assert p.used_bytes == 10
    assert p.remove(k("a")) == 10
    assert p.used_bytes == 0
    assert len(p) == 0
    p.add(k("b"), 25)  # re-adding after removal starts unpinned
    assert not p.is_pinned(k("b"))


def test_evictions_counted_and_stats() -> None:
    p = policy(100, "a b c")
    p.pin(k("a"))
    p.count_eviction()
    p.count_eviction(2)
    s = p.stats()
    assert (s.blocks, s.used_bytes, s.capacity_bytes, s.pinned_blocks, s.evictions) == (
        3, 30, 100, 1, 3)


def test_recent_chains_newest_first_bounded_by_keys() -> None:
    from kvstore.tiering import RecentChains

    recent = RecentChains(max_keys=6)
    a, b = [b"a0", b"a1", b"a2"], [b"b0", b"b1"]
    recent.add(a)
    recent.add(b)
    recent.add([])  # nothing used: nothing recorded
    assert list(recent.newest_first()) == [b, a]
    recent.add(a)  # the same chain again (same last key): moved, not duplicated
    assert list(recent.newest_first()) == [a, b] and len(recent) == 2
    longer = [b"b0", b"b1", b"b2"]  # extends b: a new chain (another last key)
    recent.add(longer)  # 8 keys held > 6: the oldest chain (b) is forgotten
    assert list(recent.newest_first()) == [longer, a]
    huge = [bytes([i]) for i in range(10)]
    recent.add(huge)  # larger than the bound alone: kept, everything older forgotten
    assert list(recent.newest_first()) == [huge]
