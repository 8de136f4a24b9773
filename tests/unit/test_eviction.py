"""Eviction policies (kvstore/eviction.py) behind TierPolicy: exact victim orders worked out by
hand for each policy, and properties every policy keeps (capacity, pins, leaf before parent)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.errors import CapacityError, InvalidArgumentError
from kvstore.eviction import DEFAULT_POLICY, POLICIES, PrefixPolicy, ReuseModel
from kvstore.tiering import TierPolicy

SIZE = 10


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def k(name: str) -> bytes:
    return name.encode()


def names(keys: object) -> list[str]:
    return [x.decode() for x in keys]  # type: ignore[attr-defined]


def tier(policy: str, blocks: int, clock: Clock | None = None) -> TierPolicy:
    return TierPolicy("t", blocks * SIZE, policy, clock or Clock())


def add(p: TierPolicy, *keys: str) -> None:
    for name in keys:
        p.add(k(name), SIZE)


def drain(p: TierPolicy) -> list[str]:
    """Evict until nothing unpinned is left: the order victims come in."""
    out = []
    while (v := p.next_victim()) is not None:
        out.append(v.decode())
        p.remove(v)
    return out


def test_unknown_policy_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="unknown eviction policy 'mru'"):
        TierPolicy("t", 100, "mru")


# ---------------------------------------------------------------- LRU


def test_lru_pinned_blocks_keep_their_place() -> None:
    p = tier("lru", 5)
    add(p, *"abcde")
    p.pin(k("a"))
    p.pin(k("c"))
    assert names(p.victims(20)) == ["b", "d"]  # a and c are parked on the way
    assert names(p.eviction_order()) == ["b", "d", "e"]
    p.unpin(k("c"))
    p.unpin(k("a"))  # unpinned in the other order: LRU order comes back all the same
    assert names(p.eviction_order()) == list("abcde")
    p.touch_chain([k("a")])  # a parked block that is used goes to the end
    assert drain(p) == list("bcdea")


def test_lru_victims_do_not_change_the_order() -> None:
    p = tier("lru", 4)
    add(p, *"abcd")
    assert names(p.victims(40)) == list("abcd")
    assert names(p.victims(20)) == list("ab")
    assert names(p.eviction_order()) == list("abcd")


# ---------------------------------------------------------------- ARC


def test_arc_exact_order() -> None:
    clock = Clock()
    p = tier("arc", 3, clock)
    add(p, *"abc")  # T1 = a b c, p = 0
    clock.now = 10
    p.touch_chain([k("a")])  # a second use: T1 = b c, T2 = a
    assert drain_one(p) == "b"  # |T1| > p: T1's LRU; b's ghost goes to B1
    clock.now = 20
    add(p, "b")  # found in B1: p = 0 + 10 * max(|B2| / |B1|, 1) = 10; b into T2 = a b
    add(p, "d")  # T1 = c d
    assert p.eviction.p == 10  # type: ignore[attr-defined]
    assert drain_one(p) == "c"  # |T1| = 20 > p: c (ghost in B1)
    assert drain_one(p) == "a"  # |T1| = 10, not > p: T2's LRU, a (ghost in B2)
    clock.now = 30
    add(p, "a")  # found in B2: p = max(0, 10 - 10 * max(|B1| / |B2|, 1)) = 0; T2 = b a
    assert p.eviction.p == 0  # type: ignore[attr-defined]
    assert drain(p) == ["d", "b", "a"]  # T1 over p first, then T2 in LRU order


def test_arc_touches_within_one_request_are_one_use() -> None:
    clock = Clock()
    p = tier("arc", 3, clock)
    arc = p.eviction
    add(p, "x", "y")
    clock.now = 1  # the same request (its commit): not a second use, x stays in T1
    p.touch_chain([k("x")])
    clock.now = 10
    p.touch_chain([k("y")])  # a later request: y moves to T2
    assert [arc._where[k(n)] for n in "xy"] == [arc.T1, arc.T2]  # type: ignore[attr-defined]


def drain_one(p: TierPolicy) -> str:
    v = p.next_victim()
    assert v is not None
    p.remove(v)
    return v.decode()


# ---------------------------------------------------------------- S3-FIFO


def test_s3fifo_exact_order() -> None:
    clock = Clock()
    p = tier("s3fifo", 10, clock)  # S's target: 10% = one block
    add(p, *"abcde")  # S = a b c d e
    clock.now = 10
    p.touch_chain([k("b")])  # b: one access
    assert drain_one(p) == "a"  # S's head, never accessed again: out (ghost: a)
    assert drain_one(p) == "c"  # b moves to M (count reset); c out (ghost: a c)
    add(p, "a")  # remembered by the ghost: straight into M = b a
    clock.now = 20
    p.touch_chain([k("b")])  # b in M: one access
    assert drain_one(p) == "d"  # S = d e, still over its target
    # S = e, at its target: M's turn. b has an access left: reinserted at M's end, a goes;
    # then b, whose access is spent; then S's e.
    assert drain(p) == ["a", "b", "e"]


def test_s3fifo_new_chain_leaves_from_its_leaf() -> None:
    p = tier("s3fifo", 10)
    add(p, "p0", "p1", "p2")  # inserted root first, as the daemon reserves them
    p.touch_chain([k("p0"), k("p1"), k("p2")])  # the same request's commit
    assert drain(p) == ["p2", "p1", "p0"]


# ---------------------------------------------------------------- prefix


def test_prefix_untrained_is_lru_over_leaves() -> None:
    clock = Clock()
    p = tier("prefix", 10, clock)
    add(p, "a", "b", "c")
    p.touch_chain([k("a"), k("b"), k("c")])  # a -> b -> c
    clock.now = 5
    add(p, "d")
    p.touch_chain([k("d")])
    clock.now = 10
    p.touch_chain([k("a")])  # the root used again: still not a candidate while b is there
    # Leaves only: c (used at 0), d (5); once c is gone b is a leaf (0), then a (10).
    assert drain(p) == ["c", "b", "d", "a"]


def test_prefix_never_evicts_a_parent_while_a_leaf_is_free() -> None:
    clock = Clock()
    p = tier("prefix", 10, clock)
    add(p, "a", "b")
    p.touch_chain([k("a"), k("b")])
    clock.now = 5
    add(p, "c")
    p.touch_chain([k("c")])
    p.pin(k("b"))  # LRU would now give up a, the parent of a pinned block
    assert drain_one(p) == "c"
    # Every leaf is pinned: the deepest unpinned ancestor of one goes.
    assert drain(p) == ["a"]
    assert k("b") in p


def test_prefix_learned_value_beats_age() -> None:
    """Blocks used twice come back, new ones never: a young new leaf goes before an old
    reused one, which LRU would give up first."""
    clock = Clock()
    p = tier("prefix", 100, clock)
    pol = p.eviction
    assert isinstance(pol, PrefixPolicy)
    model = pol.model
    new, reused = pol.class_of(uses=1), pol.class_of(uses=2)
    assert new != reused
    for _ in range(100):
        model.start(reused, 0.0)
        model.end(reused, 0.0, 30.0, reused=True)  # always back after 30 s
        model.start(new, 0.0)
        model.end(new, 0.0, 1000.0, reused=False)  # never back
    model.recompute()
    assert model.value(new, 5.0) == 0.0
    assert model.value(reused, 5.0) > 0.0
    add(p, "old")
    clock.now = 10
    p.touch_chain([k("old")])  # its second use: class "reused"
    clock.now = 12
    add(p, "young")
    clock.now = 15
    assert drain(p) == ["young", "old"]


def test_prefix_touches_within_one_request_are_one_use() -> None:
    clock = Clock()
    p = tier("prefix", 10, clock)
    pol = p.eviction
    assert isinstance(pol, PrefixPolicy)
    add(p, "a")
    clock.now = 1.5
    p.touch_chain([k("a")])  # the commit of the request that added it
    assert pol.blocks[k("a")].cls == pol.NEW
    clock.now = 4
    p.touch_chain([k("a")])  # another request
    assert pol.blocks[k("a")].cls == pol.ONCE


def test_prefix_ghost_remembers_a_block_and_counts_its_return() -> None:
    clock = Clock()
    p = tier("prefix", 10, clock)
    pol = p.eviction
    assert isinstance(pol, PrefixPolicy)
    add(p, "a")
    p.remove(k("a"))
    clock.now = 40
    add(p, "a")  # back: a reuse after 40 s, seen though the block had left
    assert pol.blocks[k("a")].cls == pol.ONCE
    assert sum(pol.model.reused[pol.class_of(uses=1)]) == 1


def test_prefix_classes() -> None:
    clock = Clock()
    p = tier("prefix", 100, clock)
    pol = p.eviction
    assert isinstance(pol, PrefixPolicy)
    add(p, "sys", "a1", "a2")
    p.touch_chain([k("sys"), k("a1"), k("a2")])  # a new conversation
    clock.now = 30
    add(p, "b1")
    p.touch_chain([k("sys"), k("b1")])  # another one under the same system prompt
    clock.now = 60
    add(p, "a3", "a4")
    p.touch_chain([k("sys"), k("a1"), k("a2"), k("a3"), k("a4")])  # a's next turn
    classes = {n: pol.blocks[k(n)].cls for n in ("sys", "a1", "a2", "b1", "a3", "a4")}
    assert classes == {"sys": pol.MORE, "a1": pol.ONCE, "a2": pol.ONCE, "b1": pol.NEW,
                       "a3": pol.TAIL, "a4": pol.TAIL}


def conversations(p: TierPolicy, clock: Clock) -> None:
    """A shared system prompt `s` and two conversations under it, `a` used after `b`."""
    add(p, "s", "b1", "b2")
    p.touch_chain([k("s"), k("b1"), k("b2")])
    clock.now = 5
    add(p, "a1", "a2")
    p.touch_chain([k("s"), k("a1"), k("a2")])


def test_prefix_ended_session_goes_first_and_not_its_shared_prefix() -> None:
    clock = Clock()
    p = tier("prefix", 10, clock)
    conversations(p, clock)
    # Marked from its leaf up to the branch point: a2, a1, not the shared s.
    assert p.end_session([k("s"), k("a1"), k("a2")]) == 2
    assert drain(p) == ["a2", "a1", "b2", "b1", "s"]


def test_prefix_without_the_hint_keeps_the_recent_conversation() -> None:
    clock = Clock()
    p = tier("prefix", 10, clock)
    conversations(p, clock)
    assert drain(p) == ["b2", "b1", "a2", "a1", "s"]


def test_prefix_a_later_use_cancels_the_hint() -> None:
    clock = Clock()
    p = tier("prefix", 10, clock)
    conversations(p, clock)
    p.end_session([k("s"), k("a1"), k("a2")])
    clock.now = 10
    p.touch_chain([k("s"), k("a1"), k("a2")])  # the conversation went on after all
    assert drain(p) == ["b2", "b1", "a2", "a1", "s"]


def test_prefix_ended_leaves_go_in_the_order_they_were_marked() -> None:
    clock = Clock()
    p = tier("prefix", 10, clock)
    conversations(p, clock)
    p.end_session([k("s"), k("b1"), k("b2")])
    p.end_session([k("s"), k("a1"), k("a2")])
    # b first (marked first); once b is gone, s has one child left, which a's marks
    # did not pass: s stays unmarked, the last to go.
    assert drain(p) == ["b2", "b1", "a2", "a1", "s"]


def test_prefix_a_pinned_ended_leaf_waits_and_comes_back_first() -> None:
    clock = Clock()
    p = tier("prefix", 10, clock)
    conversations(p, clock)
    p.end_session([k("s"), k("a1"), k("a2")])
    p.pin(k("a2"))  # a fetch lease holds it
    assert drain_one(p) == "b2"  # a1 has a child: not a leaf; a2 is pinned
    # victims() sets chosen blocks aside as pins: the mark order survives it.
    with pytest.raises(CapacityError):
        p.victims(20 * SIZE)
    p.unpin(k("a2"))
    assert drain(p) == ["a2", "a1", "b1", "s"]


@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo"])
def test_other_policies_ignore_the_hint(policy: str) -> None:
    clock = Clock()
    p, q = tier(policy, 10, clock), tier(policy, 10, clock)
    conversations(p, clock)
    clock.now = 0
    conversations(q, clock)
    assert p.end_session([k("s"), k("a1"), k("a2")]) == 0
    assert drain(p) == drain(q)


def test_reuse_model_kaplan_meier() -> None:
    """Half the observations come back in the bin of ages [1, 1.25) s, the other half are
    censored there: S drops from 1 to 0.5 across that bin and stays."""
    model = ReuseModel(1, Clock())
    reused = [0.0] * model.BINS
    censored = [0.0] * model.BINS
    reused[1] = censored[1] = 2.0
    surv = model.survival(reused, censored)
    assert surv[:3] == [1.0, 1.0, 0.5]
    assert surv[-1] == 0.5
    # From age 0, keeping a block through bin 1 gains 0.5 hits for space 1 * 1 + 0.25 * 0.75:
    # the best ratio over every horizon.
    assert model.gittins(surv)[0] == pytest.approx(0.5 / (1.0 + 0.25 * 0.75))


# ---------------------------------------------------------------- every policy

# Operations on three trees of chains c<t>/0 -> c<t>/1 -> c<t>/2 -> c<t>/3 in a 5-block tier.
OPS = st.lists(st.tuples(st.sampled_from(["use", "use", "use", "pin", "unpin", "remove",
                                          "tick", "end"]),
                         st.integers(0, 2), st.integers(1, 4)), max_size=100)


def chain(tree: int, length: int) -> list[bytes]:
    return [b"c%d/%d" % (tree, j) for j in range(length)]


ALL = [key for t in range(3) for key in chain(t, 4)]


def replay(p: TierPolicy, clock: Clock, ops: list[tuple[str, int, int]],
           check: object) -> None:
    """Requests as the daemon makes them: the request's blocks are pinned while it holds them
    (hits under its fetch lease, new blocks while written); the missing ones are added, making
    room with `victims` and stopping where pins leave none; then the chain is touched."""
    pins: dict[bytes, int] = {}
    for op, tree, n in ops:
        keys = chain(tree, n)
        if op == "use":
            held: list[bytes] = []
            for key in keys:
                if key not in p:
                    try:
                        victims = p.victims(SIZE)
                    except CapacityError:
                        break
                    for v in victims:
                        assert v not in pins and v not in held
                        p.remove(v)
                    p.add(key, SIZE)
                p.pin(key)
                held.append(key)
            p.touch_chain(keys)
            for key in held:
                p.unpin(key)
        elif op == "pin" and keys[-1] in p:
            p.pin(keys[-1])
            pins[keys[-1]] = pins.get(keys[-1], 0) + 1
        elif op == "unpin" and keys[-1] in pins:
            p.unpin(keys[-1])
            pins[keys[-1]] -= 1
            if not pins[keys[-1]]:
                del pins[keys[-1]]
        elif op == "remove" and keys[-1] in p and keys[-1] not in pins:
            p.remove(keys[-1])
        elif op == "tick":
            clock.now += 7 * n
        elif op == "end":
            p.end_session(keys)
        assert p.used_bytes <= p.capacity_bytes
        held = {key for key in ALL if key in p}
        assert p.used_bytes == SIZE * len(held)
        free = held - set(pins)
        assert set(p.eviction_order()) == free
        victim = p.next_victim()
        assert victim in free if free else victim is None
        check(p, held, free, victim)  # type: ignore[operator]


@pytest.mark.parametrize("policy", sorted(POLICIES))
@settings(max_examples=80, deadline=None)
@given(ops=OPS)
def test_capacity_and_pins_hold(policy: str, ops: list[tuple[str, int, int]]) -> None:
    """Capacity is never exceeded, a pinned block is never a victim, and the eviction order
    is exactly the unpinned blocks, whatever the requests, pins and removals."""
    clock = Clock()
    replay(TierPolicy("t", 5 * SIZE, policy, clock), clock, ops, lambda *_: None)


@settings(max_examples=80, deadline=None)
@given(ops=OPS)
def test_prefix_evicts_leaves_first(ops: list[tuple[str, int, int]]) -> None:
    """Under `prefix`, a block with a child in the tier is a victim only when every unpinned
    block has one (every leaf is pinned)."""

    def check(p: TierPolicy, held: set[bytes], free: set[bytes], victim: bytes | None) -> None:
        def child(key: bytes) -> bytes:
            tree, depth = key.split(b"/")
            return b"%s/%d" % (tree, int(depth) + 1)

        if victim is not None and child(victim) in held:
            assert all(child(key) in held for key in free), victim

    clock = Clock()
    replay(TierPolicy("t", 5 * SIZE, "prefix", clock), clock, ops, check)


def test_with_eviction_carries_blocks_and_pins() -> None:
    p = tier("lru", 5)
    add(p, *"abcd")
    p.pin(k("b"))
    p.touch_chain([k("a")])
    q = p.with_eviction("prefix")  # as the daemon does with a reopened disk tier
    assert (len(q), q.used_bytes, q.is_pinned(k("b"))) == (4, 40, True)
    # Untrained, at one instant: in the order they entered, which was LRU's (c d a; b pinned).
    assert drain(q) == ["c", "d", "a"]
    assert k("b") in q


def test_the_daemons_option() -> None:
    from kvstore.config import ServerConfig
    from kvstore.errors import ConfigError

    assert ServerConfig().eviction_policy == DEFAULT_POLICY
    assert ServerConfig(eviction_policy="s3fifo").eviction_policy == "s3fifo"
    with pytest.raises(ConfigError, match="eviction_policy"):
        ServerConfig(eviction_policy="mru")


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_empty_blocks_are_forgotten_too(policy: str) -> None:
    p = TierPolicy("t", 10, policy, Clock())
    p.add(k("z"), 0)
    assert p.remove(k("z")) == 0
    assert k("z") not in p
    assert p.next_victim() is None
