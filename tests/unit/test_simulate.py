"""The trace simulator (benchmarks/simulate.py) on tiny synthetic traces: seconds, no files."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from benchmarks.simulate import (
    DISK,
    FETCH_WINDOW_BYTES,
    HOST,
    REMOTE,
    AffinityRouter,
    ClusterConfig,
    ClusterSim,
    KeyMaker,
    RandomRouter,
    Request,
    Router,
    TTFTModel,
    belady_hit_rate,
    infinite_hit_rate,
    load_trace,
    lru_hit_rate,
    main,
    make_request,
    next_uses,
    parse_capacity,
    policy_hit_rate,
    policy_names,
    session_ends,
)
from benchmarks.workloads import agent, docqa
from kvstore.eviction import DEFAULT_POLICY, POLICIES, PrefixPolicy
from kvstore.tiering import TierPolicy

BLOCK = 1  # metadata only: capacities in blocks when a block is one byte


class FixedRouter:
    """Sends request i to machines[i]: tests choose where each request lands."""

    def __init__(self, machines: list[int]) -> None:
        self._it = iter(machines)

    def route(self, request: Request) -> int:
        return next(self._it)


def sim(machines: int = 1, host: int = 100, disk: int = 0, remote: int = 0,
        router: Router | None = None) -> ClusterSim:
    cfg = ClusterConfig(machines, host * BLOCK, disk * BLOCK, remote * BLOCK, BLOCK)
    return ClusterSim(cfg, router or RandomRouter(machines))


def conversation_trace(n: int, seed: int = 0) -> list[Request]:
    """Multi-turn chats sharing a system-prompt block: each turn extends its chat's chain."""
    rng = random.Random(seed)
    km = KeyMaker()
    chats: list[list[int]] = []
    next_id = 1
    out = []
    for _ in range(n):
        if not chats or rng.random() < 0.3:
            chats.append([0])
        chat = rng.choice(chats)
        for _ in range(rng.randint(1, 4)):
            chat.append(next_id)
            next_id += 1
        out.append(make_request(chat, keys=km))
    return out


def test_same_request_twice_is_all_host_hits() -> None:
    s = sim(host=10)
    req = make_request([1, 2, 3, 4])
    assert s.process(req) == b""
    assert s.process(req) == bytes([HOST] * 4)
    res = s.result
    assert res.fractions() == {"host": 0.5, "disk": 0.0, "remote": 0.0, "computed": 0.5}


def test_zero_capacity_computes_everything() -> None:
    s = sim(machines=2, host=0, disk=0, remote=0)
    res = s.run(conversation_trace(50))
    assert res.fractions()["computed"] == 1.0
    assert all(served == b"" for served in res.served)
    assert lru_hit_rate(conversation_trace(50), 0) == 0.0
    assert belady_hit_rate(conversation_trace(50), 0) == 0.0


def test_prefix_stops_at_the_first_block_found_nowhere() -> None:
    s = sim(host=10)
    s.process(make_request([1, 2, 3]))
    assert s.process(make_request([1, 9, 3])) == bytes([HOST])  # block 3 past the hole: no hit


def test_partial_last_block_is_never_stored() -> None:
    s = sim(host=10)
    req = make_request([1, 2, 3], input_length=2 * 512 + 100)
    s.process(req)
    assert s.process(req) == bytes([HOST, HOST])
    assert s.result.tier_blocks[HOST] == 2
    assert s.result.total_blocks == 6


def test_host_victims_are_demoted_to_disk_and_promoted_back() -> None:
    s = sim(host=2, disk=10)
    a, b = make_request([1, 2]), make_request([3, 4])
    s.process(a)
    s.process(b)  # host holds 2 blocks: a's are demoted
    assert s.process(a) == bytes([DISK, DISK])
    assert s.process(a) == bytes([HOST, HOST])  # promoted on the previous hit
    assert s.process(b) == bytes([DISK, DISK])


def test_leaf_is_evicted_before_its_parent() -> None:
    s = sim(host=3)
    s.process(make_request([1, 2, 3]))
    s.process(make_request([7]))  # one victim: the leaf 3, not the root 1
    assert s.process(make_request([1, 2, 3])) == bytes([HOST, HOST])


