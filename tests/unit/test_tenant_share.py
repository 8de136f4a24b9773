"""Tenants share a tier fairly (`kvstore.tiering`): the owner holding the most gives way
(per unit of weight, where the operator gave tenants weights).

A tenant that publishes without end must not push another tenant's blocks out of a tier once
it holds as much as that tenant: each owner's blocks have their own eviction policy, and the
victim comes from the owner holding the most bytes. Without tenants (one owner) the order is
the eviction policy's alone. Driven on `TierPolicy` directly, on a `TieredStore` (host and
disk), and on a disk tier reopened from its index.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvstore.errors import CapacityError, InvalidArgumentError
from kvstore.eviction import POLICIES
from kvstore.server.store import TieredStore
from kvstore.server.tenancy import Scope, owner_tag
from kvstore.tiering import OWNER_BYTES, TierPolicy, owner_of
from kvstore.tiers.base import PAGE
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier
from kvstore.tiers.remote import namespace_pattern, redis_key

A, B, C = b"\xa7kvTaaaa", b"\xa7kvTbbbb", b"\xa7kvTcccc"
SIZE = 10


def put(p: TierPolicy, key: str, owner: bytes = b"") -> list[str]:
    """Make room as the daemon does (victims, then remove), add `key`; returns the victims."""
    gone = p.victims(SIZE, owner)
    for v in gone:
        p.remove(v)
    p.add(key.encode(), SIZE, owner)
    return [v.decode() for v in gone]


def filled(capacity: int, *runs: tuple[str, bytes, int]) -> TierPolicy:
    """An LRU tier of `capacity` blocks, given `n` blocks named `prefix0..` of each owner."""
    p = TierPolicy("host", capacity * SIZE, "lru")
    for prefix, owner, n in runs:
        for i in range(n):
            put(p, f"{prefix}{i}", owner)
    return p


def held(p: TierPolicy, prefix: str) -> list[str]:
    return sorted(k.decode() for k in p._sizes if k.decode().startswith(prefix))


@pytest.mark.parametrize("eviction", sorted(POLICIES))
def test_a_flood_never_evicts_a_tenant_holding_less_than_its_share(eviction: str) -> None:
    p = TierPolicy("host", 10 * SIZE, eviction)
    for i in range(3):
        put(p, f"b{i}", B)
    for i in range(200):  # alpha publishes 20 tiers' worth
        gone = put(p, f"a{i:03}", A)
        assert not [v for v in gone if v.startswith("b")], (i, gone)
    assert held(p, "b") == ["b0", "b1", "b2"]
    assert p.held_by(A) == 7 * SIZE and p.held_by(B) == 3 * SIZE


def test_a_tenant_over_its_share_keeps_half_against_one_flooder() -> None:
    p = filled(10, ("b", B, 8), ("a", A, 50))
    # Bravo gave way down to an equal share, its least recent first; then alpha evicted its own.
    assert held(p, "b") == ["b3", "b4", "b5", "b6", "b7"]
    assert p.held_by(A) == p.held_by(B) == 5 * SIZE


@pytest.mark.parametrize("eviction", sorted(POLICIES))
def test_a_tenant_alone_is_evicted_as_without_tenants(eviction: str) -> None:
    """One owner, a tenant or the unscoped callers: the same victims under every policy."""
    now = [0.0]
    tiers = [TierPolicy("host", 12 * SIZE, eviction, clock=lambda: now[0]) for _ in range(2)]
    gone: list[list[str]] = [[], []]
    for i in range(60):
        now[0] = i * 3.0
        for t, owner, out in zip(tiers, (b"", A), gone, strict=True):
            chain = [f"c{i % 7}-{j}".encode() for j in range(3)]
            t.touch_chain(chain)
            for key in chain:
                if key not in t:
                    out += put(t, key.decode(), owner)
            t.touch_chain(chain)
    assert gone[0] == gone[1] and gone[0]
    assert tiers[1].share_of(A) == 12 * SIZE  # alone: the whole tier


def test_each_owners_policy_is_sized_by_an_equal_share() -> None:
    p = TierPolicy("host", 12 * SIZE, "s3fifo")
    put(p, "u0")
    assert p.share_of(b"") == 12 * SIZE
    put(p, "a0", A)
    put(p, "b0", B)
    assert p.share_of(b"") == p.share_of(A) == p.share_of(B) == 4 * SIZE
    p.remove(b"b0")
    p.remove(b"u0")
    assert p.share_of(A) == 12 * SIZE and p.share_of(B) == 0
    assert p.share_of(b"") == 6 * SIZE  # holding nothing: sized as it would be on joining


@pytest.mark.parametrize("eviction", sorted(POLICIES))
def test_a_weighted_tenant_keeps_its_larger_share_against_a_flood(eviction: str) -> None:
    """Bravo weighs 3 against alpha's 1: holding 3/4 of a full tier, it keeps all of it
    while alpha publishes 20 tiers' worth; with equal weights it would give way to half."""
    p = TierPolicy("host", 12 * SIZE, eviction)
    p.set_weights({B: 3})
    for i in range(9):
        put(p, f"b{i}", B)
    for i in range(240):
        gone = put(p, f"a{i:03}", A)
        assert not [v for v in gone if v.startswith("b")], (i, gone)
    assert p.held_by(B) == 9 * SIZE and p.held_by(A) == 3 * SIZE
    assert p.fair_share(B) == 9 * SIZE and p.fair_share(A) == 3 * SIZE
    assert p.share_of(B) == 9 * SIZE and p.share_of(A) == 3 * SIZE  # its policy's size
    equal = filled(12, ("b", B, 9), ("a", A, 240))  # the control: weights of 1
    assert equal.held_by(B) == equal.held_by(A) == 6 * SIZE


