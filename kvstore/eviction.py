"""Eviction policies: which evictable block of one tier goes first.

A policy sees keys only; `kvstore.tiering.TierPolicy` keeps sizes, capacity and pin counts and
asks its policy for victims, so the daemon's tiers and the trace simulator run the same objects.
Every policy gets the same calls:

- `insert(key, nbytes)`: a block new to the tier (it is pinned while it is written);
- `touch_chain(keys)`: a request used the prefix `keys` (root first). Blocks are only ever used
  as whole prefixes, so `keys[i - 1]` is the parent of `keys[i]`;
- `remove(key)`: the block left the tier (evicted, deleted, corrupt);
- `victim()`: the block to evict next, left in place (the caller demotes it, then removes it);
- `unpinned(key)`: the last pin of a block was released;
- `end_session(keys)`: a client's hint that the conversation whose prompt was `keys` is over
  (`prefix` then evicts its own blocks first; the other policies ignore it).

**Pins.** The policy reads the tier's pin table and never names a pinned block. A pinned block
met at the head of a queue is *parked* (taken out of the queue, its place remembered) and put
back when it is unpinned, so each eviction stays O(1) amortised however many blocks are pinned.

**Leaf before parent.** A lookup stops at the first missing block, so a block whose parent left
is dead weight. Every policy orders a chain's blocks so that children go first where it can
(`touch_chain` walks a chain from its leaf to its root), and `prefix` only ever evicts leaves.

**One access per request.** The daemon touches a prefix several times for one request (lookup,
fetch, commit). Policies that count accesses count touches less than `same_access_s` apart as
one: in the simulator every call of a request happens at the request's arrival time.
"""

from __future__ import annotations

import copy
import heapq
import math
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Container, Iterator, Sequence
from typing import ClassVar

import numpy as np

from kvstore.errors import InvalidArgumentError

Clock = Callable[[], float]
SAME_ACCESS_S = 2.0  # touches of a block closer than this are one access (one request's calls)


class EvictionPolicy(ABC):
    """Eviction order over the blocks of one tier; see the module docstring for the contract."""

    name: ClassVar[str] = ""

    def __init__(self, capacity_bytes: int, pinned: Container[bytes],
                 clock: Clock = time.monotonic, same_access_s: float = SAME_ACCESS_S) -> None:
        self.capacity_bytes = capacity_bytes
        self._pinned = pinned
        self.clock = clock
        self._same_access_s = same_access_s

    @abstractmethod
    def insert(self, key: bytes, nbytes: int) -> None:
        """A block new to the tier, as the most recent."""

    @abstractmethod
    def touch_chain(self, keys: Sequence[bytes]) -> None:
        """A request used the prefix `keys`, root first; keys the tier lacks are skipped."""

    @abstractmethod
    def remove(self, key: bytes) -> None:
        """A block the tier held is gone."""

    @abstractmethod
    def victim(self) -> bytes | None:
        """The unpinned block to evict next, or None. Does not remove it; may reorganise the
        policy's queues (lazy promotions), so two calls in a row name the same block."""

    def unpinned(self, key: bytes) -> None:  # noqa: B027 - policies that park blocks override it
        """The last pin of `key` was released."""

    def end_session(self, keys: Sequence[bytes]) -> int:
        """A client says the conversation that sent the prompt `keys` (root first) has ended;
        returns how many blocks this policy now evicts first. Only a hint: the default ignores
        it (0), and a later use of a block cancels it."""
        return 0

    def order(self) -> Iterator[bytes]:
        """Every unpinned block, in the order they would be evicted if nothing else happened.

        O(n log n) or worse: for shutdown flushes, inspection and tests, never per eviction. The
        default replays victims on a copy of the policy.
        """
        memo = {id(self._pinned): self._pinned, id(self.clock): self.clock}
        shadow = copy.deepcopy(self, memo)
        while (key := shadow.victim()) is not None:
            shadow.remove(key)
            yield key


# ---------------------------------------------------------------- LRU