def test_remote_tier_shares_blocks_across_machines() -> None:
    s = sim(machines=2, host=10, remote=10, router=FixedRouter([0, 1, 1]))
    req = make_request([1, 2, 3])
    s.process(req)  # machine 0 computes and writes through
    assert s.process(req) == bytes([REMOTE] * 3)  # machine 1 reads it from remote...
    assert s.process(req) == bytes([HOST] * 3)  # ...and promoted it into its host tier


def test_chain_longer_than_host_is_served_without_failing() -> None:
    s = sim(host=2, disk=0, remote=10)
    req = make_request([1, 2, 3, 4])
    s.process(req)
    # host keeps only what fits beside the request's own pinned blocks; remote has the rest
    served = s.process(req)
    assert len(served) == 4
    assert set(served) <= {HOST, REMOTE}


def test_affinity_routing_keeps_a_prefix_on_one_machine() -> None:
    router = AffinityRouter(16, prefix_blocks=2)
    km = KeyMaker()
    for head in range(40):
        machines = {router.route(make_request([0, head + 1, *tail], keys=km))
                    for tail in ([], [100], [101, 102], [103, 104, 105])}
        assert len(machines) == 1
    spread = {router.route(make_request([0, h], keys=km)) for h in range(1, 400)}
    assert len(spread) == 16  # different conversations still use every machine


def test_affinity_routing_is_consistent_when_a_machine_is_added() -> None:
    km = KeyMaker()
    reqs = [make_request([0, h], keys=km) for h in range(1, 2001)]
    eight, nine = AffinityRouter(8), AffinityRouter(9)
    before = [eight.route(r) for r in reqs]
    after = [nine.route(r) for r in reqs]
    moved = sum(b != a for b, a in zip(before, after, strict=True))
    assert moved < 0.25 * len(reqs)  # ~1/9 expected; a modulo hash would move ~8/9
    assert all(a == b or a == 8 for b, a in zip(before, after, strict=True))


def test_random_routing_spreads_requests() -> None:
    router = RandomRouter(4, seed=1)
    req = make_request([1])
    assert {router.route(req) for _ in range(200)} == {0, 1, 2, 3}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_belady_at_least_lru_on_random_traces(seed: int) -> None:
    trace = conversation_trace(400, seed)
    ceiling = infinite_hit_rate(trace)
    assert ceiling > 0.3
    for cap in (4, 16, 64, 256):
        lru = lru_hit_rate(trace, cap)
        opt = belady_hit_rate(trace, cap)
        assert opt >= lru - 1e-12, (cap, lru, opt)
        assert opt <= ceiling + 1e-12
        assert belady_hit_rate(trace, cap, bypass=False) <= opt + 1e-12
    big = 10**6
    assert lru_hit_rate(trace, big) == pytest.approx(ceiling)
    assert belady_hit_rate(trace, big) == pytest.approx(ceiling)


def test_belady_keeps_the_block_needed_soonest() -> None:
    km = KeyMaker()
    trace = [make_request(ids, keys=km) for ids in ([1], [2], [1], [2], [1])]
    # One slot. MIN keeps 1 (needed sooner than 2) and never admits 2: two hits.
    assert belady_hit_rate(trace, 1) == pytest.approx(2 / 5)
    # Admitting every block, each miss evicts the other one: no hits, like LRU.
    assert belady_hit_rate(trace, 1, bypass=False) == 0.0
    assert lru_hit_rate(trace, 1) == 0.0


def test_next_uses() -> None:
    km = KeyMaker()
    nxt, never = next_uses([make_request(ids, keys=km) for ids in ([1, 2], [1], [2])])
    assert never == 4
    assert nxt == [2, 3, never, never]


def test_ttft_model() -> None:
    m = TTFTModel(bytes_per_token=131072, block_tokens=512, prefill_tokens_per_s=10_000,
                  host_gbps=25, disk_gbps=3, remote_gbps=1)
    n = 4 * 512
    cold = m.ttft(b"", n)
    assert cold == pytest.approx(n / 10_000)
    assert m.ttft(bytes([HOST] * 4), n) < m.ttft(bytes([DISK] * 4), n) < cold
    # remote at 1 GB/s is slower than recomputing (1.31 GB/s break-even): the plan skips it
    assert m.breakeven_gbps() == pytest.approx(1.31072)
    assert m.ttft(bytes([REMOTE] * 4), n) == pytest.approx(cold)
    # a fast prefix is still used when a slow block follows it
    assert m.ttft(bytes([HOST, REMOTE]), n) < cold
    # the last token is always computed
    assert m.ttft(bytes([HOST] * 4), n) > 1 / 10_000