def test_weights_decide_who_gives_way_past_the_shares() -> None:
    """Over their shares, the owner holding the most per unit of weight gives way first, and
    an owner within its weighted share never does: alpha (weight 3) holds 6 of 10, bravo 4;
    a third tenant's blocks come from bravo (4 per unit against alpha's 2) down to bravo's
    share, then from nobody. With equal weights alpha would give way first."""
    p = TierPolicy("host", 10 * SIZE, "lru")
    p.set_weights({A: 3})
    for i in range(6):
        put(p, f"a{i}", A)
    for i in range(4):
        put(p, f"b{i}", B)
    assert p.victims(SIZE, C) == [b"b0"]
    assert p.victims(2 * SIZE, C) == [b"b0", b"b1"]
    with pytest.raises(CapacityError):  # alpha at 6 of its 6, bravo at 2 of its 2
        p.victims(3 * SIZE, C)
    p.set_weights({})  # the control: equal weights
    assert p.victims(2 * SIZE, C) == [b"a0", b"a1"]
    # Unscoped callers weigh 1 unless named (b""), as any tenant not named.
    p.set_weights({b"": 4})
    assert p.weight(A) == 1 and p.weight(b"") == 4


def test_weighted_unscoped_callers_alone_keep_their_share_against_a_newcomer() -> None:
    """The unscoped callers (weight 3) alone fill the tier: a tenant's blocks take its own
    quarter from them, and no more."""
    p = TierPolicy("host", 12 * SIZE, "lru")
    p.set_weights({b"": 3})
    for i in range(12):
        put(p, f"u{i:02}")
    for i in range(20):
        put(p, f"a{i:02}", A)
    assert p.held_by(b"") == 9 * SIZE and p.held_by(A) == 3 * SIZE
    assert held(p, "u") == [f"u{i:02}" for i in range(3, 12)]  # its least recent gave way


