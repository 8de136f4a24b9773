"""Routing in the trace simulator (benchmarks/simulate.py): the KV-event index and the
kv-aware routers, the per-machine queue and spilling, machines failing, leaving and joining."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from benchmarks.simulate import (
    DISK,
    DISK_MEDIUM,
    HOST,
    HOST_MEDIUM,
    REMOTE,
    AffinityRouter,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ChurnEvent,
    ClusterConfig,
    ClusterRouter,
    ClusterSim,
    EventBatch,
    KeyMaker,
    KVAwareRouter,
    KVIndex,
    RandomRouter,
    Request,
    TTFTModel,
    block_fractions,
    main,
    make_request,
    make_router,
    parse_churn,
    plot_routing,
)

MODEL = TTFTModel()


def cluster(router: ClusterRouter, machines: int, host: int = 100, disk: int = 0,
            remote: int = 0, spill_bound_s: float = float("inf"),
            eviction: str = "lru") -> ClusterSim:
    """Capacities in blocks: a block is one byte here (metadata only)."""
    return ClusterSim(ClusterConfig(machines, host, disk, remote, 1), router, eviction, MODEL,
                      spill_bound_s)


def kv(machines: int, lag: int = 0, load_weight: float = 0.0) -> KVAwareRouter:
    return KVAwareRouter(machines, MODEL, load_weight, lag)


def chats(n: int, seed: int = 0, gap_ms: int = 20_000,
          shared_root: bool = True) -> list[Request]:
    """Multi-turn chats, each turn extending its chat, `gap_ms` apart (far enough that queues
    are empty unless a test wants them); under one system-prompt block (id 0) shared by all,
    or each chat from its own first block."""
    rng = random.Random(seed)
    km = KeyMaker()
    convs: list[list[int]] = []
    next_id = 1
    out = []
    for i in range(n):
        if not convs or rng.random() < 0.25:
            convs.append([0] if shared_root else [])
        conv = rng.choice(convs)
        for _ in range(rng.randint(1, 3)):
            conv.append(next_id)
            next_id += 1
        out.append(make_request(conv, timestamp_ms=i * gap_ms, keys=km))
    return out


# ---------------------------------------------------------------- the index follows the events


def test_index_applies_vllm_shaped_events() -> None:
    index = KVIndex()
    a, b = b"a", b"b"
    index.publish([EventBatch(0, [BlockStored([a, b], HOST_MEDIUM)]),
                   EventBatch(1, [BlockStored([a], DISK_MEDIUM)])])
    assert index.holders(a) == {0: HOST_MEDIUM, 1: DISK_MEDIUM}
    assert index.prefixes([a, b], {0, 1}) == {0: bytes([HOST, HOST]), 1: bytes([DISK])}
    assert index.prefixes([a, b], {1}) == {1: bytes([DISK])}  # only the machines asked about
    index.publish([EventBatch(0, [BlockStored([a], DISK_MEDIUM), BlockRemoved([a], HOST_MEDIUM)])])
    assert index.holders(a) == {0: DISK_MEDIUM, 1: DISK_MEDIUM}  # demoted: still held
    assert index.prefixes([a, b], {0}) == {0: bytes([DISK, HOST])}
    index.publish([EventBatch(0, [AllBlocksCleared()])])
    assert index.holders(a) == {1: DISK_MEDIUM}
    assert index.holders(b) == {}
    assert len(index) == 1


def test_index_is_stale_for_exactly_the_lag() -> None:
    index = KVIndex(lag=3)
    index.publish([EventBatch(0, [BlockStored([b"k"], HOST_MEDIUM)])])
    for _ in range(3):
        assert index.holders(b"k") == {}  # 1, 2, 3 requests later: not yet
        index.publish([])
    assert index.holders(b"k") == {0: HOST_MEDIUM}


@pytest.mark.parametrize("eviction", ["lru", "prefix"])
def test_events_describe_every_tier_exactly(eviction: str) -> None:
    """Small tiers, so blocks are demoted, promoted and dropped all the time: an index fed only
    by the events still knows, at the end, exactly which machine holds which block where."""
    trace = chats(600, seed=1)
    sim = cluster(RandomRouter(3, seed=2), 3, host=12, disk=20, remote=30, eviction=eviction)
    seen = KVIndex()
    sim.subscribers.append(seen.publish)
    sim.run(trace)
    assert sim.result.evictions["disk"] > 100  # the tiers did churn
    assert sim.result.tier_blocks[DISK] > 0
    keys = {k for r in trace for k in r.keys}
    for key in keys:
        want = {}
        for i, m in enumerate(sim.machines):
            if key in m.host:
                want[i] = HOST_MEDIUM
            elif key in m.disk:
                want[i] = DISK_MEDIUM
        assert seen.holders(key) == want
    # vLLM batches a run of blocks into one event: fewer events than blocks named
    assert seen.events_applied < sim.result.block_events


# ---------------------------------------------------------------- kv-aware routing


def test_kv_aware_follows_the_prefix_where_affinity_does_not() -> None:
    km = KeyMaker()
    affinity = AffinityRouter(4)
    for conv in range(1, 100):
        router = kv(4)
        sim = cluster(router, 4)
        # Other conversations first (not under block 0), so machines differ in requests.
        for other in range(3):
            sim.process(make_request([1000 + other], timestamp_ms=other * 10_000, keys=km))
        first = make_request([0, conv, conv + 100], timestamp_ms=40_000, keys=km)
        sim.process(first)
        holder = sim.result.machine_of[-1]
        nxt = make_request([0, conv, conv + 100, conv + 200], timestamp_ms=80_000, keys=km)
        if affinity.route(nxt) != holder:
            break
    else:
        pytest.fail("affinity agreed with kv-aware on every conversation")
    assert holder == 3  # a new conversation went to the machine with the fewest requests
    served = sim.process(nxt)
    assert sim.result.machine_of[-1] == holder  # kv-aware: where the prefix is
    assert served == bytes([HOST] * 3)


def test_kv_aware_counts_host_above_disk() -> None:
    """A block's worth is what it saves in the TTFT model: 512 tokens from host save 31 ms of
    prefill at the defaults, from disk 12 ms."""
    router = kv(2)
    sim = cluster(router, 2)
    km = KeyMaker()
    router.observe([EventBatch(0, [BlockStored([km(i) for i in (1, 2, 3, 4)], DISK_MEDIUM)]),
                    EventBatch(1, [BlockStored([km(1), km(2)], HOST_MEDIUM)])])
    req = make_request([1, 2, 3, 4, 5], keys=km)
    assert list(router.choices(req, sim)) == [1, 0]  # 2 host blocks beat 4 disk blocks
    router.observe([EventBatch(1, [BlockRemoved([km(2)], HOST_MEDIUM)])])
    assert list(router.choices(req, sim)) == [0, 1]  # 4 disk blocks beat 1 host block


def test_kv_aware_router_is_stale_for_exactly_the_lag() -> None:
    lag = 3
    km = KeyMaker()
    nxt = make_request([1, 2, 3], timestamp_ms=10**6, keys=km)

    def start(router: KVAwareRouter) -> tuple[ClusterSim, int]:
        sim = cluster(router, 8)
        sim.process(make_request([999], timestamp_ms=0, keys=km))  # to machine 0
        sim.process(make_request([1, 2], timestamp_ms=10_000, keys=km))  # to machine 1
        return sim, sim.result.machine_of[-1]

    fresh = kv(8)
    sim, holder = start(fresh)
    assert holder == 1
    assert next(fresh.choices(nxt, sim)) == holder  # lag 0: it knows at once
    router = kv(8, lag=lag)
    sim, holder = start(router)
    for j in range(lag):
        # not heard of [1, 2] yet: the machine with the fewest requests, not the holder
        assert next(router.choices(nxt, sim)) == 2 + j, j
        sim.process(make_request([100 + j], timestamp_ms=20_000 * (j + 1), keys=km))
    assert next(router.choices(nxt, sim)) == holder


def test_pure_prefix_routing_piles_onto_one_machine_without_a_bound() -> None:
    """Every prompt starts with the shared block 0: the first machine to hold it is every
    request's longest prefix, and kv-aware never sends anything elsewhere. A spill bound, or
    kv-ttft's queue term, spreads the load."""
    trace = chats(300, seed=3, gap_ms=100)  # 10 requests/s: the machine queues
    machines = [cluster(kv(4), 4).run(trace).machine_of,
                cluster(kv(4), 4, spill_bound_s=0.5).run(trace).machine_of,
                cluster(kv(4, load_weight=1.0), 4).run(trace).machine_of]
    assert set(machines[0]) == {0}
    assert set(machines[1]) == {0, 1, 2, 3}
    assert set(machines[2]) == {0, 1, 2, 3}