def test_parse_capacity() -> None:
    assert parse_capacity("2048blocks", 64 << 20) == 2048 * (64 << 20)
    assert parse_capacity("128GiB", 64 << 20) == 128 << 30
    assert parse_capacity("0", 64 << 20) == 0


# ---------------------------------------------------------------- eviction policies


def test_the_simulator_runs_the_daemons_policy_objects() -> None:
    s = ClusterSim(ClusterConfig(2, 10, 10, 10, BLOCK), RandomRouter(2), "s3fifo")
    for m in s.machines:
        for tier in (m.host, m.disk):
            assert isinstance(tier, TierPolicy)
            assert type(tier.eviction) is POLICIES["s3fifo"]
    assert type(s.remote.eviction) is POLICIES["lru"]  # Redis: approximate LRU


def test_policies_see_trace_time() -> None:
    """Every call made for a request happens at its arrival: a request 1 ms after another is
    another request (a reuse), one at the same instant is not."""
    km = KeyMaker()
    s = sim(host=10)
    s.machines[0].placement.levels[0].policy = TierPolicy("h", 10, "prefix", lambda: s.now)
    pol = s.machines[0].host.eviction
    assert isinstance(pol, PrefixPolicy)
    s.process(make_request([1, 2], timestamp_ms=0, keys=km))
    assert pol.blocks[km(1)].cls == pol.NEW
    s.process(make_request([1, 2], timestamp_ms=60_000, keys=km))
    assert pol.blocks[km(1)].cls == pol.ONCE


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_replays(policy: str) -> None:
    trace = conversation_trace(300, seed=3)
    rate = policy_hit_rate(trace, 32, policy)
    assert 0.0 < rate <= infinite_hit_rate(trace) + 1e-12
    assert policy_hit_rate(trace, 10**6, policy) == pytest.approx(infinite_hit_rate(trace))


def test_policy_names() -> None:
    assert policy_names("arc,default") == ["lru", "arc", "default"]
    assert policy_names("lru,lru") == ["lru"]
    with pytest.raises(SystemExit, match="unknown policy 'mru'"):
        policy_names("mru")


def test_contract_command(tmp_path: Path) -> None:
    """The command line of issue 15 on a Mooncake-format trace: the "policies" section."""
    trace = tmp_path / "t.jsonl"
    with trace.open("w") as f:
        for i, r in enumerate(conversation_trace(200, seed=4)):
            f.write(json.dumps({"timestamp": 1000 * i, "input_length": r.input_length + 100,
                                "output_length": 10, "hash_ids": [*r.hash_ids, 10**6 + i]})
                    + "\n")
    out = tmp_path / "out.json"
    main(["--trace", str(trace), "--policies", "lru,arc,s3fifo,default",
          "--belady-capacities", "8,64", "--machines", "1", "--no-plots", "--json", str(out)])
    got = json.loads(out.read_text())["policies"]
    assert got["default"] == DEFAULT_POLICY
    assert got["capacity_blocks"] == [8, 64]
    rates = got["hit_rate"]
    assert {"belady", "lru", "arc", "s3fifo", "default", DEFAULT_POLICY} <= set(rates)
    assert rates["default"] == rates[DEFAULT_POLICY]
    for name, values in rates.items():
        assert len(values) == 2 and all(0.0 <= v <= 1.0 for v in values), name
    assert rates["belady"][0] >= rates["lru"][0]
    assert rates["lru"][0] < rates["lru"][1]  # more room, more hits


