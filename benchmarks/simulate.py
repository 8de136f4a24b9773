"""Simulation past this machine: replay a real request trace over N simulated machines.

`python -m benchmarks.simulate` replays `../shared/traces/conversation_trace.jsonl` (the Mooncake
FAST'25 conversation trace: 12,031 requests, 512-token blocks given as chained `hash_ids`), or
any trace in that JSONL format (`--trace`), through the daemon's own tier bookkeeping and
eviction policies, `kvstore.tiering.TierPolicy` and `kvstore.eviction` (the very classes the
daemon's tiers use), with metadata only: no payload is ever allocated, so terabytes of
simulated cache cost a few hundred MB of RAM here.

Model, per request (requests are replayed in timestamp order, one at a time):

1. A router picks a machine: `random`, `affinity` (consistent hashing of the first
   `--affinity-blocks` block ids, so the turns of one conversation meet their own prefix), or
   `kv-aware` / `kv-ttft`, which know where each block lives from the KV events the machines
   publish (vLLM's BlockStored / BlockRemoved / AllBlocksCleared, `--kv-lag` requests late):
   the best cached prefix first, ties to the least loaded (`kv-aware`), or the least queued
   work + modeled TTFT (`kv-ttft`). A request spills to the router's next choice when the
   chosen machine has more than `--spill-bound-s` seconds of work queued.
2. Longest prefix: each block, in chain order, is looked up in the machine's host tier, then its
   disk tier, then the shared remote tier; the walk stops at the first block found nowhere.
   Disk and remote hits are promoted into host (host victims are demoted to disk, disk victims
   are dropped) by the daemon's own placement engine (`kvstore.tiers.hierarchy`), up to the
   prompt's share of host (`PromptShare`) as the daemon's fetch; blocks are pinned while the
   request holds them.
3. Publish: every block of the prompt is placed in host (pinned), the chain is touched on every
   local tier with `touch_chain` (parents fresher than children), and every block is written
   through to the remote tier (one shared `TierPolicy`, LRU, victims dropped).

Reported: the fraction of prompt blocks served from host / disk / remote / computed, and an
estimated TTFT per request from a bandwidth-vs-prefill model (`TTFTModel`) that loads a cached
prefix only as far as loading beats recomputing (the machines' tiers evict with `--eviction`):
for an idle engine, and with a FIFO queue per machine (one request at a time, each taking its
modeled TTFT; `ttft_q_*`). `--churn` makes machines fail, leave or join mid-trace (their host
and disk lost; a joiner starts empty); each row also reports the window of the trace after
each churn event. Separately, each eviction policy of `--policies` on a single tier is compared
with Belady's optimal (MIN) at the same capacities (`--belady-capacities`), written under
"policies" in the JSON: `{"default": NAME, "capacity_blocks": [...], "hit_rate": {"belady":
[...], "lru": [...], ...}}`. With `--end-sessions D[,D...]` those replays run again for each
delay D with a client that says a conversation ended (`end_session`) D seconds after its last
turn, known from the trace in hindsight (`session_ends`), under "policies" / "end_sessions".

What it does not model (see docs/SCALE.md): the cache is looked up and published at arrival
(no in-flight prefixes, no write-through lag: the queue delays a request's first token, not its
blocks), a machine prefills one request at a time (no batching, no decode), the GPU's own
prefix cache is not simulated, and the remote tier is exact LRU where Redis samples.
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import heapq
import itertools
import json
import math
import random
import shlex
import sys
import time
from collections import deque
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeAlias

import numpy as np
from tqdm import tqdm

from kvstore.config import ServerConfig, parse_size
from kvstore.eviction import DEFAULT_POLICY, POLICIES
from kvstore.planner import plan
from kvstore.tiering import TierPolicy
from kvstore.tiers.hierarchy import Hierarchy, MetaLevel, PromptShare

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "conversation_trace.jsonl"

# Tier codes in a request's served-prefix sequence (one byte per block, chain order).
HOST, DISK, REMOTE = 0, 1, 2
TIER_NAMES = ("host", "disk", "remote")
_NO_LATENCY = dict.fromkeys(TIER_NAMES, 0.0)  # the TTFT model counts bytes, not round trips
FETCH_WINDOW_BYTES = ServerConfig.fetch_window_bytes  # the daemon's default: a prompt's share

LLAMA3_8B_BF16_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 heads x 128, bf16
TRACE_BLOCK_TOKENS = 512  # the trace's block size (its README)


# ---------------------------------------------------------------- trace


@dataclass(frozen=True, slots=True)
class Request:
    """One trace line. `keys` are the block ids as the bytes keys `TierPolicy` indexes."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    keys: tuple[bytes, ...]
    shared_tokens: int = 0  # its first tokens other conversations share (`end_session`)

    @property
    def full_blocks(self) -> int:
        """Blocks the store may hold: only full blocks are stored (DESIGN.md), so a partial
        last block is always computed. On this trace that block recurs only when a whole
        prompt is repeated; a follow-up turn changes its tokens and so its id."""
        return min(len(self.hash_ids), self.input_length // TRACE_BLOCK_TOKENS)


class KeyMaker:
    """Turns block ids into 8-byte keys, one shared object per id.

    Sharing matters for speed only: a dict lookup with the very object it stored compares by
    identity and never re-hashes, and the simulator does millions of lookups.
    """

    def __init__(self) -> None:
        self._keys: dict[int, bytes] = {}

    def __call__(self, hash_id: int) -> bytes:
        key = self._keys.get(hash_id)
        if key is None:
            key = self._keys[hash_id] = hash_id.to_bytes(8, "little")
        return key


def make_request(hash_ids: Sequence[int], input_length: int | None = None,
                 timestamp_ms: int = 0, output_length: int = 0,
                 keys: KeyMaker | None = None, shared_tokens: int = 0) -> Request:
    """A `Request` from block ids; `input_length` defaults to full blocks."""
    km = keys or KeyMaker()
    ids = tuple(int(h) for h in hash_ids)
    length = len(ids) * TRACE_BLOCK_TOKENS if input_length is None else input_length
    return Request(timestamp_ms, length, output_length, ids, tuple(km(h) for h in ids),
                   shared_tokens)


def load_trace(path: Path, limit: int | None = None) -> list[Request]:
    """Read a Mooncake-format JSONL trace, sorted by arrival time. An optional
    `shared_tokens` per line (`benchmarks.workloads` writes it) says how much of the prompt's
    start other conversations share; the client's end-of-conversation hints skip it."""
    km = KeyMaker()
    out: list[Request] = []
    with path.open() as f:
        for line in f:
            if not line.strip():
                continue
            d = json.loads(line)
            out.append(make_request(d["hash_ids"], d["input_length"], d["timestamp"],
                                    d.get("output_length", 0), km,
                                    int(d.get("shared_tokens", 0))))
            if limit is not None and len(out) >= limit:
                break
    out.sort(key=lambda r: r.timestamp_ms)  # stable: same-millisecond requests keep file order
    return out


# ---------------------------------------------------------------- client hints


SessionEnd: TypeAlias = tuple[float, int]  # (trace seconds, index of the request that ended)


def session_ends(requests: Sequence[Request], delay_s: float = 0.0) -> list[SessionEnd]:
    """When a client that knows its conversation ended says so: `(arrival + delay_s, i)` for
    each request `i` that is its conversation's last turn, in time order (ties by index).

    A last turn is a request whose full blocks (at least 2: one block is only the shared system
    prompt) are a prefix of the full blocks of no later request, so no later request continues
    it, branches from its end or repeats it. This is hindsight from the trace (`requests` in
    arrival order, as `load_trace` returns them): it models a client that knows its
    conversation is over (the user closed it) and tells the store `delay_s` seconds after
    sending the last prompt. `ClusterSim.run(..., hints=...)` delivers them.
    """
    if not delay_s >= 0.0 or math.isinf(delay_s):
        raise ValueError(f"delay_s must be finite and >= 0, not {delay_s}")
    # A trie of full-block chains: node -> the last request whose full blocks pass through it.
    child: dict[tuple[int, int], int] = {}
    last: list[int] = [-1]  # node 0 is the empty chain
    ends: list[tuple[int, int]] = []  # (request, the node of its full blocks)
    for i, r in enumerate(requests):
        node = 0
        for h in r.hash_ids[: r.full_blocks]:
            nxt = child.get((node, h))
            if nxt is None:
                nxt = child[(node, h)] = len(last)
                last.append(i)
            else:
                last[nxt] = i
            node = nxt
        if r.full_blocks >= 2:
            ends.append((i, node))
    return sorted((requests[i].timestamp_ms / 1e3 + delay_s, i)
                  for i, node in ends if last[node] == i)


# ---------------------------------------------------------------- KV events

# What a machine publishes as blocks enter and leave its tiers: vLLM's KV events
# (`vllm.distributed.kv_events`: BlockStored, BlockRemoved, AllBlocksCleared), with the fields a
# router's index uses, the block hashes and the medium. llm-d's and Dynamo's KV routers build
# their index from these; the `kv-aware` router below builds its own from nothing else.
HOST_MEDIUM, DISK_MEDIUM = "CPU", "DISK"
_MEDIUM_BIT = {HOST_MEDIUM: 1, DISK_MEDIUM: 2}


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[bytes]
    medium: str


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str


@dataclass(slots=True)
class AllBlocksCleared:
    """The machine's tiers are gone (it failed or left)."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    """Events of one machine, in the order they happened."""

    machine: int
    events: list[KVEvent]


class KVIndex:
    """Which machine holds which block, in which tier, learned from KV events only.

    `publish` is called once per request with the events that request caused (plus those of
    any churn just before it). With `lag` = K a batch is applied only after K more batches have
    been published: the index is exactly K requests stale, as a router fed over a slow bus.
    """

    def __init__(self, lag: int = 0) -> None:
        if lag < 0:
            raise ValueError("lag must be >= 0")
        self.lag = lag
        self._where: dict[bytes, dict[int, int]] = {}  # key -> {machine: tier bits}
        self._pending: deque[list[EventBatch]] = deque()
        self._dropped: set[int] = set()
        self.events_applied = 0

    def publish(self, batches: list[EventBatch]) -> None:
        self._pending.append(batches)
        while len(self._pending) > self.lag:
            for batch in self._pending.popleft():
                self._apply(batch)

    def drop_machine(self, machine: int) -> None:
        """Forget a machine now (it left the cluster); its late events are ignored."""
        self._dropped.add(machine)
        self._clear(machine)

    def holders(self, key: bytes) -> dict[int, str]:
        """Machine -> the fastest tier it holds `key` in (`HOST_MEDIUM` or `DISK_MEDIUM`)."""
        return {m: HOST_MEDIUM if bits & 1 else DISK_MEDIUM
                for m, bits in self._where.get(key, {}).items()}

    def __len__(self) -> int:
        return len(self._where)

    def prefixes(self, keys: Sequence[bytes], machines: Container[int]) -> dict[int, bytes]:
        """For each of `machines` holding the chain's first block, its cached prefix as tier
        codes (HOST where it is in host, else DISK), stopping at its first missing block."""
        out: dict[int, bytearray] = {}
        active: list[int] | None = None
        where = self._where
        for key in keys:
            holders = where.get(key)
            if not holders:
                break
            if active is None:
                active = [m for m in holders if m in machines]
            else:
                active = [m for m in active if m in holders]
            if not active:
                break
            for m in active:
                out.setdefault(m, bytearray()).append(HOST if holders[m] & 1 else DISK)
        return {m: bytes(codes) for m, codes in out.items()}

    def _apply(self, batch: EventBatch) -> None:
        m = batch.machine
        if m in self._dropped:
            return
        where = self._where
        for ev in batch.events:
            self.events_applied += 1
            if isinstance(ev, BlockStored):
                bit = _MEDIUM_BIT[ev.medium]
                for key in ev.block_hashes:
                    holders = where.get(key)
                    if holders is None:
                        where[key] = {m: bit}
                    else:
                        holders[m] = holders.get(m, 0) | bit
            elif isinstance(ev, BlockRemoved):
                bit = _MEDIUM_BIT[ev.medium]
                for key in ev.block_hashes:
                    holders = where.get(key)
                    if holders is None or m not in holders:
                        continue
                    left = holders[m] & ~bit
                    if left:
                        holders[m] = left
                    else:
                        del holders[m]
                        if not holders:
                            del where[key]
            else:
                self._clear(m)

    def _clear(self, machine: int) -> None:
        # A scan of the whole index: only on churn, a few times a run.
        empty = []
        for key, holders in self._where.items():
            if holders.pop(machine, None) is not None and not holders:
                empty.append(key)
        for key in empty:
            del self._where[key]


# ---------------------------------------------------------------- routing


class Router(Protocol):
    """Chooses the machine that serves a request."""

    def route(self, request: Request) -> int: ...


class LoadView(Protocol):
    """What a router may know of the machines' load."""

    def outstanding_s(self, machine: int) -> float:
        """Seconds of work queued on `machine` (modeled TTFTs not yet finished)."""
        ...

    def requests_of(self, machine: int) -> int: ...


class _Idle:
    def outstanding_s(self, machine: int) -> float:
        return 0.0

    def requests_of(self, machine: int) -> int:
        return 0


IDLE: LoadView = _Idle()


class ClusterRouter:
    """A router over a machine set that changes (`add_machine`, `remove_machine`).

    `choices` yields the live machines in preference order; the cluster takes the first whose
    queued work is within its spill bound. It is a generator where ranking costs something
    (random numbers, a ring walk), so a request that does not spill pays for one choice only.
    """

    def __init__(self, machines: int) -> None:
        self.live: list[int] = list(range(machines))

    @property
    def machines(self) -> int:
        return len(self.live)

    def add_machine(self, machine: int) -> None:
        if machine in self.live:
            raise ValueError(f"machine {machine} is already in the cluster")
        self.live.append(machine)

    def remove_machine(self, machine: int) -> None:
        self.live.remove(machine)

    def choices(self, request: Request, load: LoadView) -> Iterator[int]:
        raise NotImplementedError

    def observe(self, batches: list[EventBatch]) -> None:
        """KV events, once per request; only a router that indexes blocks uses them."""

    def route(self, request: Request) -> int:
        return next(iter(self.choices(request, IDLE)))


class RandomRouter(ClusterRouter):
    """Uniformly random machine: the load balancer that knows nothing about prefixes."""

    def __init__(self, machines: int, seed: int = 0) -> None:
        super().__init__(machines)
        self._rng = random.Random(seed)

    def choices(self, request: Request, load: LoadView) -> Iterator[int]:
        live = self.live
        first = live[self._rng.randrange(len(live))]
        yield first
        rest = [m for m in live if m != first]  # spill: the others in random order
        self._rng.shuffle(rest)
        yield from rest


def _hash64(data: bytes) -> int:
    # blake2b, not hash(): routing must not change with PYTHONHASHSEED between runs.
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class AffinityRouter(ClusterRouter):
    """Consistent hashing of a request's first `prefix_blocks` block ids.

    A ring with `vnodes` points per machine: adding a machine moves only ~1/N of the prefixes,
    which is what a real deployment needs (a rehash of everything would empty every cache).
    One block is not enough on the conversation trace: every request starts with block 0 (a
    shared system prompt), so `prefix_blocks=1` sends all traffic to one machine. A request
    spills to the next machines clockwise on the ring (consistent hashing with bounded loads).
    """

    def __init__(self, machines: int, prefix_blocks: int = 2, vnodes: int = 64) -> None:
        if prefix_blocks < 1:
            raise ValueError("prefix_blocks must be >= 1")
        super().__init__(machines)
        self.prefix_blocks = prefix_blocks
        self.vnodes = vnodes
        self._build()

    def _build(self) -> None:
        ring = sorted((_hash64(f"machine-{m}/vnode-{v}".encode()), m)
                      for m in self.live for v in range(self.vnodes))
        self._points = [p for p, _ in ring]
        self._owners = [m for _, m in ring]

    def add_machine(self, machine: int) -> None:
        super().add_machine(machine)
        self._build()

    def remove_machine(self, machine: int) -> None:
        super().remove_machine(machine)
        self._build()

    def choices(self, request: Request, load: LoadView) -> Iterator[int]:
        head = b"".join(request.keys[: self.prefix_blocks])
        owners = self._owners
        n = len(owners)
        i = bisect.bisect(self._points, _hash64(head))
        seen: set[int] = set()
        for j in range(i, i + n):
            m = owners[j % n]
            if m not in seen:
                seen.add(m)
                yield m
                if len(seen) == len(self.live):
                    return


class KVAwareRouter(ClusterRouter):
    """Routes by where the blocks are, as the machines' KV events told it (`KVIndex`).

    Each live machine's cached prefix of the request (host or disk, from the index) is priced
    with the TTFT model: the modeled TTFT of an idle engine with that prefix. So a longer prefix
    wins, and a host block counts more than a disk block by exactly what it saves. The shared
    remote tier is not indexed: it is the same for every machine.

    - `load_weight=0` (`kv-aware`): best prefix first; ties (a new conversation, whose only
      cached block is the shared system prompt everywhere) go to the machine with the least
      queued work, then the fewest requests so far: llm-d's and Dynamo's order.
    - `load_weight=1` (`kv-ttft`): the cost is queued work + modeled TTFT, the TTFT the request
      would see there, so a long queue outweighs a short prefix without a spill bound.
    """

    def __init__(self, machines: int, model: TTFTModel, load_weight: float = 0.0,
                 lag: int = 0) -> None:
        super().__init__(machines)
        self.model = model
        self.load_weight = load_weight
        self.index = KVIndex(lag)

    def remove_machine(self, machine: int) -> None:
        super().remove_machine(machine)
        self.index.drop_machine(machine)

    def observe(self, batches: list[EventBatch]) -> None:
        self.index.publish(batches)

    def choices(self, request: Request, load: LoadView) -> Iterator[int]:
        model, length = self.model, request.input_length
        prefixes = self.index.prefixes(request.keys[: request.full_blocks], set(self.live))
        cold = model.ttft(b"", length)

        def cost(m: int) -> tuple[float, float, int, int]:
            p = prefixes.get(m)
            ttft = model.ttft(p, length) if p else cold
            queued = load.outstanding_s(m)
            return ttft + self.load_weight * queued, queued, load.requests_of(m), m

        return iter(sorted(self.live, key=cost))


ROUTINGS = ("random", "affinity", "kv-aware", "kv-ttft")
KV_ROUTINGS = ("kv-aware", "kv-ttft")


def make_router(kind: str, machines: int, seed: int = 0, affinity_blocks: int = 2,
                model: TTFTModel | None = None, lag: int = 0) -> ClusterRouter:
    if kind == "random":
        return RandomRouter(machines, seed)
    if kind == "affinity":
        return AffinityRouter(machines, affinity_blocks)
    if kind in KV_ROUTINGS:
        return KVAwareRouter(machines, model or TTFTModel(), 1.0 if kind == "kv-ttft" else 0.0,
                             lag)
    raise ValueError(f"unknown routing {kind!r} ({', '.join(ROUTINGS)})")


# ---------------------------------------------------------------- churn


CHURN_KINDS = ("fail", "leave", "join")


@dataclass(frozen=True)
class ChurnEvent:
    """At fraction `at` of the trace's requests, `machine` fails or leaves, or one joins."""

    at: float
    kind: str
    machine: int | None = None

    def __str__(self) -> str:
        who = "" if self.machine is None else f":{self.machine}"
        return f"{self.kind}{who}@{self.at:g}"


def parse_churn(text: str) -> list[ChurnEvent]:
    """`fail:3@0.5,join@0.7,leave:1@0.8` (machine ids as numbered at the start, joiners take
    the next ids); `none` or '' is no churn."""
    out = []
    for item in (x.strip() for x in text.split(",")):
        if not item or item == "none":
            continue
        what, sep, at = item.partition("@")
        kind, _, machine = what.partition(":")
        try:
            frac = float(at)
            who = int(machine) if machine else None
        except ValueError:
            raise ValueError(f"churn {item!r}: expected KIND[:MACHINE]@FRACTION") from None
        if not sep or kind not in CHURN_KINDS or not 0.0 <= frac <= 1.0:
            raise ValueError(f"churn {item!r}: expected fail:M@F, leave:M@F or join@F, "
                             "F in [0, 1]")
        if (kind == "join") != (who is None):
            raise ValueError(f"churn {item!r}: fail and leave name a machine, join does not")
        out.append(ChurnEvent(frac, kind, who))
    return sorted(out, key=lambda e: e.at)


# ---------------------------------------------------------------- the cluster


@dataclass(frozen=True)
class ClusterConfig:
    """Capacities in bytes; every block is `block_bytes` (one layout, full blocks)."""

    machines: int
    host_bytes: int
    disk_bytes: int
    remote_bytes: int
    block_bytes: int


@dataclass
class Machine:
    placement: Hierarchy  # host over disk, the daemon's placement engine (`tiers.hierarchy`)
    requests: int = 0
    alive: bool = True
    busy_until: float = 0.0  # when its queued work is done (trace seconds)
    in_flight: deque[float] = field(default_factory=deque)  # finish times, FIFO
    joined_at: int = 0  # request index
    left_at: int | None = None

    @property
    def host(self) -> TierPolicy:
        return self.placement.levels[0].policy

    @property
    def disk(self) -> TierPolicy:
        return self.placement.levels[1].policy


@dataclass
class SimResult:
    """What a replay produced: per-request served tiers (bytes of tier codes), machines, and
    the queue model's wait and TTFT."""

    config: ClusterConfig
    served: list[bytes] = field(default_factory=list)
    machine_of: list[int] = field(default_factory=list)
    wait_s: list[float] = field(default_factory=list)  # queueing before its prefill began
    ttft_q_s: list[float] = field(default_factory=list)  # wait + modeled TTFT
    total_blocks: int = 0
    tier_blocks: list[int] = field(default_factory=lambda: [0, 0, 0])
    unpromoted: int = 0  # lower-tier hits host had no room for (full of pinned blocks)
    remote_writes: int = 0
    evictions: dict[str, int] = field(default_factory=dict)
    spilled: int = 0  # requests not sent to the router's first choice (over the bound)
    block_events: int = 0  # blocks named in BlockStored / BlockRemoved events
    lost_in_flight: int = 0  # requests queued or in prefill on a machine when it failed
    session_ends: int = 0  # end-of-conversation hints delivered (`ClusterSim.end_session`)
    ended_blocks: int = 0  # blocks those hints marked, summed over the tiers
    churn_log: list[dict[str, Any]] = field(default_factory=list)

    def fractions(self) -> dict[str, float]:
        """Fraction of prompt blocks served from each tier, and computed."""
        total = max(self.total_blocks, 1)
        out = {name: n / total for name, n in zip(TIER_NAMES, self.tier_blocks, strict=True)}
        out["computed"] = 1.0 - sum(out.values())
        return out


class ClusterSim:
    """N machines (host + disk `TierPolicy` each) and one shared remote `TierPolicy`.

    `eviction` names the eviction policy of the machines' tiers (`kvstore.eviction`); the
    remote tier stays LRU (Redis evicts by approximate LRU). The policies' clock is the trace's:
    every call made for a request happens at its arrival time.

    Each machine serves one request at a time, first come first served: a request's service
    time is its modeled TTFT (`model`), and it waits for the machine's earlier work. A
    `ClusterRouter` ranks machines; the first whose queued work is at most `spill_bound_s`
    seconds takes the request (all over: the least loaded). The cache is looked up and published
    at arrival all the same: the queue changes timing, not contents.

    Machines publish KV events (`EventBatch`) as blocks enter and leave their tiers, once per
    request, to `subscribers` and to the router's `observe`.
    """

    def __init__(self, config: ClusterConfig, router: Router, eviction: str = "lru",
                 model: TTFTModel | None = None, spill_bound_s: float = math.inf) -> None:
        self.config = config
        self.router = router
        self.block = config.block_bytes
        self.eviction = eviction
        self.model = model or TTFTModel()
        self.spill_bound_s = spill_bound_s
        self.now = 0.0
        self.subscribers: list[Callable[[list[EventBatch]], object]] = []
        if isinstance(router, ClusterRouter):
            self.subscribers.append(router.observe)
        self._outbox: list[EventBatch] = []
        self._events: list[KVEvent] = []  # the current request's machine's
        self._seq = 0  # requests processed
        self.machines = [self._new_machine(i) for i in range(config.machines)]
        self.remote = TierPolicy("remote", config.remote_bytes, "lru", self._clock)
        self.result = SimResult(config)

    def _clock(self) -> float:
        return self.now

    def _new_machine(self, i: int) -> Machine:
        cfg = self.config
        host = TierPolicy(f"m{i}.host", cfg.host_bytes, self.eviction, self._clock)
        disk = TierPolicy(f"m{i}.disk", cfg.disk_bytes, self.eviction, self._clock)
        placement = Hierarchy([MetaLevel(host, HOST_MEDIUM), MetaLevel(disk, DISK_MEDIUM)])
        return Machine(placement, joined_at=self._seq)

    # -- what routers may see of the load (`LoadView`)

    def outstanding_s(self, machine: int) -> float:
        return max(self.machines[machine].busy_until - self.now, 0.0)

    def requests_of(self, machine: int) -> int:
        return self.machines[machine].requests

    # -- events

    def _stored(self, medium: str, key: bytes) -> None:
        ev = self._events
        last = ev[-1] if ev else None
        if isinstance(last, BlockStored) and last.medium == medium:
            last.block_hashes.append(key)  # one event per run of blocks, as vLLM batches them
        else:
            ev.append(BlockStored([key], medium))
        self.result.block_events += 1

    def _removed(self, medium: str, key: bytes) -> None:
        ev = self._events
        last = ev[-1] if ev else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(key)
        else:
            ev.append(BlockRemoved([key], medium))
        self.result.block_events += 1

    def _publish(self) -> None:
        batches, self._outbox = self._outbox, []
        for deliver in self.subscribers:
            deliver(batches)

    # -- placement: the daemon's engine (`tiers.hierarchy`), applied to metadata

    def _changed(self, medium: str, key: bytes, stored: bool) -> None:
        (self._stored if stored else self._removed)(medium, key)

    def _to_host(self, m: Machine, key: bytes) -> bool:
        """Make room in host (victims demoted to disk, disk victims dropped) and add `key`;
        False if no room (the rest of host is pinned by this request: the daemon stops)."""
        return m.placement.place(0, key, self.block, self._changed)

    def _share(self, m: Machine, keys: Sequence[bytes]) -> PromptShare:
        """The prompt's share of host (`PromptShare`), sized as the daemon's fetch sizes it at
        its first disk or remote hit: its host blocks, then its disk blocks up to the first
        block held by neither."""
        used = rest = 0
        local = True
        for key in keys:
            if key in m.host:
                used += self.block
            elif key in m.disk:
                rest += self.block
            else:
                local = False
                break
        return PromptShare.size(m.host.capacity_bytes, FETCH_WINDOW_BYTES, self.block, used,
                                rest, open_ended=self.remote.capacity_bytes > 0, local=local)

    def _write_through(self, keys: Sequence[bytes]) -> None:
        remote = self.remote
        if self.block > remote.capacity_bytes:
            return
        for key in keys:
            if key in remote:
                continue
            for v in remote.victims(self.block):
                remote.remove(v)
                remote.count_eviction()
            remote.add(key, self.block)
            self.result.remote_writes += 1
        remote.touch_chain(keys)

    # -- routing

    def _route(self, req: Request) -> int:
        router = self.router
        if not isinstance(router, ClusterRouter):
            return router.route(req)
        bound = self.spill_bound_s
        first = chosen = best = -1
        best_queued = math.inf
        for m in router.choices(req, self):
            queued = self.outstanding_s(m)
            if first < 0:
                first = m
            if queued <= bound:
                chosen = m
                break
            if queued < best_queued:
                best, best_queued = m, queued
        else:
            chosen = best  # every machine is over the bound: the least loaded
        if chosen < 0:
            raise RuntimeError("no machine left in the cluster")
        if chosen != first:
            self.result.spilled += 1
        return chosen

    # -- one request

    def process(self, req: Request) -> bytes:
        """Serve one request; returns its served-prefix tier codes (one byte per block)."""
        self.now = req.timestamp_ms / 1e3
        idx = self._route(req)
        m = self.machines[idx]
        if not m.alive:
            raise RuntimeError(f"request routed to machine {idx}, which has left")
        m.requests += 1
        self._events = []
        host, disk, remote = m.host, m.disk, self.remote
        keys = req.keys[: req.full_blocks]
        served = bytearray()
        pinned: list[bytes] = []
        res = self.result
        share: PromptShare | None = None
        for key in keys:
            if key in host:
                served.append(HOST)
                continue
            if key in disk:
                served.append(DISK)
            elif key in remote:
                served.append(REMOTE)
            else:
                break  # a prefix with a hole is useless past the hole
            # Promoted while the prompt is within its share of host, as the daemon's fetch
            # does; past it (a prompt larger than host) served from scratch space.
            share = share or self._share(m, keys)
            if share.promotes(self.block) and self._to_host(m, key):
                share.used += self.block
            else:
                res.unpromoted += 1
            if key in host:
                host.pin(key)  # the daemon pins fetched blocks under a lease
                pinned.append(key)
        hit = len(served)
        prefix = keys[:hit]
        m.placement.touch(prefix)
        remote.touch_chain(prefix)

        # Publish: the engine computed the rest; all of it goes to host, pinned while reserved.
        for key in keys[hit:]:
            if key not in host and not self._to_host(m, key):
                break  # host full of this request's pins: publish stops, as reserve() does
            host.pin(key)
            pinned.append(key)
        # The whole chain, hits included: touching only new blocks would leave their parents
        # older than them, and LRU would evict parents first.
        m.placement.touch(keys)
        self._write_through(keys)
        for key in pinned:
            host.unpin(key)

        res.total_blocks += len(req.hash_ids)  # a partial last block counts as computed
        for code in served:
            res.tier_blocks[code] += 1
        out = bytes(served)
        res.served.append(out)
        res.machine_of.append(idx)

        # The queue: FIFO, one request at a time; its service time is its modeled TTFT.
        flight = m.in_flight
        while flight and flight[0] <= self.now:
            flight.popleft()
        start = max(self.now, m.busy_until)
        m.busy_until = start + self.model.ttft(out, req.input_length)
        flight.append(m.busy_until)
        res.wait_s.append(start - self.now)
        res.ttft_q_s.append(m.busy_until - self.now)

        self._outbox.append(EventBatch(idx, self._events))
        self._publish()
        self._seq += 1
        return out

    # -- client hints

    def end_session(self, machine: int, keys: Sequence[bytes]) -> int:
        """A client's hint that the conversation whose prompt was `keys` (full blocks, root
        first) ended, sent to `machine`, which served it, as the daemon takes it
        (`Hierarchy.end_session`): each of its tiers' policies then evicts that conversation's
        own blocks first (`TierPolicy.end_session`; only `prefix` acts on it). Returns the
        blocks marked, summed over its tiers."""
        marked = self.machines[machine].placement.end_session(keys)
        self.result.session_ends += 1
        self.result.ended_blocks += marked
        return marked

    # -- churn

    def fail(self, machine: int) -> None:
        """The machine is gone with its host and disk; what it had queued is lost."""
        self._remove(machine, failed=True)

    def leave(self, machine: int) -> None:
        """The machine finishes what it has queued and goes, with its host and disk."""
        self._remove(machine, failed=False)

    def join(self) -> int:
        """A new, empty machine; returns its id (the next unused one)."""
        i = len(self.machines)
        self.machines.append(self._new_machine(i))
        if isinstance(self.router, ClusterRouter):
            self.router.add_machine(i)
        self.result.churn_log.append({"at_request": self._seq, "kind": "join", "machine": i})
        return i

    def _remove(self, machine: int, failed: bool) -> None:
        if not isinstance(self.router, ClusterRouter):
            raise TypeError("machines can leave only under a ClusterRouter")
        if not 0 <= machine < len(self.machines) or not self.machines[machine].alive:
            raise ValueError(f"machine {machine} is not in the cluster")
        m = self.machines[machine]
        self.router.remove_machine(machine)
        lost = sum(t > self.now for t in m.in_flight) if failed else 0
        self.result.lost_in_flight += lost
        m.alive, m.left_at = False, self._seq
        # Its tiers are lost: fresh empty ones keep the eviction counts for the totals.
        for level in m.placement.levels:
            old = level.policy
            level.policy = TierPolicy(old.name, 0, "lru", self._clock)
            level.policy.evictions = old.evictions
        self._outbox.append(EventBatch(machine, [AllBlocksCleared()]))
        self.result.churn_log.append({"at_request": self._seq,
                                      "kind": "fail" if failed else "leave",
                                      "machine": machine, "lost_in_flight": lost})

    def apply(self, event: ChurnEvent) -> None:
        if event.kind == "join":
            self.join()
        elif event.machine is None:
            raise ValueError(f"{event}: no machine")
        elif event.kind == "fail":
            self.fail(event.machine)
        else:
            self.leave(event.machine)

    def run(self, requests: Iterable[Request],
            progress: Callable[[int], object] | None = None,
            churn: Sequence[ChurnEvent] = (),
            hints: Iterable[SessionEnd] = ()) -> SimResult:
        """Replay `requests` in order; `progress(n)` is called every few hundred requests.
        Each churn event happens just before the request at its fraction of the trace.

        `hints` (`session_ends`): `(time, j)` says at trace time `time` that the conversation
        of request `j` (an index into `requests`) ended; it goes to the machine that served `j`
        (`end_session`), after `j` was processed and before the first later request arriving
        at or after `time`. Hints due after the last request are never sent."""
        ends = deque(sorted(hints))
        listed = list(requests) if churn or ends else []
        reqs = listed if churn or ends else requests
        n = len(listed)
        todo = deque(sorted(churn, key=lambda e: e.at))
        base = len(self.result.machine_of)  # requests this simulator served before this run
        pending = 0
        for i, req in enumerate(reqs):
            while todo and todo[0].at * n <= i:
                self.now = req.timestamp_ms / 1e3
                self.apply(todo.popleft())
            arrival = req.timestamp_ms / 1e3
            while ends and ends[0][0] <= arrival and ends[0][1] < i:
                at, j = ends.popleft()
                self.now = max(self.now, at)
                ended = listed[j]
                # As a client names it (`end_session(tokens, shared_tokens)`): the blocks
                # other conversations share are not its own to end.
                self.end_session(self.result.machine_of[base + j], ended.keys[
                    ended.shared_tokens // TRACE_BLOCK_TOKENS: ended.full_blocks])
            self.process(req)
            pending += 1
            if progress is not None and pending == 256:
                progress(pending)
                pending = 0
        if progress is not None and pending:
            progress(pending)
        ev = {"host": sum(m.host.evictions for m in self.machines),
              "disk": sum(m.disk.evictions for m in self.machines),
              "remote": self.remote.evictions}
        self.result.evictions = ev
        return self.result

    def load_imbalance(self) -> float:
        """Max over mean of the machines' requests per request of the trace they were in it
        for: with no churn, max/mean requests per machine."""
        total = self._seq
        rates = [m.requests / span for m in self.machines
                 if (span := (total if m.left_at is None else m.left_at) - m.joined_at) > 0]
        mean = sum(rates) / len(rates) if rates else 0.0
        return max(rates) / mean if mean else 1.0


# ---------------------------------------------------------------- TTFT model


@dataclass(frozen=True)
class TTFTModel:
    """Time to first token = load the cached prefix + prefill the rest, serially.

    Linear in tokens on both sides: prefill throughput is a constant (it really falls with
    context length, as attention grows), and a tier's load is bytes / bandwidth. Disk and remote
    loads cross PCIe as well, pipelined, so they run at the slower of the two links. A block is
    loaded only where that beats recomputing it: the prefix length that minimises the total is
    chosen (the "load or recompute" plan of DESIGN.md), so a slow tier can never make TTFT worse
    than not caching at all. No queueing: this is the TTFT of an idle engine.
    """

    bytes_per_token: int = LLAMA3_8B_BF16_BYTES_PER_TOKEN
    block_tokens: int = TRACE_BLOCK_TOKENS
    prefill_tokens_per_s: float = 15_000.0
    host_gbps: float = 25.0
    disk_gbps: float = 3.0
    remote_gbps: float = 1.25

    def load_seconds_per_token(self) -> tuple[float, float, float]:
        """Seconds to bring one token's KV to the GPU from host, disk, remote."""
        host = self.host_gbps * 1e9
        return (self.bytes_per_token / host,
                self.bytes_per_token / min(self.disk_gbps * 1e9, host),
                self.bytes_per_token / min(self.remote_gbps * 1e9, host))

    def breakeven_gbps(self) -> float:
        """A tier slower than this loses to recomputation."""
        return self.bytes_per_token * self.prefill_tokens_per_s / 1e9

    def ttft(self, served: bytes, input_length: int) -> float:
        """The daemon's clients' own load-or-recompute plan (`kvstore.planner.plan`) over the
        served prefix's tiers, at this model's rates and no fixed cost per tier."""
        host, disk, remote = self.load_seconds_per_token()
        rates = {name: self.bytes_per_token / s
                 for name, s in zip(TIER_NAMES, (host, disk, remote), strict=True)}
        best = plan([TIER_NAMES[code] for code in served], max(input_length, 1),
                    self.block_tokens, self.bytes_per_token, self.prefill_tokens_per_s,
                    bandwidth=rates, latency=_NO_LATENCY)
        return best.ttft_s

    def ttfts(self, result: SimResult, requests: Sequence[Request]) -> np.ndarray:
        return np.fromiter((self.ttft(s, r.input_length)
                            for s, r in zip(result.served, requests, strict=True)),
                           dtype=np.float64, count=len(requests))


def ttft_stats(t: np.ndarray) -> dict[str, float]:
    if t.size == 0:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    return {"mean": float(t.mean()), "p50": float(np.percentile(t, 50)),
            "p99": float(np.percentile(t, 99))}


# ---------------------------------------------------------------- Belady vs LRU


def next_uses(requests: Sequence[Request]) -> tuple[list[int], int]:
    """For each cacheable block access (requests in order, full blocks in chain order), the
    index of the next access to the same block, or `never` (= the number of accesses)."""
    seq = [h for r in requests for h in r.hash_ids[: r.full_blocks]]
    never = len(seq)
    nxt = [never] * never
    last: dict[int, int] = {}
    for j in range(never - 1, -1, -1):
        b = seq[j]
        nxt[j] = last.get(b, never)
        last[b] = j
    return nxt, never


def belady_hit_rate(requests: Sequence[Request], capacity_blocks: int, bypass: bool = True,
                    progress: Callable[[int], object] | None = None) -> float:
    """Prefix hit rate of one cache of `capacity_blocks` under Belady's optimal eviction.

    Every block of every request is accessed (looked up, then published), as in the LRU
    replay; a block counts as a hit only while the prefix is unbroken. On a miss with a full
    cache the block with the farthest next use is evicted. With `bypass` (Belady's MIN proper)
    the incoming block itself is that candidate too, so a block never used again is not cached;
    without it every block is admitted, as our policy does, and only the eviction order differs.

    A max-heap of (next use, block) with lazy deletion: each access pushes a fresh entry, and
    stale ones (the block's next use has moved on, or it left) are skipped when they surface.
    """
    nxt, never = next_uses(requests)
    cache: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, block)
    hits = j = total = 0
    pending = 0
    for r in requests:
        whole = True
        total += len(r.hash_ids)
        for b in r.hash_ids[: r.full_blocks]:
            nu = nxt[j]
            j += 1
            if b in cache:
                hits += whole
                cache[b] = nu
                heapq.heappush(heap, (-nu, b))
                continue
            whole = False
            if capacity_blocks <= 0:
                continue
            if len(cache) >= capacity_blocks:
                if bypass and nu == never:
                    continue
                while True:  # the farthest still-valid entry
                    neg, v = heap[0]
                    if cache.get(v) == -neg:
                        break
                    heapq.heappop(heap)
                if bypass and -neg <= nu:
                    continue  # the incoming block is needed last: leave it out
                heapq.heappop(heap)
                del cache[v]
            cache[b] = nu
            heapq.heappush(heap, (-nu, b))
        pending += 1
        if progress is not None and pending == 256:
            progress(pending)
            pending = 0
    if progress is not None and pending:
        progress(pending)
    return hits / max(total, 1)


def policy_hit_rate(requests: Sequence[Request], capacity_blocks: int, eviction: str = "lru",
                    block_bytes: int = 1,
                    progress: Callable[[int], object] | None = None,
                    hints: Iterable[SessionEnd] = ()) -> float:
    """Prefix hit rate of one machine's host tier alone (no disk, no remote), under the
    daemon's eviction policy `eviction`; with `hints` (`session_ends`), a client says when
    each conversation ended."""
    cfg = ClusterConfig(machines=1, host_bytes=capacity_blocks * block_bytes, disk_bytes=0,
                        remote_bytes=0, block_bytes=block_bytes)
    res = ClusterSim(cfg, RandomRouter(1), eviction).run(requests, progress, hints=hints)
    return res.tier_blocks[HOST] / max(res.total_blocks, 1)


def lru_hit_rate(requests: Sequence[Request], capacity_blocks: int, block_bytes: int = 1,
                 progress: Callable[[int], object] | None = None) -> float:
    """`policy_hit_rate` under LRU."""
    return policy_hit_rate(requests, capacity_blocks, "lru", block_bytes, progress)


def infinite_hit_rate(requests: Sequence[Request]) -> float:
    """Prefix hit rate with unbounded capacity: the ceiling for every policy."""
    seen: set[int] = set()
    hits = total = 0
    for r in requests:
        full = r.hash_ids[: r.full_blocks]
        k = 0
        while k < len(full) and full[k] in seen:
            k += 1
        hits += k
        total += len(r.hash_ids)
        seen.update(full)
    return hits / max(total, 1)


# ---------------------------------------------------------------- CLI


def parse_capacity(value: str, block_bytes: int) -> int:
    """Bytes from `64GiB`, `1.5TB`, `1048576` or a block count such as `2048blocks`."""
    v = value.strip().lower()
    for suffix in ("blocks", "block"):
        if v.endswith(suffix):
            return int(float(v[: -len(suffix)].strip()) * block_bytes)
    return parse_size(value, "capacity")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]  # float("inf") is infinity


def _gib(nbytes: int) -> float:
    return nbytes / 2**30


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.simulate", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="JSONL trace (%(default)s)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--machines", type=_ints, default=[1, 2, 4, 8, 16, 32, 64],
                   help="comma-separated machine counts to sweep (default 1,2,4,8,16,32,64)")
    p.add_argument("--routing", default="random,affinity",
                   help="comma-separated routings: random, affinity, kv-aware (best cached "
                        "prefix per the machines' KV events, ties to the least loaded), "
                        "kv-ttft (least queued work + modeled TTFT) (default random,affinity)")
    p.add_argument("--affinity-blocks", type=int, default=2,
                   help="affinity routing hashes this many leading block ids (default 2; "
                        "block 0 is in every request of the conversation trace)")
    p.add_argument("--host", default="128GiB",
                   help="host RAM per machine: bytes or NNblocks (%(default)s)")
    p.add_argument("--disk", default="1TiB",
                   help="disk per machine: bytes or NNblocks (%(default)s)")
    p.add_argument("--remote", default="1TiB",
                   help="shared remote tier: bytes or NNblocks; a comma-separated list sweeps "
                        "it, e.g. 1TiB,0 (%(default)s)")
    p.add_argument("--bytes-per-token", type=int, default=LLAMA3_8B_BF16_BYTES_PER_TOKEN,
                   help="KV bytes per token (default Llama-3-8B bf16: 131072)")
    p.add_argument("--prefill-tps", type=float, default=15_000.0,
                   help="prefill tokens/s of the engine (8B on an H100: ~10-20k)")
    p.add_argument("--host-gbps", type=float, default=25.0, help="host->GPU GB/s (PCIe)")
    p.add_argument("--disk-gbps", type=float, default=3.0, help="NVMe read GB/s")
    p.add_argument("--remote-gbps", type=float, default=1.25, help="network GB/s (10 GbE)")
    p.add_argument("--remote-gbps-alt", type=float, default=12.5,
                   help="a second remote bandwidth for TTFT (100 GbE); 0 to skip")
    p.add_argument("--belady-capacities", type=_ints,
                   default=[1024, 2048, 4096, 8192, 16384, 32768, 65536],
                   help="single-tier capacities in blocks for the policies vs Belady ('' to skip)")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="comma-separated eviction policies compared with Belady on one tier: "
                        f"{', '.join(POLICIES)}, or default (= {DEFAULT_POLICY}); LRU is "
                        "always run (default: all)")
    p.add_argument("--end-sessions", type=_floats, default=[], metavar="SECONDS[,SECONDS...]",
                   help="run the --policies replays again with a client that says a "
                        "conversation ended (end_session) this many seconds after its last "
                        "turn, known from the trace in hindsight; one run per delay "
                        "(default: none)")
    p.add_argument("--eviction", default=DEFAULT_POLICY, choices=sorted(POLICIES),
                   help="eviction policy of the machines' tiers in the cluster sweep "
                        "(default: the daemon's, %(default)s)")
    p.add_argument("--spill-bound-s", type=_floats, default=[math.inf],
                   help="a request spills to the router's next choice when the chosen "
                        "machine has more than this many seconds of work queued; a comma-"
                        "separated list sweeps it (default inf: never)")
    p.add_argument("--kv-lag", type=_ints, default=[0],
                   help="KV events reach the kv routers this many requests late; a list "
                        "sweeps it (default 0)")
    p.add_argument("--churn", action="append", default=None,
                   help="machines failing, leaving, joining at fractions of the trace's "
                        "requests, e.g. fail:3@0.5,join@0.7,leave:1@0.8; repeat the flag to "
                        "sweep, 'none' for no churn (default none)")
    p.add_argument("--churn-window", type=float, default=0.05,
                   help="hit fractions and TTFT are also reported over this fraction of the "
                        "trace after each churn event (default 0.05: ~600 requests, 3 min)")
    p.add_argument("--seed", type=int, default=0, help="random routing seed")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs")
    p.add_argument("--json", type=Path, default=None,
                   help="write the results here instead of benchmarks/results/NAME.json")
    p.add_argument("--name", default="simulate",
                   help="results name: benchmarks/results/NAME.json and NAME_*.png "
                        "(%(default)s)")
    p.add_argument("--cost", action="store_true",
                   help="only measure each policy's bookkeeping cost (touching a 512-block "
                        "chain, one eviction) and exit")
    return p


