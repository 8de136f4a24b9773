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


def flushed(h: Hierarchy, below: int, budget: int = 1 << 30) -> list[bytes]:
    """What a flush into `below` writes, `budget` blocks at most: each key the engine names is
    placed there before the next is asked for, as the daemon writes it."""
    out: list[bytes] = []
    for k in h.flush_order(below):
        if len(out) == budget:
            break
        out.append(k)
        assert h.place(below, k, B)
    return out


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
    assert h.place(1, key(1), B)
    assert flushed(h, 1) == [key(0), key(2), key(3)]


def test_flush_order_puts_recent_chains_head_first_then_the_rest_hottest_first() -> None:
    h = chain(8, 8, recent=RecentChains(100))
    for i in range(6):
        assert h.place(0, key(i), B)
    h.touch([key(4)])
    h.touch([key(5)])  # the newest block, but no chain used lately names it first ...
    h.touch([key(0), key(1)])  # ... after this one
    assert flushed(h, 1) == [key(0), key(1), key(5), key(4), key(3), key(2)]


def test_an_ended_session_loses_its_flush_rank_and_goes_first_on_every_level() -> None:
    h = chain(8, 8, "prefix", RecentChains(100))
    for i in range(6):
        assert h.place(0, key(i), B)
    h.touch([key(4)])
    h.touch([key(5)])
    h.touch([key(0), key(1)])  # the newest chain: flushed first ...
    assert h.place(1, key(1), B)  # (disk holds its leaf too)
    # ... until its client says the conversation ended: both levels mark their blocks.
    assert h.end_session([key(0), key(1)]) == 3
    assert next(h.levels[0].policy.eviction_order()) == key(1)
    assert next(h.levels[1].policy.eviction_order()) == key(1)
    assert flushed(h, 1)[:2] == [key(5), key(4)]


def test_flush_skips_what_lies_past_a_hole() -> None:
    # A chain stops at a block no level holds: past it nothing can be reached, so its rest is
    # not written at all (it used to come back with the rest of the level, hottest first).
    h = chain(8, 8, recent=RecentChains(100))
    for i in range(6):
        assert h.place(0, key(i), B)
    h.touch([key(4)])
    h.touch([key(5)])
    h.touch([key(0), key(1)])
    h.levels[0].policy.remove(key(0))
    assert flushed(h, 1) == [key(5), key(4), key(3), key(2)]


def test_flush_cut_short_writes_prompt_starts_not_blocks_past_a_hole_it_made() -> None:
    # Disk full (4 blocks, LRU). Prompt B has its start (b0, b1) on disk, its tail (b2, b3)
    # in host only; Z (z0, z1) is on disk; A (a0, a1), the newest, in host only. Writing A
    # evicts B's start from disk, so B's tail is worth nothing after a restart: a budget of 4
    # writes goes to A and B's start again (host still holds it). The order planned before the
    # writes (the old one) spent it on a0, a1, b2, b3: after a restart only A was reachable.
    h = chain(8, 4, recent=RecentChains(100))
    b, z, a = [key(i) for i in range(4)], [key(10), key(11)], [key(20), key(21)]
    for k in b[:2] + z:
        assert h.place(1, k, B)
    for k in b + z + a:
        assert h.place(0, k, B)
    h.touch(b)
    h.touch(z)
    h.touch(a)
    assert flushed(h, 1, budget=4) == [a[0], a[1], b[0], b[1]]
    disk = h.levels[1].policy
    assert [k in disk for k in a + b] == [True, True, True, True, False, False]


def gpu_chain(gpu: int, host: int, disk: int) -> Hierarchy:
    """gpu over host over disk, clients served from host (the daemon's chain with gpu_bytes)."""
    return Hierarchy([MetaLevel(TierPolicy(name, blocks * B))
                      for name, blocks in (("gpu", gpu), ("host", host), ("disk", disk))], serve=1)


def test_gpu_level_is_read_through_host_and_its_victims_go_down_to_host() -> None:
    h = gpu_chain(2, 3, 8)
    fill(h, 1, [0, 1, 2])
    fill(h, 0, [1, 5])  # 1 was lifted from host (kept there too); host has lost 5 since
    fill(h, 2, [2, 5])
    # A key host holds is read from host (no copy) even where gpu holds it too; else from
    # the fastest level holding it (gpu before disk).
    assert h.walk([key(i) for i in (0, 1, 5, 2, 9)]) == ["host", "host", "gpu", "host"]
    assert (h.source(key(1)), h.source(key(5)), h.source(key(9))) == (1, 0, None)
    # A client that maps gpu's slab reads from the fastest level holding a key, gpu first.
    assert [h.source(key(i), fastest=True) for i in (0, 1, 5, 2, 9)] == [1, 0, 0, 1, None]
    # gpu victims go to host unless host holds them.
    assert h.room(0, 2 * B).moves == [Move(key(1), 0, None), Move(key(5), 0, 1)]
    # A block entering a full gpu pushes its victim down, which pushes host's down to disk.
    changes: list[tuple[str, int, bool]] = []
    h.touch([key(1)])  # 5 is gpu's LRU block now
    assert h.place(0, key(7), B, lambda lvl, k, stored: changes.append(
        (lvl, int.from_bytes(k, "little"), stored)))
    assert changes == [("disk", 0, True), ("host", 0, False), ("host", 5, True),
                       ("gpu", 5, False), ("gpu", 7, True)]
    for level, cap in zip(h.levels, (2, 3, 8), strict=True):
        assert level.policy.used_bytes <= cap * B


def test_lift_copies_a_fetched_prompt_up_from_its_start_within_the_gpu_level() -> None:
    h = gpu_chain(3, 8, 8)
    prompt = [key(i) for i in range(5)]
    fill(h, 0, [1])  # block 1 is in gpu already
    # Of the blocks served, those gpu lacks, in order, while the prompt fits gpu's 3 blocks.
    assert h.lift(prompt, set(prompt), B) == [key(0), key(2)]
    assert h.lift(prompt, {key(3), key(4)}, B) == [key(3), key(4)]  # a later window's keys
    assert h.lift(prompt, set(prompt), 0) == []
    assert chain(8, 8).lift(prompt, set(prompt), B) == []  # nothing above the serve level


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
    # Past its share, the prompt's deepest block only this fetch pins gives way; within it, none.
    s = PromptShare(keep=80, limit=80, used=85)
    assert s.giving_way([True, True, False]) == 1 and s.giving_way([False, False]) is None
    s.used = 80
    assert s.giving_way([True, True]) is None