@pytest.mark.parametrize("heavy", [B, b""], ids=["tenant", "unscoped"])
def test_a_tenant_whose_weighted_share_is_under_one_block_gets_no_room(heavy: bytes) -> None:
    """An owner of weight 20 within its share of a full tier (100 of its 105 bytes' 100):
    alpha's share (5) is under one of its blocks, so nobody gives way (the guarantee to the
    heavy owner first), as documented. The unscoped callers alone too: the one-owner shortcut
    used to give their block up."""
    p = TierPolicy("host", 10 * SIZE + SIZE // 2, "lru")
    p.set_weights({heavy: 20})
    for i in range(10):
        put(p, f"h{i}", heavy)
    assert p.fair_share(A) < SIZE
    with pytest.raises(CapacityError):
        p.victims(SIZE, A)
    assert p.held_by(heavy) == 10 * SIZE


@pytest.mark.parametrize("weight", [0, -1, float("inf"), float("nan")])
def test_a_weight_that_is_not_a_positive_number_is_refused(weight: float) -> None:
    p = TierPolicy("host", 10 * SIZE, "lru")
    with pytest.raises(InvalidArgumentError, match="must be a positive number"):
        p.set_weights({A: weight})
    assert p.weight(A) == 1  # unchanged


def test_weights_carry_over_a_change_of_eviction_policy() -> None:
    p = TierPolicy("host", 12 * SIZE, "lru")
    p.set_weights({B: 3})
    put(p, "a0", A)
    q = p.with_eviction("s3fifo")
    assert q.weight(B) == 3 and q.fair_share(B) == 9 * SIZE and q.share_of(A) == 12 * SIZE


def test_without_tenants_the_order_is_the_policys_own() -> None:
    fair, plain = TierPolicy("host", 5 * SIZE, "lru"), POLICIES["lru"](5 * SIZE, {})
    evicted: list[str] = []
    for i in range(12):
        evicted += put(fair, f"k{i:02}")
        if len(plain._lru) == 5:  # type: ignore[attr-defined]
            v = plain.victim()
            assert v is not None
            plain.remove(v)
        plain.insert(f"k{i:02}".encode(), SIZE)
        if i % 3 == 0:
            fair.touch_chain([b"k00"])
            plain.touch_chain([b"k00"])
    assert evicted == [f"k{i:02}" for i in range(1, 8)]
    assert list(fair.eviction_order()) == list(plain.order())


def test_pinned_blocks_of_the_largest_owner_make_the_next_one_give_way() -> None:
    p = TierPolicy("host", 6 * SIZE, "lru")
    for i in range(4):
        put(p, f"a{i}", A)
        p.pin(f"a{i}".encode())
    put(p, "b0", B)
    put(p, "b1", B)
    assert put(p, "b2", B) == ["b0"]  # alpha holds more, but every block of it is pinned
    p.unpin(b"a0")
    assert put(p, "b3", B) == ["a0"]


def test_an_owner_pinning_its_blocks_cannot_pass_its_evictions_to_one_within_its_share(
) -> None:
    """Alpha holds 6 of 8 blocks, every one pinned (a tenant fetching its own blocks to keep
    them), and publishes more: bravo, within its half, keeps both blocks; alpha's publish
    finds no room instead. Before, the pins passed the eviction on to bravo."""
    p = filled(8, ("b", B, 2), ("a", A, 6))
    for i in range(6):
        p.pin(f"a{i}".encode())
    with pytest.raises(CapacityError):
        p.victims(SIZE, A)
    assert p.next_victim(A, SIZE) is None
    assert put(p, "b2", B) == ["b0"]  # bravo's own publish makes room from its own
    p.unpin(b"a3")
    assert put(p, "a6", A) == ["a3"]
    # An owner over its share that is not the largest still gives way past pinned ones.
    q = filled(9, ("a", A, 5), ("b", B, 4))
    for i in range(5):
        q.pin(f"a{i}".encode())
    assert put(q, "c0", C) == ["b0"]  # bravo holds 4 of 9, over a third
    assert put(q, "c1", C) == ["c0"]  # bravo at 3 of 9 is within its third: carol's own


def test_scratch_space_counts_for_its_reader_and_room_by_the_count_may_come_from_anyone(
) -> None:
    """Scratch space (a fetch's, under no key, never a victim) counts in the share of the
    reader it was taken for: the unscoped callers' scratch makes alpha, holding half, the one
    over its third; bravo's own makes bravo give way for its next, not alpha within its half.
    And where the count says a block fits but the allocator has no contiguous room, any owner
    may give way, as without the bound."""
    p = filled(8, ("a", A, 4))
    p.take_scratch(4 * SIZE, b"")  # a same-node reader's
    assert p.victims(SIZE, B) == [b"a0"]
    assert p.next_victim(B, SIZE) == b"a0"
    p.give_scratch(4 * SIZE, b"")
    assert p.used_bytes == 4 * SIZE
    p = filled(8, ("a", A, 4), ("b", B, 3))
    p.take_scratch(SIZE, B)  # bravo reads past its half
    assert p.victims(SIZE, B) == [b"b0"]
    p.give_scratch(SIZE, B)
    q = filled(8, ("a", A, 2), ("b", B, 2))
    for i in range(2):
        q.pin(f"b{i}".encode())
    assert q.victims(SIZE, B) == []  # it fits by the count
    assert q.next_victim(B, SIZE) == b"a0"  # the allocator's fallback: within share or not


def test_a_tenant_holding_only_scratch_space_is_an_owner_too() -> None:
    """Alpha's read holds 6 of 10 blocks' worth of scratch space and alpha has no block here
    (one eviction policy: the unscoped callers'). Its next block cannot push the unscoped
    callers, holding 4, under half: before, one owner's policy decided alone. The metric's
    view (`owners`) counts the scratch space too; giving back more than was taken is refused."""
    p = filled(10, ("u", b"", 4))
    p.take_scratch(6 * SIZE, A)
    with pytest.raises(CapacityError):
        p.victims(SIZE, A)
    assert p.owners() == {b"": 4 * SIZE, A: 6 * SIZE}
    with pytest.raises(InvalidArgumentError):
        p.give_scratch(7 * SIZE, A)
    p.give_scratch(6 * SIZE, A)
    assert p.owners() == {b"": 4 * SIZE} and p.used_bytes == 4 * SIZE


def test_one_plan_shares_out_its_victims_by_what_each_owner_holds_after_the_last() -> None:
    p = filled(8, ("a", A, 5), ("b", B, 3))
    # 4 blocks of room: alpha 5 -> 3, then they alternate (ties go to the owner seen first).
    got = [v.decode() for v in p.victims(4 * SIZE)]
    assert got[:2] == ["a0", "a1"] and sorted(got[2:]) == ["a2", "b0"]
    assert len(p) == 8 and p.held_by(A) == 5 * SIZE  # a plan removes nothing itself


def test_the_fair_eviction_order_names_every_unpinned_block_once() -> None:
    p = TierPolicy("host", 20 * SIZE, "s3fifo")
    for i in range(6):
        p.add(f"a{i}".encode(), SIZE, A)
    for i in range(3):
        p.add(f"b{i}".encode(), SIZE, B)
    p.add(b"u0", SIZE)
    p.pin(b"a5")
    order = [k.decode() for k in p.eviction_order()]
    assert sorted(order) == sorted(["a0", "a1", "a2", "a3", "a4", "b0", "b1", "b2", "u0"])
    assert order[:3] == ["a0", "a1", "a2"]  # alpha holds 6 against 3 and 1


def test_an_owner_is_forgotten_with_its_last_block_and_a_copy_keeps_owners() -> None:
    p = TierPolicy("host", 10 * SIZE, "lru")
    p.add(b"a0", SIZE, A)
    p.add(b"b0", SIZE, B)
    p.remove(b"a0")
    assert A not in p._policies and p.held_by(A) == 0
    q = p.with_eviction("arc")
    assert q.owner(b"b0") == B and q.held_by(B) == SIZE
    assert type(q._policies[B]) is POLICIES["arc"]


def test_stored_tenant_namespaces_name_their_tenant_and_no_other() -> None:
    alpha, bravo = Scope("alpha"), Scope("bravo")
    ns1, ns2 = b"\x01" * 32, b"\x02" * 32
    a1, a2, b1 = alpha.namespace(ns1), alpha.namespace(ns2), bravo.namespace(ns1)
    assert len(a1) == 32 and len({a1, a2, b1}) == 3
    assert owner_of(a1) == owner_of(a2) == a1[-OWNER_BYTES:]  # whatever namespace it sends
    # Its first bytes are its own: they name it in the remote tier's keys and Clear's pattern.
    assert len({redis_key(n, b"k")[:24] for n in (a1, a2, b1)}) == 3
    assert namespace_pattern(a1) != namespace_pattern(a2)
    assert owner_of(b1) not in (b"", owner_of(a1))
    assert owner_of(Scope("").namespace(ns1)) == owner_of(ns1) == b""  # unscoped
    assert owner_of(b"") == b""
    assert owner_tag("alpha") == owner_of(a1) and owner_tag("") == b""  # the caller's tag


def _store(tmp_path: Path, host_blocks: int, disk_blocks: int) -> TieredStore:
    host = HostTier(host_blocks * 2 * PAGE, shm_dir=tmp_path)
    disk = DiskTier(tmp_path / "disk", disk_blocks * 3 * PAGE, sync="never")
    return TieredStore(host, disk, io_threads=2)


LAYOUT, LENGTH = b"L" * 32, 5000  # 2 pages in host, 3 on disk


async def _publish(store: TieredStore, ns: bytes, keys: list[bytes]) -> None:
    lease = await store.reserve(ns, LAYOUT, keys, LENGTH)
    for entry in lease.entries:
        store.host.memview(entry)[:] = entry.key[-1:] * LENGTH
    store.commit(lease.id)


def test_a_flood_through_the_store_keeps_the_other_tenants_blocks_in_host_and_on_disk(
        tmp_path: Path) -> None:
    ns_a, ns_b = Scope("alpha").namespace(b"n" * 32), Scope("bravo").namespace(b"n" * 32)
    bravo = [b"b" + i.to_bytes(31, "big") for i in range(6)]
    store = _store(tmp_path, host_blocks=8, disk_blocks=16)
    try:
        async def main() -> None:
            await _publish(store, ns_b, bravo)  # 6 of host's 8: more than its half
            for r in range(20):  # alpha: 80 blocks, 3x host and disk together
                await _publish(store, ns_a, [b"a" + (4 * r + i).to_bytes(31, "big")
                                             for i in range(4)])
            # Host: bravo gave way to half (its deepest blocks first, to disk), no further.
            assert store.lookup(bravo) == ["host"] * 4 + ["disk"] * 2
            assert store.host.policy.held_by(owner_of(ns_a)) == 4 * 2 * PAGE
            # Bravo reads its prompt back. Its host blocks are pinned by the read and alpha
            # holds its half, so the read stops short (`more`: the client copies and asks
            # again); then bravo's own blocks, copied already, give way for scratch space.
            got = []
            for keys, prior in ((bravo, []), (bravo[4:], bravo[:4])):
                lease = await store.fetch(keys, LAYOUT, ns_b, owner="bravo", prior=prior)
                got += [bytes(store.host.memview(e)) for e in lease.entries]
                assert lease.more == (not prior)
                assert store.host.policy.held_by(owner_of(ns_a)) == 4 * 2 * PAGE
                store.release(lease.id)
            assert got == [k[-1:] * LENGTH for k in bravo]
            assert store.lookup(bravo) == ["host"] * 2 + ["disk"] * 4
            assert store.host.policy.held_by(owner_of(ns_a)) == 4 * 2 * PAGE

        asyncio.run(main())
    finally:
        store.close()


def test_a_reopened_disk_tier_knows_each_blocks_owner(tmp_path: Path) -> None:
    ns = Scope("alpha").namespace(b"n" * 32)
    disk = DiskTier(tmp_path / "disk", 8 * 3 * PAGE, sync="always")
    for i, n in enumerate((ns, b"u" * 32)):
        entry = disk.prepare_store(bytes([i]) * 32, n, LAYOUT, LENGTH)
        assert entry is not None
        disk.write(entry, b"x" * LENGTH)
        disk.complete_store(entry)
    disk.close()
    again = DiskTier(tmp_path / "disk", 8 * 3 * PAGE, sync="always")
    try:
        assert again.policy.owner(b"\x00" * 32) == owner_of(ns) != b""
        assert again.policy.owner(b"\x01" * 32) == b""
        assert again.policy.held_by(owner_of(ns)) == 3 * PAGE
    finally:
        again.close()


def test_the_flood_benchmark_keeps_bravos_hits_with_shares_and_not_without() -> None:
    """`benchmarks.tenant_flood` on a synthetic trace: bravo repeats 5 conversations of 4
    blocks; in a 48-block LRU tier alpha's fresh blocks push them all out in one order, and
    with shares bravo keeps them (20 blocks: within its half)."""
    from benchmarks.simulate import make_request
    from benchmarks.tenant_flood import bravo_hit_rate

    convs = [[c * 10 + i for i in range(4)] for c in range(5)]
    requests = [make_request(ids) for _ in range(5) for ids in convs]
    alone = bravo_hit_rate(requests, 48, 0, shares=False, eviction="lru")
    assert alone == pytest.approx(4 / 5)  # every round after the first hits
    assert bravo_hit_rate(requests, 48, 4, shares=True, eviction="lru") == pytest.approx(4 / 5)
    assert bravo_hit_rate(requests, 48, 4, shares=False, eviction="lru") == 0.0


def test_the_tenant_bytes_metric_names_listed_unlisted_and_unscoped_owners(
        tmp_path: Path) -> None:
    """`kvstore_tier_tenant_bytes`: a tenant of the tokens file by its name, one it no longer
    lists (blocks read back from disk, say) by "?" and its tag's hex, unscoped blocks as ""."""
    from kvstore.server.metrics import Metrics

    store = _store(tmp_path, host_blocks=8, disk_blocks=4)
    try:
        async def main() -> None:
            for i, ns in enumerate((Scope("alpha").namespace(b"n" * 32),
                                    Scope("gone").namespace(b"n" * 32), b"u" * 32)):
                await _publish(store, ns, [bytes([i]) * 32])

        asyncio.run(main())
        metrics = Metrics(store, tenants=["alpha"])
        gone = f"?{owner_tag('gone')[4:].hex()}"
        for tenant in ("alpha", gone, ""):
            assert metrics.registry.get_sample_value(
                "kvstore_tier_tenant_bytes", {"tier": "host", "tenant": tenant}) == 2 * PAGE
    finally:
        store.close()