def policy_names(text: str) -> list[str]:
    """The policies of `--policies`, in order, LRU first; `default` is kept as a name."""
    names = ["lru"]
    for name in (n.strip() for n in text.split(",")):
        if name and name not in names:
            if name != "default" and name not in POLICIES:
                raise SystemExit(f"--policies: unknown policy {name!r} "
                                 f"({', '.join(POLICIES)}, default)")
            names.append(name)
    return names


@dataclass(frozen=True)
class RunSpec:
    """One replay of a sweep. `kv_lag` is None for routers that do not read KV events."""

    routing: str
    machines: int
    remote_bytes: int
    churn: str = "none"
    spill_bound_s: float = math.inf
    kv_lag: int | None = None


def grid(machines: Sequence[int], routings: Sequence[str], remotes: Sequence[int],
         churns: Sequence[str] = ("none",), spill_bounds: Sequence[float] = (math.inf,),
         kv_lags: Sequence[int] = (0,)) -> list[RunSpec]:
    """Every combination, machines innermost; the lag sweeps only the KV-event routers."""
    return [RunSpec(routing, n, remote, churn, bound, lag)
            for remote in remotes for churn in churns for bound in spill_bounds
            for routing in routings
            for lag in (kv_lags if routing in KV_ROUTINGS else [None])
            for n in machines]