class LRUPolicy(EvictionPolicy):
    """Least recently used, exactly: `touch_chain` walks leaf to root, so a parent is always at
    least as recent as its children and goes after them.

    Unpinned blocks sit in an `OrderedDict`, oldest first. A pinned block found at its head is
    parked with a sequence number; once unpinned it waits in a heap ordered by that number.
    Parked blocks are older than every block in the dict (they were its head, and the dict only
    grows at its end), so the victim is the heap's top if there is one, else the dict's head.
    """

    name = "lru"

    def __init__(self, capacity_bytes: int, pinned: Container[bytes],
                 clock: Clock = time.monotonic, same_access_s: float = SAME_ACCESS_S) -> None:
        super().__init__(capacity_bytes, pinned, clock, same_access_s)
        self._lru: OrderedDict[bytes, None] = OrderedDict()
        self._parked: dict[bytes, int] = {}  # key -> park sequence (its place in LRU order)
        self._released: list[tuple[int, bytes]] = []  # heap of parked keys unpinned since
        self._seq = 0

    def insert(self, key: bytes, nbytes: int) -> None:
        self._lru[key] = None

    def touch_chain(self, keys: Sequence[bytes]) -> None:
        lru = self._lru  # local names: every lookup touches its whole chain (512 keys at 128k)
        move = lru.move_to_end
        parked = self._parked
        for key in reversed(keys):
            if key in lru:
                move(key)
            elif parked and key in parked:
                del parked[key]
                lru[key] = None

    def remove(self, key: bytes) -> None:
        if key in self._lru:
            del self._lru[key]
        else:
            self._parked.pop(key, None)  # its heap entry, if any, is skipped when it surfaces

    def unpinned(self, key: bytes) -> None:
        seq = self._parked.get(key)
        if seq is not None:
            heapq.heappush(self._released, (seq, key))

    def victim(self) -> bytes | None:
        released, parked, pinned = self._released, self._parked, self._pinned
        while released:
            seq, key = released[0]
            if parked.get(key) == seq and key not in pinned:
                return key
            heapq.heappop(released)  # touched, removed, or pinned again (stays parked)
        lru = self._lru
        while lru:
            key = next(iter(lru))
            if key not in pinned:
                return key
            del lru[key]
            self._seq += 1
            parked[key] = self._seq
        return None

    def order(self) -> Iterator[bytes]:
        parked, pinned = self._parked, self._pinned
        back = sorted({(s, k) for s, k in self._released if parked.get(k) == s})
        yield from (k for _, k in back if k not in pinned)
        yield from (k for k in self._lru if k not in pinned)


# ---------------------------------------------------------------- shared by ARC and S3-FIFO


class _Queues(EvictionPolicy):
    """Named FIFO/LRU queues with parking, access counting and ghost lists, in bytes."""

    def __init__(self, capacity_bytes: int, pinned: Container[bytes],
                 clock: Clock = time.monotonic, same_access_s: float = SAME_ACCESS_S) -> None:
        super().__init__(capacity_bytes, pinned, clock, same_access_s)
        self._size: dict[bytes, int] = {}
        self._where: dict[bytes, int] = {}  # key -> queue index, parked blocks included
        self._parked: set[bytes] = set()
        self._last: dict[bytes, float] = {}  # key -> time of its last counted access

    def _accessed(self, keys: Sequence[bytes]) -> tuple[list[bytes], list[bytes]]:
        """The held keys of a chain, leaf first, split into new accesses and repeats of one."""
        now = self.clock()
        last, where, window = self._last, self._where, self._same_access_s
        new: list[bytes] = []
        again: list[bytes] = []
        for key in reversed(keys):
            if key not in where:
                continue
            if now - last[key] >= window:
                last[key] = now
                new.append(key)
            else:
                again.append(key)
        return new, again

    def _head(self, queue: OrderedDict[bytes, None]) -> bytes | None:
        """The queue's first unpinned key; pinned ones met on the way are parked."""
        pinned = self._pinned
        while queue:
            key = next(iter(queue))
            if key not in pinned:
                return key
            del queue[key]
            self._parked.add(key)
        return None

    def _queues(self) -> tuple[OrderedDict[bytes, None], ...]:
        raise NotImplementedError

    def unpinned(self, key: bytes) -> None:
        if key in self._parked:
            self._parked.discard(key)
            queue = self._queues()[self._where[key]]
            queue[key] = None
            queue.move_to_end(key, last=False)  # back where it was found: first in line

    def _move(self, key: bytes, to: int) -> None:
        """Move a held key to the end of queue `to` (a parked key is back in line)."""
        queues = self._queues()
        if key in self._parked:
            self._parked.discard(key)
        else:
            del queues[self._where[key]][key]
        self._where[key] = to
        queues[to][key] = None

    def _forget(self, key: bytes) -> int:
        """Drop a key from every structure; returns the queue it was in."""
        q = self._where.pop(key)
        self._queues()[q].pop(key, None)
        self._parked.discard(key)
        self._size.pop(key, None)
        self._last.pop(key, None)
        return q


