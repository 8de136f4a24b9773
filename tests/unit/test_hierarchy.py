"""The placement engine (`kvstore.tiers.hierarchy`): exact plans on metadata-only levels."""

from __future__ import annotations

import pytest

from kvstore.tiering import RecentChains, TierPolicy
from kvstore.tiers.hierarchy import Hierarchy, MetaLevel, Move, PromptShare

B = 10  # bytes per block


def key(i: int) -> bytes:
    return i.to_bytes(8, "little")


def chain(host_blocks: int, disk_blocks: int, eviction: str = "lru",
          recent: RecentChains | None = None) -> Hierarchy:
    return Hierarchy([MetaLevel(TierPolicy("host", host_blocks * B, eviction)),
                      MetaLevel(TierPolicy("disk", disk_blocks * B, eviction))], recent)


def fill(h: Hierarchy, level: int, ids: list[int]) -> None:
    for i in ids:
        assert h.place(level, key(i), B)
        h.levels[level].policy.touch_chain([key(i)])


def test_victims_go_down_unless_the_level_below_holds_them() -> None:
    h = chain(3, 4)
    fill(h, 0, [0, 1, 2])
    fill(h, 1, [1])  # block 1 was promoted from disk: it is on both
    plan = h.room(0, 2 * B)
    assert plan.short == ""
    assert plan.moves == [Move(key(0), 0, 1), Move(key(1), 0, None)]  # LRU order, 1 kept below
    assert h.room(1, B).moves == []  # room there already
    assert h.room(1, B, partial=True).moves == [Move(key(1), 1, None)]  # the last level drops


def test_room_is_short_when_pins_hold_the_rest_and_partial_still_names_a_victim() -> None:
    h = chain(3, 4)
    fill(h, 0, [0, 1, 2])
    host = h.levels[0].policy
    host.pin(key(0))
    host.pin(key(1))
    plan = h.room(0, 2 * B)
    assert plan.moves == [] and "pinned" in plan.short
    partial = h.room(0, 2 * B, partial=True)  # the daemon evicts what it can, then retries
    assert partial.moves == [Move(key(2), 0, 1)] and partial.short == ""
    host.pin(key(2))
    assert h.room(0, B, partial=True).short == "host tier is full of pinned or in-flight blocks"


def test_partial_room_names_one_victim_where_the_count_says_it_fits() -> None:
    # A fragmented allocator refuses what the byte count allows: one more victim, then retry.
    h = chain(3, 4)
    fill(h, 0, [0, 1])
    assert h.room(0, B).moves == [] and h.room(0, B).short == ""
    assert h.room(0, B, partial=True).moves == [Move(key(0), 0, 1)]


def test_place_cascades_down_the_chain_with_every_change_reported() -> None:
    h = chain(2, 2)
    fill(h, 0, [0, 1])
    fill(h, 1, [7, 8])
    changes: list[tuple[str, int, bool]] = []
    assert h.place(0, key(2), B,
                   lambda lvl, k, stored: changes.append((lvl, int.from_bytes(k, "little"),
                                                          stored)))
    # Host's LRU block 0 goes to disk, which drops its LRU block 7 for it; then 2 enters host.
    assert changes == [("disk", 7, False), ("disk", 0, True), ("host", 0, False),
                       ("host", 2, True)]
    assert [k in h.levels[0].policy for k in map(key, (0, 1, 2))] == [False, True, True]
    assert h.levels[0].policy.evictions == 1 and h.levels[1].policy.evictions == 1


def test_place_refuses_without_changing_anything() -> None:
    h = chain(2, 2)
    fill(h, 0, [0, 1])
    host = h.levels[0].policy
    host.pin(key(0))
    host.pin(key(1))
    assert not h.place(0, key(2), B)
    assert not h.place(0, key(3), 3 * B)  # larger than the level
    assert len(host) == 2 and len(h.levels[1].policy) == 0 and host.evictions == 0


def test_walk_stops_at_the_first_hole() -> None:
    h = chain(4, 4)
    fill(h, 0, [0, 2])
    fill(h, 1, [1, 3])
    assert h.walk([key(i) for i in range(5)]) == ["host", "disk", "host", "disk"]
    assert h.walk([key(0), key(9), key(2)]) == ["host"]
    assert h.level_of(key(3)) == 1 and h.level_of(key(9)) is None


@pytest.mark.parametrize("eviction", ["lru", "prefix"])
def test_touch_ranks_a_chain_on_every_level_and_keeps_it_for_the_flush(eviction: str) -> None:
    h = chain(8, 8, eviction, RecentChains(100))
    for i in range(4):
        assert h.place(0, key(i), B)
    h.touch([key(0), key(1), key(2), key(3)])  # a prompt: 0 is its head
    assert next(h.levels[0].policy.eviction_order()) == key(3)  # its leaf goes first
    # The flush writes the prompt from its head, skipping what the disk holds already.
    assert h.flush_order(0, {key(1)}) == [key(0), key(2), key(3)]


def test_flush_order_puts_recent_chains_head_first_then_the_rest_hottest_first() -> None:
    h = chain(8, 8, recent=RecentChains(100))
    for i in range(6):
        assert h.place(0, key(i), B)
    h.touch([key(4)])
    h.touch([key(5)])  # the newest block, but no chain used lately names it first ...
    h.touch([key(0), key(1)])  # ... after this one
    assert h.flush_order(0, set()) == [key(0), key(1), key(5), key(4), key(3), key(2)]
    # A chain stops at a block the level lacks: past it nothing can be reached.
    h.levels[0].policy.remove(key(0))
    assert h.flush_order(0, set())[:2] == [key(5), key(4)]


def test_prompt_share() -> None:
    # A prompt that fits is promoted whole: its share is the capacity.
    s = PromptShare.size(100, 10, 5, used=20, rest=60, open_ended=False, local=True)
    assert (s.keep, s.limit) == (100, 80) and s.promotes(5) and not s.over()
    # One that does not keeps its first blocks up to the capacity less two windows.
    s = PromptShare.size(100, 10, 5, used=20, rest=90, open_ended=False, local=True)
    assert s.keep == 80
    s.used = 78
    assert not s.promotes(5)
    s.used = 85
    assert s.over()
    # A shared tier may extend it past what was counted: it must leave the scratch room free.
    s = PromptShare.size(100, 10, 5, used=20, rest=70, open_ended=True, local=False)
    assert s.keep == 80
    # Windows smaller than a block: a block is the window.
    assert PromptShare.size(100, 1, 30, 0, 200, False, True).limit == 40