def block_fractions(res: SimResult, requests: Sequence[Request], lo: int,
                    hi: int) -> dict[str, float]:
    """`SimResult.fractions` over requests lo..hi-1 only."""
    counts = [0, 0, 0]
    for s in res.served[lo:hi]:
        for code in (HOST, DISK, REMOTE):
            counts[code] += s.count(code)
    total = max(sum(len(r.hash_ids) for r in requests[lo:hi]), 1)
    out = {name: c / total for name, c in zip(TIER_NAMES, counts, strict=True)}
    out["computed"] = 1.0 - sum(out.values())
    return out


def _bound_json(bound: float) -> float | None:
    return None if math.isinf(bound) else bound  # JSON has no infinity


def sweep(requests: Sequence[Request], machines: Sequence[int], routings: Sequence[str],
          host_bytes: int, disk_bytes: int, remote_bytes: int | Sequence[int], block_bytes: int,
          models: dict[str, TTFTModel], seed: int = 0, affinity_blocks: int = 2,
          bar: tqdm | None = None, eviction: str = "lru", churns: Sequence[str] = ("none",),
          spill_bounds: Sequence[float] = (math.inf,), kv_lags: Sequence[int] = (0,),
          churn_window: float = 0.05, series_points: int = 40) -> list[dict[str, Any]]:
    """One replay per `RunSpec` of the grid; a row of hit fractions, TTFT stats (idle engine,
    and with the queue), load, and for each churn event of any `churns`, the same over the
    `churn_window` of the trace after it (in every row, churn or not, to compare)."""
    span_s = max((requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1e3, 1e-3)
    remotes = [remote_bytes] if isinstance(remote_bytes, int) else list(remote_bytes)
    n_req = len(requests)
    marks = churn_marks(churns)
    rows: list[dict[str, Any]] = []
    for spec in grid(machines, routings, remotes, churns, spill_bounds, kv_lags):
        n = spec.machines
        if bar is not None:
            bar.set_postfix_str(f"{spec.routing} x{n}" + (
                "" if spec.churn == "none" else f" {spec.churn}"))
        cfg = ClusterConfig(n, host_bytes, disk_bytes, spec.remote_bytes, block_bytes)
        router = make_router(spec.routing, n, seed, affinity_blocks, models["default"],
                             spec.kv_lag or 0)
        sim = ClusterSim(cfg, router, eviction, models["default"], spec.spill_bound_s)
        res = sim.run(requests, bar.update if bar is not None else None,
                      parse_churn(spec.churn))
        row: dict[str, Any] = {"routing": routing_label(spec), "machines": n,
                               "remote_gib": _gib(spec.remote_bytes), "churn": spec.churn,
                               "spill_bound_s": _bound_json(spec.spill_bound_s),
                               "kv_lag": spec.kv_lag, **res.fractions()}
        row["load_max_over_mean"] = sim.load_imbalance()
        for label, model in models.items():
            t = model.ttfts(res, requests)
            for stat, v in ttft_stats(t).items():
                row[f"ttft_{stat}_s" + ("" if label == "default" else f"@{label}")] = v
            if label == "default":
                # Busiest machine's prefill time over the trace's span: above 1 it cannot
                # keep up, and its queue grows without bound (the ttft_q columns).
                busy = np.bincount(np.asarray(res.machine_of), weights=t,
                                   minlength=len(sim.machines))
                row["max_util"] = float(busy.max() / span_s)
        tq = np.asarray(res.ttft_q_s)
        wait = np.asarray(res.wait_s)
        for stat, v in ttft_stats(tq).items():
            row[f"ttft_q_{stat}_s"] = v
        row["wait_mean_s"] = float(wait.mean())
        row["wait_p99_s"] = float(np.percentile(wait, 99))
        row["spilled"] = res.spilled / n_req
        row["lost_in_flight"] = res.lost_in_flight
        row["block_events_per_s"] = res.block_events / span_s
        row["unpromoted"] = res.unpromoted
        row["remote_writes"] = res.remote_writes
        # Write-through ingest the remote tier must absorb, averaged over the trace.
        row["remote_write_gbps"] = res.remote_writes * block_bytes / span_s / 1e9
        row["evictions"] = res.evictions
        row["churn_log"] = res.churn_log
        row["windows"] = []
        for at, label in marks:
            lo, hi = int(at * n_req), min(int((at + churn_window) * n_req), n_req)
            if hi <= lo:
                continue
            window = {"after": label, "requests": [lo, hi],
                      **block_fractions(res, requests, lo, hi)}
            window.update({f"ttft_q_{k}_s": v for k, v in ttft_stats(tq[lo:hi]).items()})
            row["windows"].append(window)
        spans = list(itertools.pairwise(
            int(e) for e in np.linspace(0, n_req, series_points + 1)))
        parts = [block_fractions(res, requests, lo, hi) for lo, hi in spans]
        row["series"] = {"start": [lo / n_req for lo, _ in spans],
                         "hit": [1.0 - p["computed"] for p in parts],
                         "remote": [p["remote"] for p in parts],
                         "ttft_q_mean_s": [float(tq[lo:hi].mean()) if hi > lo else 0.0
                                           for lo, hi in spans]}
        rows.append(row)
    return rows


def churn_marks(churns: Sequence[str]) -> list[tuple[float, str]]:
    """Where churn happens in any of `churns`, and what: `fail:0,fail:1@0.5` for two machines
    failing at once."""
    at: dict[float, list[str]] = {}
    for c in churns:
        for e in parse_churn(c):
            what = str(e).split("@")[0]
            if what not in at.setdefault(e.at, []):
                at[e.at].append(what)
    return [(f, ",".join(what) + f"@{f:g}") for f, what in sorted(at.items())]


def routing_label(spec: RunSpec) -> str:
    """The routing's name, with its event lag where there is one."""
    return spec.routing if not spec.kv_lag else f"{spec.routing} lag {spec.kv_lag}"


def belady_compare(requests: Sequence[Request], capacities: Sequence[int], block_bytes: int,
                   bar: tqdm | None = None,
                   policies: Sequence[str] = ("lru",)) -> tuple[list[dict[str, Any]],
                                                               dict[str, Any]]:
    """Single-tier hit rates of each policy and of Belady at each capacity: the rows of the
    LRU-vs-Belady table, and the "policies" section of the JSON (`default` is the daemon's
    default policy, replayed once under its own name)."""
    names = {p: DEFAULT_POLICY if p == "default" else p for p in policies}
    runs = list(dict.fromkeys(["lru", *names.values()]))
    rate: dict[str, list[float]] = {p: [] for p in ["belady", "belady_admit_all", *runs]}
    rows = []
    for cap in capacities:
        upd = bar.update if bar is not None else None
        for p in runs:
            if bar is not None:
                bar.set_postfix_str(f"{p} @ {cap} blocks")
            rate[p].append(policy_hit_rate(requests, cap, p, block_bytes, upd))
        if bar is not None:
            bar.set_postfix_str(f"Belady @ {cap} blocks")
        opt = belady_hit_rate(requests, cap, bypass=True, progress=upd)
        opt_admit = belady_hit_rate(requests, cap, bypass=False, progress=upd)
        rate["belady"].append(opt)
        rate["belady_admit_all"].append(opt_admit)
        lru = rate["lru"][-1]
        rows.append({"capacity_blocks": cap, "capacity_gib": _gib(cap * block_bytes),
                     "lru": lru, "belady": opt, "belady_admit_all": opt_admit,
                     "lru_over_belady": lru / opt if opt else 1.0,
                     "lru_over_belady_admit_all": lru / opt_admit if opt_admit else 1.0,
                     **{p: rate[p][-1] for p in runs if p != "lru"}})
    for alias, name in names.items():
        rate[alias] = rate[name]
    over = {p: [h / b if b else 1.0 for h, b in zip(rate[p], rate["belady"], strict=True)]
            for p in rate if p != "belady"}
    over_lru = {p: [h / b if b else 1.0 for h, b in zip(rate[p], rate["lru"], strict=True)]
                for p in rate}
    section = {"default": DEFAULT_POLICY, "capacity_blocks": list(capacities),
               "hit_rate": rate, "over_belady": over, "over_lru": over_lru}
    return rows, section


def end_session_compare(requests: Sequence[Request], capacities: Sequence[int],
                        block_bytes: int, delays: Sequence[float],
                        policies: Sequence[str] = ("lru",),
                        belady: Sequence[float] | None = None,
                        bar: tqdm | None = None) -> dict[str, Any]:
    """The single-tier replays of `belady_compare` again, with a client that says each
    conversation ended `delay` seconds after its last turn (`session_ends`), for each of
    `delays`: the "end_sessions" section of the JSON, keyed by the delay (`f"{d:g}"`), each
    with its hit rates per policy and capacity, their ratios to `belady` (Belady MIN's rates
    at the same capacities, hints or not: it knows the future anyway) and to LRU's."""
    names = {p: DEFAULT_POLICY if p == "default" else p for p in policies}
    runs = list(dict.fromkeys(["lru", *names.values()]))
    upd = bar.update if bar is not None else None
    out: dict[str, Any] = {}
    for delay in delays:
        hints = session_ends(requests, delay)
        rate: dict[str, list[float]] = {p: [] for p in runs}
        for cap in capacities:
            for p in runs:
                if bar is not None:
                    bar.set_postfix_str(f"{p} @ {cap} blocks, hints +{delay:g} s")
                rate[p].append(policy_hit_rate(requests, cap, p, block_bytes, upd, hints))
        for alias, name in names.items():
            rate[alias] = rate[name]
        entry: dict[str, Any] = {"delay_s": delay, "session_ends": len(hints),
                                 "hit_rate": rate}
        if belady is not None:
            entry["over_belady"] = {
                p: [h / b if b else 1.0 for h, b in zip(rate[p], belady, strict=True)]
                for p in rate}
        entry["over_lru"] = {
            p: [h / b if b else 1.0 for h, b in zip(rate[p], rate["lru"], strict=True)]
            for p in rate}
        out[f"{delay:g}"] = entry
    return out


def policy_cost(policies: Sequence[str], chain: int = 512, blocks: int = 4096,
                rounds: int = 2048) -> list[dict[str, Any]]:
    """Microseconds of the daemon's bookkeeping per policy: `touch_chain` over a `chain`-block
    prompt looked up again by the same request (within `same_access_s`) and by a new one, and
    one publish into a full tier of `blocks` blocks (a victim chosen and removed, a block added;
    16-block chains, each touched once complete). Best of 5 runs each."""
    return [_cost(name, chain, blocks, rounds) for name in policies]


def _cost(name: str, chain: int, blocks: int, rounds: int) -> dict[str, Any]:
    now = [0.0]
    tier = TierPolicy(name, blocks + chain, name, lambda: now[0])
    keys = [hashlib.sha256(b"%d" % i).digest() for i in range(chain)]
    for key in keys:
        tier.add(key, 1)
    tier.touch_chain(keys)

    def best_us(step: Callable[[], object], n: int) -> float:
        best = math.inf
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(n):
                step()
            best = min(best, (time.perf_counter() - t) / n)
        return best * 1e6

    def new_request() -> None:
        now[0] += 3.0
        tier.touch_chain(keys)

    same = best_us(lambda: tier.touch_chain(keys), 50)
    new = best_us(new_request, 50)
    for key in keys:
        tier.remove(key)
    made = [0]

    def publish() -> None:  # 16 blocks
        ids = [hashlib.sha256(b"c%d" % (made[0] + j)).digest() for j in range(16)]
        made[0] += 16
        for key in ids:
            for v in tier.victims(1):
                tier.remove(v)
            tier.add(key, 1)
        tier.touch_chain(ids)
        now[0] += 0.5

    while len(tier) < blocks:
        publish()
    per_block = best_us(publish, rounds // 16) / 16
    return {"policy": name, "touch_512_same_request_us": same, "touch_512_new_request_us": new,
            "publish_one_block_us": per_block}


def plot(rows: list[dict[str, Any]], belady: list[dict[str, Any]], baseline: dict[str, float],
         ceiling: float, alt_label: str | None, out: Path,
         name: str = "simulate") -> list[Path]:
    """The three PNGs of docs/SCALE.md, NAME_hit_rates, NAME_ttft and NAME_belady."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: list[Path] = []
    routings = list(dict.fromkeys(r["routing"] for r in rows))
    colors = {"host": "#2b8cbe", "disk": "#7bccc4", "remote": "#fdae6b"}
    if len({r["machines"] for r in rows}) > 1:  # curves over machine counts
        fig, axes = plt.subplots(1, len(routings), figsize=(5.5 * len(routings), 4),
                                 sharey=True, squeeze=False)
        for ax, routing in zip(axes[0], routings, strict=True):
            rs = [r for r in rows if r["routing"] == routing]
            xs = [r["machines"] for r in rs]
            ax.stackplot(xs, *[[r[t] for r in rs] for t in TIER_NAMES], labels=TIER_NAMES,
                         colors=[colors[t] for t in TIER_NAMES], alpha=0.9)
            ax.axhline(ceiling, color="k", ls=":", lw=1, label="infinite cache")
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.set_title(f"{routing} routing")
            ax.set_xlabel("machines")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("fraction of prompt blocks served")
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=9)
        fig.suptitle("Hit rate per tier vs machines (stacked)")
        fig.tight_layout(rect=(0, 0.07, 1, 1))
        paths.append(out / f"{name}_hit_rates.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, stat in zip(axes, ("mean", "p99"), strict=True):
            for routing in routings:
                rs = [r for r in rows if r["routing"] == routing]
                xs = [r["machines"] for r in rs]
                (line,) = ax.plot(xs, [r[f"ttft_{stat}_s"] for r in rs], marker="o",
                                  label=f"{routing}")
                if alt_label:
                    ax.plot(xs, [r[f"ttft_{stat}_s@{alt_label}"] for r in rs], marker="x",
                            ls="--", color=line.get_color(), label=f"{routing}, {alt_label}")
            ax.axhline(baseline[stat], color="k", ls=":", lw=1, label="no cache")
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.set_xlabel("machines")
            ax.set_ylabel(f"{stat} TTFT estimate (s)")
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle("Estimated TTFT vs machines (idle engine, no queueing)")
        fig.tight_layout()
        paths.append(out / f"{name}_ttft.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)

    if belady:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        xs = [b["capacity_gib"] for b in belady]
        ax.plot(xs, [b["lru"] for b in belady], marker="o", label="LRU")
        for name in POLICIES:
            if name != "lru" and name in belady[0]:
                ax.plot(xs, [b[name] for b in belady], marker=".",
                        label=name + (" (default)" if name == DEFAULT_POLICY else ""))
        ax.plot(xs, [b["belady_admit_all"] for b in belady], marker="s",
                label="Belady, admit every block")
        ax.plot(xs, [b["belady"] for b in belady], marker="^", label="Belady MIN (bypass)")
        ax.plot(xs, [0.95 * b["belady"] for b in belady], ls="--", color="gray", lw=1,
                label="0.95 x Belady MIN")
        ax.axhline(ceiling, color="k", ls=":", lw=1, label="infinite cache")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.set_xlabel("capacity (GiB; one tier, one machine)")
        ax.set_ylabel("prefix hit rate (blocks)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title("Eviction policies vs Belady's optimal")
        fig.tight_layout()
        paths.append(out / f"{name}_belady.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def plot_routing(rows: list[dict[str, Any]], varied: Sequence[str], out: Path,
                 name: str = "simulate") -> list[Path]:
    """NAME_queue.png: TTFT p50 and p99 with queueing, for every row; and, where rows ran with
    churn, NAME_churn.png: the hit fraction along the trace, one panel per routing, each
    setting a line, churn events marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: list[Path] = []
    if not rows:
        return paths

    def label(r: dict[str, Any], keys: Sequence[str]) -> str:
        parts = []
        for k in keys:
            v = r[k]
            if k == "remote_gib":
                parts.append(f"remote {v:g} GiB")
            elif k == "spill_bound_s":
                parts.append("no spill" if v is None else f"spill > {v:g} s")
            elif k == "churn":
                parts.append("no churn" if v == "none" else v)
            else:
                parts.append(str(v))
        return ", ".join(parts)

    fig, axes = plt.subplots(1, 2, figsize=(12, 0.9 + 0.28 * len(rows)), sharey=True)
    names = [label(r, [*varied, "routing"]) + f", {r['machines']} machines" for r in rows]
    y = np.arange(len(rows))
    for ax, stat in zip(axes, ("p50", "p99"), strict=True):
        queued = np.asarray([r[f"ttft_q_{stat}_s"] for r in rows])
        ax.barh(y, queued, color="#2b8cbe", label="with queueing")
        ax.barh(y, [r[f"ttft_{stat}_s"] for r in rows], color="#fdae6b", height=0.4,
                label="idle engine")
        cap = 4 * float(np.median(queued))  # a queue that never drains would flatten the rest
        if queued.max() > cap:
            ax.set_xlim(0, cap)
            for i in np.flatnonzero(queued > cap):
                ax.annotate(f"{queued[i]:,.0f} s", (cap, float(y[i])), ha="right",
                            va="center", fontsize=8, color="white")
        ax.set_xlabel(f"{stat} TTFT estimate (s)")
        ax.grid(alpha=0.3, axis="x")
    axes[0].set_yticks(y, names, fontsize=8)
    axes[0].invert_yaxis()
    axes[1].legend(fontsize=8)
    fig.suptitle("TTFT with a FIFO queue per machine")
    fig.tight_layout()
    paths.append(out / f"{name}_queue.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    churned = [r for r in rows if r["churn"] != "none"]
    if churned:
        # The trace's own swings (0.1 to 0.6 from one window to the next) hide what churn
        # costs: plot each churn run against the same run without churn, where there is one.
        def key(r: dict[str, Any]) -> tuple[Any, ...]:
            return tuple(r[k] for k in ("routing", "machines", "remote_gib", "spill_bound_s"))

        calm = {key(r): r for r in rows if r["churn"] == "none"}
        delta = all(key(r) in calm for r in churned)
        routings = list(dict.fromkeys(r["routing"] for r in churned))
        fig, axes = plt.subplots(1, len(routings), figsize=(5.5 * len(routings), 4),
                                 sharey=True, squeeze=False)
        others = [k for k in varied if k != "routing"
                  and (k != "churn" or len({r["churn"] for r in churned}) > 1)]
        for ax, routing in zip(axes[0], routings, strict=True):
            for r in churned:
                if r["routing"] != routing:
                    continue
                hit = np.asarray(r["series"]["hit"])
                if delta:
                    hit = hit - np.asarray(calm[key(r)]["series"]["hit"])
                ax.plot(r["series"]["start"], hit, drawstyle="steps-post", marker=".",
                        label=(label(r, others) or r["churn"]) + f", {r['machines']} machines")
            for at, what in churn_marks([r["churn"] for r in churned]):
                ax.axvline(at, color="k", ls=":", lw=1)
                ax.annotate(what.split("@")[0], (at, 0.98), xycoords=("data", "axes fraction"),
                            fontsize=8, rotation=90, ha="right", va="top")
            ax.axhline(0, color="k", lw=0.5)
            ax.set_title(f"{routing} routing")
            ax.set_xlabel("fraction of the trace (requests)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="lower left")
        axes[0][0].set_ylabel("hit fraction, churn minus no churn" if delta
                              else "prompt blocks served from cache")
        fig.suptitle("Machines failing / leaving / joining: "
                     + "; ".join(dict.fromkeys(r["churn"] for r in churned)))
        fig.tight_layout()
        paths.append(out / f"{name}_churn.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    # common.py imports torch (seconds); only the CLI needs it, the library above does not.
    from benchmarks.common import RESULTS, table, write_results

    t0 = time.perf_counter()
    policies = policy_names(args.policies)
    if args.cost:
        names = list(dict.fromkeys(DEFAULT_POLICY if p == "default" else p for p in policies))
        cost = policy_cost(names)
        print(table(cost, list(cost[0])))
        return {"cost": cost}
    block_bytes = args.bytes_per_token * TRACE_BLOCK_TOKENS
    host = parse_capacity(args.host, block_bytes)
    disk = parse_capacity(args.disk, block_bytes)
    remotes = [parse_capacity(r, block_bytes) for r in args.remote.split(",") if r.strip()]
    remote = remotes[0]
    routings = [r.strip() for r in args.routing.split(",") if r.strip()]
    for r in routings:
        if r not in ROUTINGS:
            raise SystemExit(f"--routing: unknown routing {r!r} ({', '.join(ROUTINGS)})")
    churns = args.churn or ["none"]
    try:
        schedules = [parse_churn(c) for c in churns]
    except ValueError as e:
        raise SystemExit(f"--churn: {e}") from None
    for sched in schedules:  # each machine an event names must be in the cluster then
        ids, joined = set(range(min(args.machines))), min(args.machines)
        for ev in sched:
            if ev.kind == "join":
                ids.add(joined)
                joined += 1
            elif ev.machine in ids:
                ids.discard(ev.machine)
            else:
                raise SystemExit(f"--churn: {ev}: no machine {ev.machine} in a "
                                 f"{min(args.machines)}-machine cluster at that point")
        if not ids:
            raise SystemExit(f"--churn: {','.join(map(str, sched))} leaves no machine")
    for d in args.end_sessions:
        if not 0.0 <= d < math.inf:
            raise SystemExit(f"--end-sessions: {d:g} is not a delay in seconds (finite, >= 0)")
    requests = load_trace(args.trace, args.limit)
    if not requests:
        raise SystemExit(f"{args.trace}: no requests")
    n_blocks = sum(len(r.hash_ids) for r in requests)
    unique = len({h for r in requests for h in r.hash_ids[: r.full_blocks]})
    model = TTFTModel(args.bytes_per_token, TRACE_BLOCK_TOKENS, args.prefill_tps,
                      args.host_gbps, args.disk_gbps, args.remote_gbps)
    models = {"default": model}
    alt_label = None
    if args.remote_gbps_alt > 0:
        alt_label = f"remote {args.remote_gbps_alt:g} GB/s"
        models[alt_label] = TTFTModel(args.bytes_per_token, TRACE_BLOCK_TOKENS, args.prefill_tps,
                                      args.host_gbps, args.disk_gbps, args.remote_gbps_alt)
    ceiling = infinite_hit_rate(requests)
    cold = np.fromiter((model.ttft(b"", r.input_length) for r in requests), dtype=np.float64)
    baseline = ttft_stats(cold)
    print(f"trace: {args.trace} — {len(requests)} requests, {n_blocks} block accesses, "
          f"{unique} unique full blocks ({_gib(unique * block_bytes) / 1024:.1f} TiB at "
          f"{block_bytes / 2**20:g} MiB/block); infinite-cache prefix hit rate {ceiling:.3f}")
    print(f"capacities: host {_gib(host):g} GiB + disk {_gib(disk):g} GiB per machine, "
          f"remote {' or '.join(f'{_gib(r):g}' for r in remotes)} GiB shared, evicting with "
          f"{args.eviction}; loading beats recompute above {model.breakeven_gbps():.2f} GB/s")

    runs = len(grid(args.machines, routings, remotes, churns, args.spill_bound_s, args.kv_lag))
    with tqdm(total=runs * len(requests), desc="cluster sweep", unit="req",
              mininterval=0.5, smoothing=0.1) as bar:
        rows = sweep(requests, args.machines, routings, host, disk, remotes, block_bytes, models,
                     args.seed, args.affinity_blocks, bar, args.eviction, churns,
                     args.spill_bound_s, args.kv_lag, args.churn_window)
    replays = len({DEFAULT_POLICY if p == "default" else p for p in policies}) + 2
    with tqdm(total=replays * len(args.belady_capacities) * len(requests),
              desc="policies vs Belady", unit="req", mininterval=0.5) as bar:
        belady, compared = belady_compare(requests, args.belady_capacities, block_bytes, bar,
                                          policies)
    if args.end_sessions and args.belady_capacities:
        with tqdm(total=len(args.end_sessions) * (replays - 2) * len(args.belady_capacities)
                  * len(requests), desc="policies with end-session hints", unit="req",
                  mininterval=0.5) as bar:
            compared["end_sessions"] = end_session_compare(
                requests, args.belady_capacities, block_bytes, args.end_sessions, policies,
                compared["hit_rate"]["belady"], bar)

    varied = [c for c, values in (("remote_gib", remotes), ("churn", churns),
                                  ("spill_bound_s", args.spill_bound_s))
              if len(values) > 1 or values[0] not in (remote, "none", math.inf)]
    alt = f"@{alt_label}" if alt_label else None
    cols = [*varied, "routing", "machines", "host", "disk", "remote", "computed", "ttft_mean_s",
            "ttft_p50_s", "ttft_p99_s"]
    if alt:
        cols.append(f"ttft_mean_s{alt}")
    cols += ["max_util", "load_max_over_mean"]
    print()
    print(table(rows, cols))
    print(f"\nno cache: TTFT mean {baseline['mean']:.3f} s, p50 {baseline['p50']:.3f} s, "
          f"p99 {baseline['p99']:.3f} s")
    print("\nWith the queue (FIFO, one request at a time per machine; TTFT = wait + modeled "
          "TTFT):")
    print(table(rows, [*varied, "routing", "machines", "computed", "ttft_q_mean_s",
                       "ttft_q_p50_s", "ttft_q_p99_s", "wait_p99_s", "spilled",
                       "load_max_over_mean", "lost_in_flight"]))
    windows = [{**{c: r[c] for c in [*varied, "routing", "machines"]}, **w}
               for r in rows for w in r["windows"]]
    if windows:
        print(f"\nThe {args.churn_window:g} of the trace after each churn event:")
        print(table(windows, [*varied, "routing", "machines", "after", "host", "disk", "remote",
                              "computed", "ttft_q_mean_s", "ttft_q_p99_s"]))
    if belady:
        print("\nLRU vs Belady, one tier of one machine (prefix hit rate of all prompt blocks):")
        print(table(belady, ["capacity_blocks", "capacity_gib", "lru", "belady_admit_all",
                             "belady", "lru_over_belady_admit_all", "lru_over_belady"]))
        print(f"\nEviction policies, one tier (hit rate / over Belady MIN / over LRU; "
              f"default = {DEFAULT_POLICY}):")
        names = [p for p in compared["hit_rate"] if p not in ("belady", "belady_admit_all")]
        print(table([{"capacity_blocks": cap, **{
            p: f"{compared['hit_rate'][p][i]:.4f} / {compared['over_belady'][p][i]:.2f} / "
               f"{compared['over_lru'][p][i]:.2f}" for p in names},
            "belady": compared["hit_rate"]["belady"][i]}
            for i, cap in enumerate(compared["capacity_blocks"])],
            ["capacity_blocks", *names, "belady"]))
        unhinted = [f"{p}, no hint" for p in names if p not in ("lru", "default")]
        for key, hinted in compared.get("end_sessions", {}).items():
            rates = hinted["hit_rate"]
            print(f"\nThe same with a client saying each conversation ended {key} s after its "
                  f"last turn ({hinted['session_ends']} hints; hit rate / over Belady MIN / "
                  "over LRU; 'no hint' as in the table above):")
            print(table([{"capacity_blocks": cap, **{
                p: f"{rates[p][i]:.4f} / {hinted['over_belady'][p][i]:.2f} / "
                   f"{hinted['over_lru'][p][i]:.2f}" for p in names},
                **{u: f"{compared['hit_rate'][u.split(',')[0]][i]:.4f}" for u in unhinted},
                "belady": compared["hit_rate"]["belady"][i]}
                for i, cap in enumerate(compared["capacity_blocks"])],
                ["capacity_blocks", *names, *unhinted, "belady"]))
    runtime = time.perf_counter() - t0
    payload: dict[str, Any] = {
        "command": "python -m benchmarks.simulate " + shlex.join(
            sys.argv[1:] if argv is None else argv),
        "trace": {"path": str(args.trace), "requests": len(requests), "block_accesses": n_blocks,
                  "unique_full_blocks": unique, "infinite_cache_hit_rate": ceiling},
        "capacities_bytes": {"host_per_machine": host, "disk_per_machine": disk,
                             "remote_shared": remote, "remote_swept": remotes,
                             "block": block_bytes},
        "model": asdict(model), "breakeven_gbps": model.breakeven_gbps(),
        "remote_gbps_alt": args.remote_gbps_alt, "routing_seed": args.seed,
        "affinity_blocks": args.affinity_blocks,
        "eviction": args.eviction, "churn": churns, "churn_window": args.churn_window,
        "spill_bound_s": [_bound_json(b) for b in args.spill_bound_s], "kv_lag": args.kv_lag,
        "no_cache_ttft_s": baseline, "sweep": rows, "belady": belady, "policies": compared,
        "runtime_s": runtime,
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2))
        path = args.json
    else:
        path = write_results(args.name, payload)
    if not args.no_plots:
        # The per-machines figures show the first value of every other swept setting.
        first = {"remote_gib": _gib(remote), "churn": churns[0],
                 "spill_bound_s": _bound_json(args.spill_bound_s[0])}
        main_rows = [r for r in rows if all(r[k] == v for k, v in first.items())
                     and r["kv_lag"] in (None, args.kv_lag[0])]
        paths = plot(main_rows, belady, baseline, ceiling, alt_label, RESULTS, args.name)
        paths += plot_routing(rows, varied, RESULTS, args.name)
        for p in paths:
            print(f"wrote {p.relative_to(REPO) if p.is_relative_to(REPO) else p}")
    print(f"wrote {path} in {runtime:.0f} s")
    return payload


if __name__ == "__main__":
    main()