def _ghost_add(ghost: OrderedDict[bytes, int], key: bytes, nbytes: int, used: int,
               limit: int) -> int:
    """Append to a ghost list bounded to `limit` bytes; returns its new byte total."""
    ghost[key] = nbytes
    used += nbytes
    while used > limit and ghost:
        used -= ghost.popitem(last=False)[1]
    return used


# ---------------------------------------------------------------- ARC


class ARCPolicy(_Queues):
    """Adaptive Replacement Cache (Megiddo and Modha, FAST'03), in bytes.

    T1 holds blocks accessed once, T2 blocks accessed again (both LRU, leaf before parent as in
    `LRUPolicy`); the ghost lists B1 and B2 remember what each evicted. A new block found in B1
    means T1 was too small: its target `p` grows; found in B2, it shrinks. The victim is T1's
    LRU block while T1 is over `p` (or T2 has none), else T2's.
    """

    name = "arc"
    T1, T2 = 0, 1

    def __init__(self, capacity_bytes: int, pinned: Container[bytes],
                 clock: Clock = time.monotonic, same_access_s: float = SAME_ACCESS_S) -> None:
        super().__init__(capacity_bytes, pinned, clock, same_access_s)
        self._t: tuple[OrderedDict[bytes, None], ...] = (OrderedDict(), OrderedDict())
        self._t_bytes = [0, 0]
        self._b1: OrderedDict[bytes, int] = OrderedDict()
        self._b2: OrderedDict[bytes, int] = OrderedDict()
        self._b_bytes = [0, 0]
        self.p = 0.0  # target bytes of T1

    def _queues(self) -> tuple[OrderedDict[bytes, None], ...]:
        return self._t

    def insert(self, key: bytes, nbytes: int) -> None:
        c = self.capacity_bytes
        b1, b2 = self._b_bytes
        if key in self._b1:
            self.p = min(float(c), self.p + nbytes * max(b2 / max(b1, 1), 1.0))
            self._b_bytes[0] -= self._b1.pop(key)
            to = self.T2
        elif key in self._b2:
            self.p = max(0.0, self.p - nbytes * max(b1 / max(b2, 1), 1.0))
            self._b_bytes[1] -= self._b2.pop(key)
            to = self.T2
        else:
            to = self.T1
            # ARC's bounds on the ghosts: |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c
            while self._b1 and self._t_bytes[0] + nbytes + self._b_bytes[0] > c:
                self._b_bytes[0] -= self._b1.popitem(last=False)[1]
            while self._b2 and sum(self._t_bytes) + nbytes + sum(self._b_bytes) > 2 * c:
                self._b_bytes[1] -= self._b2.popitem(last=False)[1]
        self._size[key] = nbytes
        self._where[key] = to
        self._last[key] = self.clock()
        self._t[to][key] = None
        self._t_bytes[to] += nbytes

    def touch_chain(self, keys: Sequence[bytes]) -> None:
        new, again = self._accessed(keys)
        for key in new:  # accessed again: T2, most recent
            if self._where[key] == self.T1:
                self._t_bytes[0] -= self._size[key]
                self._t_bytes[1] += self._size[key]
            self._move(key, self.T2)
        for key in again:  # the same access: most recent in its own list
            if key not in self._parked:
                self._t[self._where[key]].move_to_end(key)

    def remove(self, key: bytes) -> None:
        nbytes = self._size[key]
        q = self._forget(key)
        self._t_bytes[q] -= nbytes
        c = self.capacity_bytes
        if q == self.T1:
            self._b_bytes[0] = _ghost_add(self._b1, key, nbytes, self._b_bytes[0],
                                          max(c - self._t_bytes[0], 0))
        else:
            self._b_bytes[1] = _ghost_add(self._b2, key, nbytes, self._b_bytes[1],
                                          max(2 * c - sum(self._t_bytes) - self._b_bytes[0], 0))

    def victim(self) -> bytes | None:
        first = self.T1 if self._t_bytes[0] > self.p else self.T2
        for q in (first, 1 - first):
            key = self._head(self._t[q])
            if key is not None:
                return key
        return None


# ---------------------------------------------------------------- S3-FIFO