# ---------------------------------------------------------------- the queue and spilling


def test_fifo_queue_adds_waiting_to_ttft() -> None:
    km = KeyMaker()
    sim = cluster(RandomRouter(1), 1)
    a = make_request([1, 2, 3, 4], timestamp_ms=0, keys=km)
    b = make_request([5, 6], timestamp_ms=0, keys=km)
    c = make_request([7], timestamp_ms=10**6, keys=km)
    for r in (a, b, c):
        sim.process(r)
    sa, sb, sc = (MODEL.ttft(b"", r.input_length) for r in (a, b, c))
    res = sim.result
    assert res.wait_s == [0.0, sa, 0.0]  # b waits for a; c arrives to an idle machine
    assert res.ttft_q_s == pytest.approx([sa, sa + sb, sc])


def test_spill_only_above_the_bound() -> None:
    km = KeyMaker()
    router = AffinityRouter(4)
    reqs = [make_request([0, 7, 100 + i], timestamp_ms=0, keys=km) for i in range(4)]
    home = router.route(reqs[0])
    assert {router.route(r) for r in reqs} == {home}  # one conversation: one home
    first = MODEL.ttft(b"", reqs[0].input_length)
    sim = cluster(AffinityRouter(4), 4, spill_bound_s=first)
    for r in reqs:
        sim.process(r)
    m = sim.result.machine_of
    # home has `first` seconds queued when the 2nd arrives: at the bound, not above, so it
    # stays; it has more when the 3rd arrives, which spills to the ring's next machine.
    assert m[:2] == [home, home]
    assert m[2] != home
    ring_next = list(router.choices(reqs[2], sim))[1]
    assert m[2] == ring_next
    assert sim.result.spilled == 2
    # no bound: nothing spills, and routing is exactly the plain router's
    unbounded = cluster(AffinityRouter(4), 4)
    unbounded.run(reqs)
    assert unbounded.result.machine_of == [home] * 4
    assert unbounded.result.spilled == 0