def test_workloads_are_seeded_and_have_their_shape() -> None:
    qa = docqa(seed=1, requests=300)
    assert qa == docqa(seed=1, requests=300)
    assert qa != docqa(seed=2, requests=300)
    ag = agent(seed=1, requests=300)
    for lines in (qa, ag):
        times = [d["timestamp"] for d in lines]
        assert times == sorted(times)
        for d in lines:
            assert len(d["hash_ids"]) == -(-d["input_length"] // 512)
    # Q&A: every prompt starts with the system prompt; questions are short tails on long docs
    assert len({tuple(d["hash_ids"][:1]) for d in qa}) == 1
    tails = [d["input_length"] % 512 for d in qa]
    assert sum(d["input_length"] for d in qa) / len(qa) > 8_000
    assert len(set(tails)) > 1
    # agents: each step extends an earlier prompt, keeping every full block of it
    seen: set[tuple[int, ...]] = set()
    extended = 0
    for d in ag:
        full = tuple(d["hash_ids"][: d["input_length"] // 512])
        extended += any(full[:n] in seen for n in range(len(full) - 1, 8, -1))
        seen.update(full[:n] for n in range(1, len(full) + 1))
    assert extended > len(ag) // 2


def test_prompt_larger_than_host_is_promoted_up_to_its_share_as_the_daemon_does() -> None:
    # The daemon's fetch (`PromptShare`): a prompt whose cached blocks do not fit host keeps
    # its first blocks up to the capacity less two fetch windows and serves the rest from
    # scratch space; promoting it whole would evict its own blocks.
    blocks = 20
    s = ClusterSim(ClusterConfig(1, 8 * FETCH_WINDOW_BYTES, 64 * FETCH_WINDOW_BYTES, 0,
                                 FETCH_WINDOW_BYTES), RandomRouter(1))
    req = make_request(list(range(1, blocks + 1)))
    disk = s.machines[0].placement
    for key in req.keys[:blocks]:  # on disk only, as after a restart
        assert disk.place(1, key, FETCH_WINDOW_BYTES)
    before = s.result.unpromoted
    assert s.process(req) == bytes([DISK] * blocks)
    host = s.machines[0].host
    assert [k in host for k in req.keys[:blocks]] == [True] * 6 + [False] * 14  # 8 - 2 windows
    assert s.result.unpromoted - before == 14
    assert s.process(req) == bytes([HOST] * 6 + [DISK] * 14)  # the same share, no thrashing


# ---------------------------------------------------------------- end-of-conversation hints


def timed_chats(n: int, seed: int = 0) -> list[Request]:
    """Chats over time: a new one about every second (a shared system-prompt block, then 2-6
    blocks), 1-4 turns each (half end after one), the next turn 10-120 s later, 1-4 blocks
    longer."""
    rng = random.Random(seed)
    km = KeyMaker()
    ids = itertools.count(1)
    due: list[tuple[float, int, list[int], int]] = []  # (time, tie-break, chain, turns left)
    out: list[Request] = []
    t = 0.0
    while len(out) < n:
        t += rng.uniform(0.5, 1.5)
        while due and due[0][0] <= t and len(out) < n:
            at, tie, chain, left = heapq.heappop(due)
            chain = chain + [next(ids) for _ in range(rng.randint(1, 4))]
            out.append(make_request(chain, timestamp_ms=int(at * 1000), keys=km))
            if left > 1:
                heapq.heappush(due, (at + rng.uniform(10, 120), tie, chain, left - 1))
        if len(out) < n:
            chain = [0] + [next(ids) for _ in range(rng.randint(2, 6))]
            out.append(make_request(chain, timestamp_ms=int(t * 1000), keys=km))
            if (left := rng.choice([1, 1, 2, 3, 4])) > 1:
                heapq.heappush(due, (t + rng.uniform(10, 120), len(out), chain, left - 1))
    return out


def test_session_ends_are_the_last_turns() -> None:
    km = KeyMaker()

    def req(t_s: int, ids: list[int], length: int | None = None) -> Request:
        return make_request(ids, length, timestamp_ms=1000 * t_s, keys=km)

    trace = [
        req(0, [0, 1, 2]),  # 0: a one-turn conversation: its last turn
        req(1, [0, 3]),  # 1: B's first turn, continued by 2
        req(2, [0, 3, 4, 5]),  # 2: continued by 5, and branched from by 6
        req(3, [0, 7, 8]),  # 3: C's first turn
        req(4, [0, 7, 8, 9, 99], 4 * 512 + 10),  # 4: C's last turn (block 99 is partial)
        req(5, [0, 3, 4, 5, 6]),  # 5: B's last turn
        req(6, [0, 3, 4, 5, 10, 11]),  # 6: the branch from B's second turn: its last
        req(7, [0, 12], 512 + 100),  # 7: one full block, the shared one: never a last turn
        req(8, [0, 13, 14]),  # 8: repeated by 9, so not its last turn
        req(9, [0, 13, 14]),  # 9: ... the repeat is
        req(10, [0]),  # 10: the system prompt alone, nothing after it: still not a last turn
    ]
    assert session_ends(trace, 30.0) == [(30.0, 0), (34.0, 4), (35.0, 5), (36.0, 6), (39.0, 9)]
    assert session_ends(trace) == [(0.0, 0), (4.0, 4), (5.0, 5), (6.0, 6), (9.0, 9)]
    with pytest.raises(ValueError, match="delay_s"):
        session_ends(trace, -1.0)


class HintLog(ClusterSim):
    """Records each hint with the requests processed before it and the clock."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[tuple[int, float, int, tuple[bytes, ...]]] = []

    def end_session(self, machine: int, keys: Sequence[bytes]) -> int:
        self.log.append((len(self.result.served), self.now, machine, tuple(keys)))
        return super().end_session(machine, keys)


def test_hints_reach_the_machine_that_served_the_request_when_due() -> None:
    km = KeyMaker()
    trace = [make_request([0, 1, 2], 2 * 512 + 7, timestamp_ms=0, keys=km),  # ends, machine 1
             make_request([0, 5, 6], timestamp_ms=0, keys=km),  # ends at once: machine 0
             make_request([0, 8], timestamp_ms=30_000, keys=km),
             make_request([0, 9], timestamp_ms=61_000, keys=km)]
    s = HintLog(ClusterConfig(2, 100, 100, 0, BLOCK), FixedRouter([1, 0, 0, 1]), "prefix")
    hints = [(60.0, 0), (0.0, 1)]
    res = s.run(trace, hints=hints)
    # The one due at 0 s waits until its request was processed; the other goes before the
    # first request arriving at or after 60 s; none is sent after the last request.
    assert s.log == [(2, 0.0, 0, tuple(km(h) for h in (0, 5, 6))),
                     (3, 60.0, 1, (km(0), km(1)))]
    assert res.session_ends == 2
    # Each marks its conversation's blocks on that machine's tiers (all on host): the root
    # too, as each machine held one conversation then; the later use of the root cancels its
    # mark, and the rest is evicted first, leaf first.
    assert res.ended_blocks == 3 + 2
    assert next(s.machines[1].host.eviction_order()) == km(1)
    assert list(s.machines[0].host.eviction_order())[:2] == [km(6), km(5)]


def test_hints_raise_prefixs_hit_rate_and_never_lower_it() -> None:
    trace = timed_chats(600)
    raised = []
    for cap in (32, 64, 128, 256):
        plain = policy_hit_rate(trace, cap, "prefix")
        for delay in (0.0, 10.0):
            hinted = policy_hit_rate(trace, cap, "prefix", hints=session_ends(trace, delay))
            assert hinted >= plain, (cap, delay)
            raised.append(hinted / plain)
    assert max(raised) > 1.3  # 0.16 -> 0.22 at 128 blocks, hints at once


@pytest.mark.parametrize("policy", ["lru", "arc", "s3fifo"])
def test_other_policies_ignore_hints(policy: str) -> None:
    trace = timed_chats(400, seed=1)
    hints = session_ends(trace)
    assert len(hints) > 100
    cfg = ClusterConfig(1, 64, 0, 0, BLOCK)
    plain = ClusterSim(cfg, RandomRouter(1), policy).run(trace)
    hinted = ClusterSim(cfg, RandomRouter(1), policy).run(trace, hints=hints)
    assert hinted.session_ends == len(hints) - 1  # the last request's comes after the trace
    assert hinted.ended_blocks == 0
    assert hinted.served == plain.served
    assert 0.0 < policy_hit_rate(trace, 64, policy) == policy_hit_rate(trace, 64, policy,
                                                                        hints=hints)


def test_end_sessions_option(tmp_path: Path) -> None:
    """--end-sessions adds "end_sessions" to the "policies" section and keeps the rest."""
    trace = tmp_path / "t.jsonl"
    with trace.open("w") as f:
        for r in timed_chats(300, seed=2):
            f.write(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                "output_length": 10, "hash_ids": list(r.hash_ids)}) + "\n")
    out = tmp_path / "out.json"
    main(["--trace", str(trace), "--policies", "lru,default", "--belady-capacities", "32,128",
          "--machines", "1", "--no-plots", "--json", str(out), "--end-sessions", "0,60"])
    got = json.loads(out.read_text())["policies"]
    assert got["default"] == DEFAULT_POLICY and got["capacity_blocks"] == [32, 128]
    assert {"belady", "belady_admit_all", "lru", "default", DEFAULT_POLICY} <= set(
        got["hit_rate"])
    assert set(got["end_sessions"]) == {"0", "60"}
    for key, hinted in got["end_sessions"].items():
        assert hinted["delay_s"] == float(key)
        assert hinted["session_ends"] == len(session_ends(load_trace(trace)))
        rates = hinted["hit_rate"]
        assert set(rates) == {"lru", "default", DEFAULT_POLICY}
        assert rates["lru"] == got["hit_rate"]["lru"]  # LRU ignores the hint
        for i, b in enumerate(got["hit_rate"]["belady"]):
            assert hinted["over_belady"]["default"][i] == pytest.approx(rates["default"][i] / b)
            assert rates["default"][i] <= b + 1e-12
    assert got["end_sessions"]["0"]["hit_rate"]["default"][1] > got["hit_rate"]["default"][1]


def test_generated_workloads_name_their_shared_prefix() -> None:
    """`shared_tokens`: docqa's system prompt and document (the same for every question on a
    document), agent's system prompt and tools; never past the prompt."""
    qa = docqa(seed=0, requests=300)
    assert all(900 <= d["shared_tokens"] < d["input_length"] for d in qa)
    by_doc: dict[int, set[int]] = {}
    for d in qa:
        doc_block = d["hash_ids"][d["shared_tokens"] // 512 - 1]  # inside the document
        by_doc.setdefault(doc_block, set()).add(d["shared_tokens"])
    assert all(len(v) == 1 for v in by_doc.values()) and len(by_doc) > 10
    assert {d["shared_tokens"] for d in agent(seed=0, requests=300)} == {4000}


def test_hints_skip_the_shared_tokens_the_trace_names(tmp_path: Path) -> None:
    """A document read by several users (their questions shorter than a block): the stored
    chains are the document alone, so the daemon sees no branch in it. One reader's thread
    ends; without `shared_tokens` its hint marks the document and a third reader misses it."""
    km = KeyMaker()
    doc = list(range(100, 104))  # 4 blocks every reader shares
    lines = [
        make_request([*doc, 1], 4 * 512 + 100, 0, keys=km, shared_tokens=4 * 512),
        # two one-block prompts (never a conversation's end: one block is a system prompt)
        make_request([800], timestamp_ms=3000, keys=km),
        make_request([801], timestamp_ms=3000, keys=km),
        # a reader whose question is a full block (its own, 200), then its thread ends
        make_request([*doc, 200, 2], 5 * 512 + 50, 5000, keys=km, shared_tokens=4 * 512),
        # other work needs 3 blocks of the 7
        make_request([900, 901, 902], timestamp_ms=70_000, keys=km),
        make_request([*doc, 3], 4 * 512 + 100, 80_000, keys=km, shared_tokens=4 * 512),
    ]
    hints = session_ends(lines, 60.0)
    assert hints[0] == (65.0, 3)  # the only one due before the last request
    named = policy_hit_rate(lines, 7, "prefix", hints=hints)
    unnamed = policy_hit_rate([dataclasses.replace(r, shared_tokens=0) for r in lines], 7,
                              "prefix", hints=hints)
    plain = policy_hit_rate(lines, 7, "prefix")
    # The second and the last reader find the 4 document blocks, unless the hint marked them:
    # then the other work takes the thread's block and two of the document's.
    total = sum(len(r.hash_ids) for r in lines)
    assert named == plain == (4 + 4) / total
    assert unnamed == (4 + 2) / total
    # And the trace field round-trips through load_trace.
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps({"timestamp": r.timestamp_ms, "input_length":
                                          r.input_length, "hash_ids": list(r.hash_ids),
                                          "shared_tokens": r.shared_tokens}) for r in lines))
    assert [r.shared_tokens for r in load_trace(path)] == [2048, 0, 0, 2048, 0, 2048]