class S3FIFOPolicy(_Queues):
    """S3-FIFO (Yang et al., SOSP'23), in bytes: a small FIFO S (10% of the capacity), a main
    FIFO M with 2-bit access counts (CLOCK), and a ghost FIFO G of keys evicted from S.

    New blocks enter S (or M when G remembers them). A block reaching S's head moves to M if it
    was accessed again while in S, else it is the victim. M's head is reinserted at M's end with
    its count minus one while it has accesses left, else it is the victim. A request's new blocks
    are put leaf first, so a chain leaves S (or M) from its leaf.
    """

    name = "s3fifo"
    S, M = 0, 1
    SMALL = 0.1
    MAX_FREQ = 3

    def __init__(self, capacity_bytes: int, pinned: Container[bytes],
                 clock: Clock = time.monotonic, same_access_s: float = SAME_ACCESS_S) -> None:
        super().__init__(capacity_bytes, pinned, clock, same_access_s)
        self._q: tuple[OrderedDict[bytes, None], ...] = (OrderedDict(), OrderedDict())
        self._q_bytes = [0, 0]
        self._freq: dict[bytes, int] = {}
        self._ghost: OrderedDict[bytes, int] = OrderedDict()
        self._ghost_bytes = 0

    def _queues(self) -> tuple[OrderedDict[bytes, None], ...]:
        return self._q

    def insert(self, key: bytes, nbytes: int) -> None:
        if key in self._ghost:
            self._ghost_bytes -= self._ghost.pop(key)
            to = self.M
        else:
            to = self.S
        self._size[key] = nbytes
        self._where[key] = to
        self._freq[key] = 0
        self._last[key] = self.clock()
        self._q[to][key] = None
        self._q_bytes[to] += nbytes

    def touch_chain(self, keys: Sequence[bytes]) -> None:
        new, again = self._accessed(keys)
        freq = self._freq
        for key in new:
            freq[key] = min(freq[key] + 1, self.MAX_FREQ)
        queues = self._q
        for key in again:  # this request's own new blocks: leaf first (in S, or in M when a
            # ghost sent them there, as blocks read back from a lower tier are)
            if freq[key] == 0 and key not in self._parked:
                queues[self._where[key]].move_to_end(key)

    def remove(self, key: bytes) -> None:
        nbytes = self._size[key]
        q = self._forget(key)
        self._freq.pop(key, None)
        self._q_bytes[q] -= nbytes
        if q == self.S:
            self._ghost_bytes = _ghost_add(self._ghost, key, nbytes, self._ghost_bytes,
                                           int(0.9 * self.capacity_bytes))

    def victim(self) -> bytes | None:
        small, main = self._q
        freq = self._freq
        while True:
            if self._q_bytes[self.S] > self.SMALL * self.capacity_bytes or not main:
                key = self._head(small)
                if key is not None:
                    if freq[key] == 0:
                        return key
                    freq[key] = 0
                    self._q_bytes[self.S] -= self._size[key]
                    self._q_bytes[self.M] += self._size[key]
                    self._move(key, self.M)
                    continue
            key = self._head(main)
            if key is None:
                return self._head(small) if small else None
            if freq[key] == 0:
                return key
            freq[key] -= 1
            main.move_to_end(key)


# ---------------------------------------------------------------- prefix-aware