def test_every_machine_over_the_bound_takes_the_least_loaded() -> None:
    km = KeyMaker()
    sim = cluster(AffinityRouter(2), 2, spill_bound_s=0.0)
    sim.process(make_request(list(range(1, 40)), timestamp_ms=0, keys=km))  # a long prefill
    busy = sim.result.machine_of[0]
    sim.process(make_request([500], timestamp_ms=0, keys=km))
    assert sim.result.machine_of[1] == 1 - busy
    # both machines are now busy (over a bound of 0 s): the one with less work queued
    sim.process(make_request([600], timestamp_ms=0, keys=km))
    assert sim.result.machine_of[2] == 1 - busy


def test_random_routing_is_unchanged_without_a_bound() -> None:
    """The RNG draws as before: one `randrange` a request, unless it spills."""
    trace = chats(200, seed=4)
    old = random.Random(5)
    want = [old.randrange(4) for _ in trace]
    assert cluster(RandomRouter(4, seed=5), 4).run(trace).machine_of == want


# ---------------------------------------------------------------- churn


def test_parse_churn() -> None:
    assert parse_churn("fail:3@0.5,join@0.7,leave:1@0.8") == [
        ChurnEvent(0.5, "fail", 3), ChurnEvent(0.7, "join"), ChurnEvent(0.8, "leave", 1)]
    assert parse_churn("none") == parse_churn("") == []
    assert [str(e) for e in parse_churn("join@0.9,fail:0@0.1")] == ["fail:0@0.1", "join@0.9"]
    for bad in ("fail@0.5", "join:2@0.5", "crash:1@0.5", "fail:1@1.5", "fail:1"):
        with pytest.raises(ValueError, match="churn"):
            parse_churn(bad)


@pytest.mark.parametrize("routing", ["random", "affinity", "kv-aware", "kv-ttft"])
def test_routers_follow_the_machine_set(routing: str) -> None:
    trace = chats(400, seed=6, shared_root=False)
    sim = cluster(make_router(routing, 4, model=MODEL), 4, remote=1000)
    seen = KVIndex()
    sim.subscribers.append(seen.publish)
    sim.run(trace, churn=parse_churn("fail:1@0.25,leave:2@0.5,join@0.75"))
    where = sim.result.machine_of
    assert 1 in where[:100] and 2 in where[100:200]
    assert set(where[100:]) <= {0, 2, 3, 4}  # 1 failed at request 100
    assert set(where[200:]) <= {0, 3, 4}  # 2 left at request 200
    assert 4 in where[300:]  # a new machine joined at request 300 and was used
    assert [e["kind"] for e in sim.result.churn_log] == ["fail", "leave", "join"]
    for i in (1, 2):
        assert not sim.machines[i].alive
        assert len(sim.machines[i].host) == len(sim.machines[i].disk) == 0  # lost
    # the AllBlocksCleared events told every subscriber
    keys = {k for r in trace for k in r.keys}
    assert not any(set(seen.holders(k)) & {1, 2} for k in keys)


def test_failing_loses_its_queue_and_leaving_drains_it() -> None:
    km = KeyMaker()
    for kind, lost in (("fail", 3), ("leave", 0)):
        sim = cluster(RandomRouter(1), 2)
        for i in range(3):  # all at t=0 on machine 0: one in prefill, two waiting
            sim.process(make_request([10 * i + 1, 10 * i + 2], timestamp_ms=0, keys=km))
        sim.now = 0.001
        getattr(sim, kind)(0)
        assert sim.result.lost_in_flight == lost
        with pytest.raises(ValueError, match="not in the cluster"):
            sim.fail(0)