class ReuseModel:
    """The reuse-gap distribution of each class of blocks, learned online, and the value of
    keeping a block of class `c` that was last used `age` seconds ago.

    An observation starts at a use and ends at the block's next use (a reuse after `gap`
    seconds, seen while the block is held or remembered as a ghost after its eviction) or when
    the tier forgets it (censored). The survival curve S of each class is the Kaplan-Meier
    estimate over log-spaced bins (x1.25 from 1 s): ended observations count with weights that
    halve every `half_life` of them, and the ones still open count as censored at their current
    age (without them, a young tier would see its quick reuses long before the misses, which
    end only when a ghost is forgotten, and overrate everything). The value of a block at age a
    is its Gittins-style index: the best, over how long one might keep it, of the hits expected
    per second of space, max over h of (S(a) - S(a + h)) / integral of S from a to a + h. A
    block unlikely to be used again soon is worth little, whether it is young (a gap has barely
    begun, and returns within seconds are rare) or old (past the usual think time).
    """

    RATIO = 1.25
    BINS = 48
    RECOMPUTE = 2048  # observations between two recomputations of the index table...
    RECOMPUTE_S = 1.0  # ...at most one a second
    MIN_OBS = 64  # a class with fewer observations uses the pooled estimate

    def __init__(self, classes: int, clock: Clock, half_life: int = 128 * 1024) -> None:
        self.classes = classes
        self.clock = clock
        self._log_ratio = math.log(self.RATIO)
        self.lo = [0.0] + [self.RATIO ** (i - 1) for i in range(1, self.BINS + 1)]  # bin edges
        self.reused = [[0.0] * self.BINS for _ in range(classes + 1)]  # last row: all classes
        self.censored = [[0.0] * self.BINS for _ in range(classes + 1)]
        self.open: list[dict[int, int]] = [{} for _ in range(classes)]  # start second -> count
        self.half_life = half_life
        self._pending = 0
        self._computed_at = -math.inf
        self.index: list[list[float]] = [[0.0] * self.BINS for _ in range(classes)]

    def bin(self, age: float) -> int:
        if age < 1.0:
            return 0
        return min(1 + int(math.log(age) / self._log_ratio), self.BINS - 1)

    def start(self, cls: int, now: float, n: int = 1) -> None:
        """`n` observations of class `cls` begin (blocks used at `now`)."""
        opened = self.open[cls]
        t = int(now)
        opened[t] = opened.get(t, 0) + n

    def _close(self, cls: int, start: float, n: int) -> None:
        opened = self.open[cls]
        t = int(start)
        left = opened.get(t, 0) - n
        if left > 0:
            opened[t] = left
        else:
            opened.pop(t, None)

    def reclassify(self, old: int, new: int, start: float) -> None:
        """An open observation turns out to be of class `new`."""
        self._close(old, start, 1)
        self.start(new, start)

    def end(self, cls: int, start: float, now: float, reused: bool, n: int = 1) -> None:
        """`n` observations of class `cls` begun at `start` end: reused at `now` or not."""
        self._close(cls, start, n)
        rows = self.reused if reused else self.censored
        b = self.bin(now - start)
        rows[cls][b] += n
        rows[self.classes][b] += n
        self._pending += n
        if self._pending >= self.RECOMPUTE and now - self._computed_at >= self.RECOMPUTE_S:
            self.recompute()

    def value(self, cls: int, age: float) -> float:
        return self.index[cls][self.bin(age)]

    def recompute(self) -> None:
        now = self.clock()
        decay = 0.5 ** (self._pending / self.half_life)  # the counts since the last one
        self._pending = 0
        self._computed_at = now
        for rows in (self.reused, self.censored):
            for row in rows:
                row[:] = [x * decay for x in row]
        censored = [list(row) for row in self.censored]  # plus the open observations
        for c, opened in enumerate(self.open):
            for t, n in opened.items():
                b = self.bin(now - t)
                censored[c][b] += n
                censored[self.classes][b] += n
        pooled = self.gittins(self.survival(self.reused[self.classes], censored[self.classes]))
        for c in range(self.classes):
            if sum(self.reused[c]) + sum(censored[c]) < self.MIN_OBS:
                self.index[c] = pooled
            else:
                self.index[c] = self.gittins(self.survival(self.reused[c], censored[c]))

    def survival(self, reused: list[float], censored: list[float]) -> list[float]:
        """Kaplan-Meier: element i is P(no reuse before age lo[i]), BINS + 1 of them."""
        at_risk = sum(reused) + sum(censored)
        surv = [1.0] * (self.BINS + 1)
        for i in range(self.BINS):
            hazard = reused[i] / at_risk if at_risk > 0 else 0.0
            surv[i + 1] = surv[i] * (1.0 - hazard)
            at_risk -= reused[i] + censored[i]
        return surv

    def gittins(self, surv: list[float]) -> list[float]:
        """Per starting bin: the best ratio, over horizons, of the probability of a reuse to
        the expected space spent waiting for it (seconds, the curve linear across a bin)."""
        s = np.asarray(surv)
        space = np.diff(np.asarray(self.lo)) * (s[:-1] + s[1:]) / 2
        spent = np.concatenate(([0.0], np.cumsum(space)))
        gain = s[:-1, None] - s[None, 1:]  # [b, e]: reused in bins b..e
        cost = spent[None, 1:] - spent[:-1, None]  # [b, e]: space over bins b..e
        upper = np.triu(np.ones_like(cost, dtype=bool)) & (cost > 0)
        ratio = np.divide(gain, cost, out=np.zeros_like(gain), where=upper)
        return [float(x) for x in ratio.max(axis=1)]