def test_after_a_failure_kv_aware_finds_the_prefix_in_the_remote() -> None:
    km = KeyMaker()
    for remote, want in ((100, bytes([REMOTE] * 3)), (0, b"")):
        router = kv(4)
        sim = cluster(router, 4, remote=remote)
        sim.process(make_request([1, 2, 3], keys=km))
        holder = sim.result.machine_of[-1]
        sim.fail(holder)
        assert router.index.prefixes([km(1)], {0, 1, 2, 3}) == {}  # its blocks are forgotten
        served = sim.process(make_request([1, 2, 3, 4], timestamp_ms=60_000, keys=km))
        assert sim.result.machine_of[-1] != holder
        assert served == want


@pytest.mark.parametrize("routing", ["affinity", "kv-aware"])
def test_the_remote_tier_keeps_hits_after_a_failure(routing: str) -> None:
    trace = chats(2000, seed=7, shared_root=False)
    churn = parse_churn("fail:0@0.5,fail:1@0.5")
    lo, hi = 1000, 1200
    after = {}
    for remote in (0, 10_000):
        sim = cluster(make_router(routing, 4, model=MODEL), 4, host=400, remote=remote)
        res = sim.run(trace, churn=churn)
        after[remote] = block_fractions(res, trace, lo, hi)
    assert after[0]["remote"] == 0.0
    # the conversations of the two lost machines find their prefixes in the remote tier
    assert after[10_000]["computed"] < after[0]["computed"] - 0.05, after
    assert after[10_000]["remote"] > 0.05


def test_kv_aware_keeps_conversations_where_they_are_when_a_machine_joins() -> None:
    """Affinity re-homes ~1/N of the conversations onto the new, empty machine; kv-aware sends a
    continuing conversation where its prefix is, and only new ones to the newcomer."""
    trace = chats(2000, seed=8, shared_root=False)
    local = {}
    for routing in ("affinity", "kv-aware"):
        sim = cluster(make_router(routing, 4, model=MODEL), 4, host=2000, remote=10_000,
                      spill_bound_s=float("inf"))
        res = sim.run(trace, churn=parse_churn("join@0.5"))
        frac = block_fractions(res, trace, 1000, 1300)
        local[routing] = frac
        assert 4 in res.machine_of[1000:]
    assert local["kv-aware"]["remote"] < local["affinity"]["remote"]
    assert local["kv-aware"]["host"] > local["affinity"]["host"]


# ---------------------------------------------------------------- the command line


def test_routing_command(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    with trace.open("w") as f:
        for r in chats(400, seed=9, gap_ms=2_000):
            f.write(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                "output_length": 10, "hash_ids": list(r.hash_ids)}) + "\n")
    out = tmp_path / "out.json"
    main(["--trace", str(trace), "--machines", "4", "--routing", "affinity,kv-aware,kv-ttft",
          "--remote", "1000blocks,0", "--churn", "none", "--churn", "fail:1@0.5,join@0.7",
          "--spill-bound-s", "2", "--kv-lag", "0,10", "--host", "50blocks", "--disk", "0",
          "--belady-capacities", "", "--no-plots", "--json", str(out)])
    got = json.loads(out.read_text())
    rows = got["sweep"]
    # 2 remotes x 2 churns x (affinity + 2 kv routings x 2 lags)
    assert len(rows) == 2 * 2 * 5
    assert {r["routing"] for r in rows} == {"affinity", "kv-aware", "kv-aware lag 10",
                                            "kv-ttft", "kv-ttft lag 10"}
    for r in rows:
        assert r["spill_bound_s"] == 2.0
        assert [w["after"] for w in r["windows"]] == ["fail:1@0.5", "join@0.7"]
        assert r["ttft_q_p99_s"] >= r["ttft_p99_s"] - 1e-9  # queueing only adds
        assert len(r["series"]["hit"]) == 40
        if r["churn"] == "none":
            assert r["churn_log"] == []
        else:
            assert [e["kind"] for e in r["churn_log"]] == ["fail", "join"]
        if r["remote_gib"] == 0:
            assert r["remote"] == 0.0
    # the figures: TTFT with queueing, and each churn run against the same run without
    paths = plot_routing(rows, ["remote_gib", "churn"], tmp_path, "t")
    assert [p.name for p in paths] == ["t_queue.png", "t_churn.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)
    with pytest.raises(SystemExit, match="no machine 7"):
        main(["--trace", str(trace), "--machines", "4", "--churn", "fail:7@0.5",
              "--belady-capacities", "", "--no-plots", "--json", str(out)])