class _Block:
    """What `PrefixPolicy` knows of one block."""

    __slots__ = ("born", "cls", "key", "last", "parent", "parked", "q", "stamp", "tail")

    def __init__(self, key: bytes, now: float) -> None:
        self.key = key
        self.born = now  # when it entered the tier
        self.last = now  # its last counted use
        self.tail = False  # it arrived as a conversation's next turn (appended to a leaf)
        self.cls = 0  # its class as of its last use: NEW, TAIL, ONCE or MORE
        self.parent: bytes | None = None
        self.q = -1  # the candidate queue it is in (its class), -1 if none
        self.stamp = 0  # which of its heap entries are current
        self.parked = False


class PrefixPolicy(EvictionPolicy):
    """Prefix-aware and learned: evicts the leaf whose class and age promise the fewest hits
    per second of space (`ReuseModel`).

    - **Leaves only.** A lookup stops at the first missing block, so a block with a child in the
      tier is not a candidate: a conversation is given up from its end, and a prefix many
      share (a system prompt, a document) outlives every branch under it. Only when every leaf
      is pinned does the deepest unpinned ancestor of a pinned leaf go.
    - **Four classes**: new in a new conversation (a branch under a prefix others share, or a
      new root), new at the end of a continuing conversation (appended to a leaf), used once
      more since, used twice or more since.
    - **Learned.** Each class's reuse-gap distribution is learned from this tier's own hits and
      from ghosts (evicted blocks remembered for up to `GHOST` times the capacity), so gaps
      longer than what the tier keeps are still seen. A block's value is its class's index at
      its age.
    - **Both ends.** Leaves wait in two heaps per class, oldest and youngest first, and the
      victim is the lowest-valued of those 2 x 4 blocks: the value is low for old blocks (past
      the usual gap) and, when the tier is too small to wait out a typical gap, for young ones
      too; keeping the blocks already waiting then beats taking in every new one (LRU's loss
      on loops longer than the cache). An eviction is O(log n); a touch updates heaps for its
      chain's leaf only.
    - **Ended sessions first.** `end_session(keys)` marks the conversation's own blocks: from
      its leaf up to, not including, the first block another chain also hangs from (a system
      prompt, a shared document). Marked leaves are evicted before any other, in the order
      they were marked; a later use of a marked block unmarks it. What no online signal tells
      (SCALE.md): whether a conversation goes on. A client that knows it ended says so.
    """

    name = "prefix"
    NEW, TAIL, ONCE, MORE = range(4)  # touch_chain has ONCE and MORE as literals
    GHOST = 4  # ghost bytes, times the capacity

    def __init__(self, capacity_bytes: int, pinned: Container[bytes],
                 clock: Clock = time.monotonic, same_access_s: float = SAME_ACCESS_S) -> None:
        super().__init__(capacity_bytes, pinned, clock, same_access_s)
        self.model = ReuseModel(4, clock)
        self.blocks: dict[bytes, _Block] = {}
        self._kids: dict[bytes, int] = {}  # key -> its children the tier holds (ghosts too)
        self._size: dict[bytes, int] = {}
        self._old: list[list[tuple[float, int, _Block]]] = [[] for _ in range(4)]
        self._young: list[list[tuple[float, int, _Block]]] = [[] for _ in range(4)]
        self._count = [0] * 4  # queued blocks per class
        self._parked: dict[bytes, _Block] = {}
        self._ghost: OrderedDict[bytes, tuple[_Block, int]] = OrderedDict()
        self._ghost_bytes = 0
        self._stamp = 0
        # `end_session`: marked blocks (key -> the mark's number), and a heap of the marked
        # leaves, first marked first (entries whose key left `_ended_leaves` are stale).
        self._ended: dict[bytes, int] = {}
        self._ended_leaves: set[bytes] = set()
        self._ended_heap: list[tuple[int, bytes]] = []
        self._marks = 0

    @classmethod
    def class_of(cls, uses: int, tail: bool = False) -> int:
        if uses > 2:
            return cls.MORE
        if uses == 2:
            return cls.ONCE
        return cls.TAIL if tail else cls.NEW

    # -- candidate queues
    def _queue(self, b: _Block) -> None:
        """(Re)queue `b` as a candidate of its class if it is an unparked leaf."""
        if b.q >= 0:
            self._count[b.q] -= 1
            b.q = -1
        self._ended_leaves.discard(b.key)
        if b.parked or b.key in self._kids:
            return
        if b.key in self._ended:
            self._ended_leaves.add(b.key)
            heapq.heappush(self._ended_heap, (self._ended[b.key], b.key))
            if len(self._ended_heap) > 2 * len(self._ended_leaves) + 64:  # amortised O(1)
                self._ended_heap = [(self._ended[k], k) for k in self._ended_leaves]
                heapq.heapify(self._ended_heap)
            return
        c = b.q = b.cls
        self._count[c] += 1
        self._stamp += 1
        b.stamp = self._stamp
        old, young = self._old[c], self._young[c]
        heapq.heappush(old, (b.last, b.stamp, b))
        heapq.heappush(young, (-b.last, b.stamp, b))
        if len(old) > 2 * self._count[c] + 64:  # mostly stale entries: rebuild (amortised O(1))
            self._old[c] = [e for e in old if e[2].q == c and e[2].stamp == e[1]]
            self._young[c] = [e for e in young if e[2].q == c and e[2].stamp == e[1]]
            heapq.heapify(self._old[c])
            heapq.heapify(self._young[c])

    def _unqueue(self, b: _Block) -> None:
        self._ended_leaves.discard(b.key)
        if b.q >= 0:
            self._count[b.q] -= 1
            b.q = -1

    def _end(self, heap: list[tuple[float, int, _Block]], c: int) -> _Block | None:
        """The current, unpinned block at the top of one of class `c`'s heaps; stale entries
        are dropped and pinned blocks parked on the way."""
        pinned = self._pinned
        while heap:
            _, stamp, b = heap[0]
            if b.q == c and b.stamp == stamp:
                if b.key not in pinned:
                    return b
                self._unqueue(b)
                b.parked = True
                self._parked[b.key] = b
            heapq.heappop(heap)
        return None

    def _unkid(self, parent: bytes) -> None:
        n = self._kids[parent] - 1
        if n:
            self._kids[parent] = n
            return
        del self._kids[parent]
        p = self.blocks.get(parent)
        if p is not None:
            self._queue(p)  # a leaf now

    # -- the contract
    def insert(self, key: bytes, nbytes: int) -> None:
        now = self.clock()
        ghost = self._ghost.pop(key, None)
        if ghost is not None:  # back after an eviction: a reuse, and its history with it
            b, size = ghost
            self._ghost_bytes -= size
            self.model.end(b.cls, b.last, now, reused=True)
            b.last, b.born, b.q, b.parked = now, now, -1, False
            b.cls = self.ONCE if b.cls < self.ONCE else self.MORE
            if b.parent is not None:  # a key's parent never changes: linked again at once
                self._kids[b.parent] = self._kids.get(b.parent, 0) + 1
                p = self.blocks.get(b.parent)
                if p is not None:
                    self._unqueue(p)
        else:
            b = _Block(key, now)
        self.model.start(b.cls, now)
        self.blocks[key] = b
        self._size[key] = nbytes
        self._queue(b)

    def touch_chain(self, keys: Sequence[bytes]) -> None:
        now = self.clock()
        since = now - self._same_access_s  # uses after this are the same request's
        blocks, model = self.blocks, self.model
        prev: _Block | None = None
        run_cls, run_last, run_n = -1, 0.0, 0  # used blocks alike in a row: one model update
        once = more = 0  # observations starting now, per class
        ended = self._ended
        for key in keys:
            b = blocks.get(key)
            if b is None:
                prev = None
                continue
            if ended and key in ended:  # used again: the session goes on after all
                del ended[key]
                self._queue(b)
            if prev is not None and b.parent != prev.key:
                self._link(b, prev, now)
            prev = b
            if b.last > since:
                continue
            if b.cls != run_cls or b.last != run_last:
                if run_n:
                    model.end(run_cls, run_last, now, True, run_n)
                run_cls, run_last, run_n = b.cls, b.last, 0
            run_n += 1
            b.last = now
            if b.cls < 2:  # NEW or TAIL: used once more
                b.cls = 2
                once += 1
            else:
                b.cls = 3
                more += 1
            if b.q >= 0:
                self._queue(b)
        if run_n:
            model.end(run_cls, run_last, now, True, run_n)
            if once:
                model.start(self.ONCE, now, once)
            if more:
                model.start(self.MORE, now, more)

    def _link(self, b: _Block, parent: _Block, now: float) -> None:
        """The chain says `parent` is `b`'s parent. A block new in this request is a tail if
        it was appended to a leaf (its conversation's next turn)."""
        if b.parent is not None:
            self._unkid(b.parent)
        n = self._kids.get(parent.key, 0)
        if now - b.born < self._same_access_s and b.cls < self.ONCE:
            if now - parent.born < self._same_access_s and parent.cls < self.ONCE:
                b.tail = parent.tail  # the same request's previous block
            else:
                b.tail = n == 0
            cls = self.TAIL if b.tail else self.NEW
            if cls != b.cls:
                self.model.reclassify(b.cls, cls, b.last)
                b.cls = cls
                if b.q >= 0:
                    self._queue(b)
        b.parent = parent.key
        self._kids[parent.key] = n + 1
        self._unqueue(parent)

    def remove(self, key: bytes) -> None:
        b = self.blocks.pop(key)
        nbytes = self._size.pop(key)
        self._unqueue(b)
        self._ended.pop(key, None)
        self._parked.pop(key, None)
        if b.parent is not None:
            self._unkid(b.parent)  # the ghost keeps its parent's key, for its return
        self._ghost[key] = (b, nbytes)
        self._ghost_bytes += nbytes
        now = self.clock()
        while self._ghost_bytes > self.GHOST * self.capacity_bytes:
            g, size = self._ghost.popitem(last=False)[1]
            self._ghost_bytes -= size
            self.model.end(g.cls, g.last, now, reused=False)

    def unpinned(self, key: bytes) -> None:
        b = self._parked.pop(key, None)
        if b is not None:
            b.parked = False
            self._queue(b)

    def end_session(self, keys: Sequence[bytes]) -> int:
        marked = 0
        for key in reversed(keys):
            b = self.blocks.get(key)
            if b is None:
                continue  # evicted already; the blocks above it are still the session's
            if self._kids.get(key, 0) > 1:
                break  # a branch point: shared with another conversation from here up
            if key not in self._ended:
                self._marks += 1
                self._ended[key] = self._marks
                self._queue(b)
                marked += 1
        return marked

    def _ended_victim(self) -> bytes | None:
        """The first-marked unpinned leaf of an ended session; pinned ones are parked."""
        heap, leaves, pinned = self._ended_heap, self._ended_leaves, self._pinned
        while heap:
            mark, key = heap[0]
            if key in leaves and self._ended.get(key) == mark:
                if key not in pinned:
                    return key
                leaves.discard(key)
                b = self.blocks[key]
                b.parked = True
                self._parked[key] = b
            heapq.heappop(heap)
        return None

    def victim(self) -> bytes | None:
        if self._ended_leaves and (key := self._ended_victim()) is not None:
            return key
        now, value = self.clock(), self.model.value
        best: _Block | None = None
        best_rank = (0.0, 0.0, 0)
        for c in range(4):
            if not self._count[c]:
                continue
            for b in (self._end(self._old[c], c), self._end(self._young[c], c)):
                if b is not None:
                    rank = (value(c, now - b.last), b.last, b.stamp)
                    if best is None or rank < best_rank:
                        best, best_rank = b, rank
        if best is not None:
            return best.key
        for b in list(self._parked.values()):  # every leaf is pinned: its deepest free ancestor
            up = self.blocks.get(b.parent) if b.parent is not None else None
            while up is not None:
                if up.key not in self._pinned:
                    return up.key
                up = self.blocks.get(up.parent) if up.parent is not None else None
        return None


# ---------------------------------------------------------------- choosing one

POLICIES: dict[str, type[EvictionPolicy]] = {
    p.name: p for p in (LRUPolicy, ARCPolicy, S3FIFOPolicy, PrefixPolicy)}
DEFAULT_POLICY = "prefix"


def make_policy(name: str, capacity_bytes: int, pinned: Container[bytes],
                clock: Clock = time.monotonic) -> EvictionPolicy:
    """The policy called `name` (one of `POLICIES`)."""
    cls = POLICIES.get(name)
    if cls is None:
        raise InvalidArgumentError(f"unknown eviction policy {name!r} "
                                   f"(one of {', '.join(POLICIES)})")
    return cls(capacity_bytes, pinned, clock)
