"""Hostile-client soak (issue 13): honest clients check every byte they fetch while hostile
ones attack the daemon's leases and streams at the same time.

Hostile behaviours, each in its own thread, in a loop:
- `pauser`: a Publish stream that sends half of an honest prompt's block, pauses past
  `lease_timeout_s`, then sends garbage for the rest (were its slot handed on meanwhile, the
  garbage would land in someone else's block);
- `abandoner`: streaming Fetches read for one chunk and then dropped (cancelled), or never read;
- `silent`: Publish streams that open and send nothing more;
- `liar`: Commit with fetch lease ids, Commit/Release of made-up ids, SHM leases never released;
- `tcp_forger`: a tenant over TCP that reserves and commits without sending bytes.
Honest clients (Unix socket zero-copy, Unix socket streaming, a TCP tenant) publish and fetch
prompts whose KV follows from their id; any fetched byte that differs is a wrong block.

Pass: 0 wrong blocks; afterwards no lease, pin or call left (within a few lease timeouts);
the daemon's anonymous memory grows less than `MEMORY_BOUND_MIB` over the run (its arena is
shared memory, counted apart). `make test` runs it for a few seconds; `make soak` for KV_SOAK_S.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
import torch

from kvstore import KVLayout
from kvstore.client import KVClient
from kvstore.proto import kvstore_pb2 as pb
from tests.conftest import random_kv, same_bytes
from tests.reliability import (
    CapacityWatch,
    Worker,
    layout_pb,
    rss_bytes,
    soak_record,
    soak_seconds,
    stub,
    wait_quiescent,
)
from tests.security.test_tenants import ADMIN, TOKEN_A, _free_port, _tokens_file

pytestmark = [pytest.mark.integration, pytest.mark.fault]
LEASE_S = 1.0
MEMORY_BOUND_MIB = 256
# 128 KiB blocks, 8 per prompt: a prompt (1 MiB) is more than gRPC buffers in flight for a
# stream nobody reads, so unread streams really stall the daemon's writes.
LAYOUT = KVLayout(model="soak", num_layers=2, num_kv_heads=2, head_dim=64,
                  dtype=torch.float32, block_tokens=64)
PROMPTS = 24
BLOCKS = 8


def _prompt(p: int) -> list[int]:
    return [p * 10_000 + t for t in range(BLOCKS * LAYOUT.block_tokens)]


def test_hostile_soak_serves_no_wrong_block(daemon_factory, tmp_path):
    port = _free_port()
    tokens_file = _tokens_file(tmp_path, f"alpha {TOKEN_A}\n")
    # Host holds 12 of the 24 prompts' 192 blocks: constant demotion and promotion.
    d = daemon_factory("--host-bytes", f"{96 * LAYOUT.block_bytes}",
                       "--disk-bytes", f"{256 * LAYOUT.block_bytes}",
                       "--lease-timeout-s", str(LEASE_S), "--max-concurrent-rpcs", "64",
                       "--listen", f"127.0.0.1:{port}", "--token", ADMIN,
                       "--tenant-tokens-file", str(tokens_file)).start()
    tcp = f"127.0.0.1:{port}"
    values = {p: random_kv(LAYOUT, BLOCKS * LAYOUT.block_tokens, seed=p) for p in range(PROMPTS)}
    with KVClient(d.target, LAYOUT, deadline_s=10) as c:
        keys = {p: c.keys(_prompt(p)) for p in range(PROMPTS)}
        ns = c.namespace.digest()
    seconds = soak_seconds(6.0)
    stop = threading.Event()
    counts: Counter[str] = Counter()
    lock = threading.Lock()

    def count(what: str, n: int = 1) -> None:
        with lock:
            counts[what] += n

    def honest(seed: int, target: str, **kw: object) -> None:
        r = random.Random(seed)
        with KVClient(target, LAYOUT, deadline_s=5, **kw) as c:
            while not stop.is_set():
                p = r.randrange(PROMPTS)
                count("operations")
                if r.random() < 0.4:
                    c.publish(_prompt(p), values[p])
                    continue
                n, got = c.fetch(_prompt(p))
                if n:
                    count("hits")
                    if not same_bytes(got, values[p][:, :, :n]):
                        count("wrong")

    def pauser(seed: int) -> None:
        r = random.Random(seed)
        channel, raw = stub(d.target)
        half = LAYOUT.block_bytes // 2
        while not stop.is_set():
            p, i = r.randrange(PROMPTS), r.randrange(BLOCKS)
            key, start = keys[p][i], bytes(half)  # the first half is as good as any

            def stream(key: bytes = key, start: bytes = start) -> Iterator[pb.PublishChunk]:
                yield pb.PublishChunk(namespace=ns, layout=layout_pb(LAYOUT), keys=[key],
                                      block_index=0, chunk_offset=0, data=start)
                time.sleep(LEASE_S + 0.3)
                yield pb.PublishChunk(block_index=0, chunk_offset=half, data=b"\xee" * half)

            try:
                raw.Publish(stream(), timeout=30)
            except grpc.RpcError as e:
                count(f"pauser:{e.code().name}")
            count("faults")
        channel.close()

    def abandoner(seed: int) -> None:
        r = random.Random(seed)
        channel, raw = stub(d.target)
        while not stop.is_set():
            p = r.randrange(PROMPTS)
            call = raw.Fetch(pb.FetchRequest(namespace=ns, layout=layout_pb(LAYOUT),
                                             keys=keys[p], transfer=pb.TRANSFER_STREAM),
                             timeout=30)
            try:
                next(call)
                if r.random() < 0.5:
                    call.cancel()  # read one message, then walk away
                else:
                    stop.wait(LEASE_S * 1.5)  # never read: the daemon must end it
                    call.cancel()
            except (grpc.RpcError, StopIteration):
                pass
            count("faults")
        channel.close()

    def silent(_: int) -> None:
        channel, raw = stub(d.target)
        while not stop.is_set():
            quiet = threading.Event()

            def stream(done: threading.Event = quiet) -> Iterator[pb.PublishChunk]:
                yield pb.PublishChunk(namespace=ns, layout=layout_pb(LAYOUT), keys=keys[0])
                done.wait(LEASE_S * 3)

            try:
                raw.Publish(stream(), timeout=30)
            except grpc.RpcError as e:
                count(f"silent:{e.code().name}")
            quiet.set()
            count("faults")
        channel.close()

    def liar(seed: int) -> None:
        r = random.Random(seed)
        channel, raw = stub(d.target)
        while not stop.is_set():
            p = r.randrange(PROMPTS)
            try:
                head = next(iter(raw.Fetch(pb.FetchRequest(
                    namespace=ns, layout=layout_pb(LAYOUT), keys=keys[p],
                    transfer=pb.TRANSFER_SHM), timeout=5)))
                if head.lease_id:
                    try:
                        raw.Commit(pb.CommitRequest(lease_id=head.lease_id), timeout=5)
                        count("liar:commit_accepted")  # must never happen
                    except grpc.RpcError as e:
                        count(f"liar:{e.code().name}")
                    if r.random() < 0.5:  # else left to the reaper
                        raw.Release(pb.ReleaseRequest(lease_id=head.lease_id), timeout=5)
                for made_up in (r.getrandbits(63), r.getrandbits(63)):
                    raw.Release(pb.ReleaseRequest(lease_id=made_up), timeout=5)
                    try:
                        raw.Commit(pb.CommitRequest(lease_id=made_up), timeout=5)
                    except grpc.RpcError as e:
                        count(f"liar:{e.code().name}")
            except grpc.RpcError as e:
                count(f"liar:{e.code().name}")
            count("faults")
            stop.wait(0.02)
        channel.close()

    def tcp_forger(seed: int) -> None:
        r = random.Random(seed)
        channel = grpc.insecure_channel(tcp)
        from kvstore.proto import kvstore_pb2_grpc as pb_grpc

        raw = pb_grpc.KVStoreStub(channel)
        md = (("authorization", f"Bearer {TOKEN_A}"),)
        while not stop.is_set():
            p = r.randrange(PROMPTS)
            try:
                reply = raw.Reserve(pb.ReserveRequest(namespace=ns, layout=layout_pb(LAYOUT),
                                                      keys=keys[p]), metadata=md, timeout=5)
                raw.Commit(pb.CommitRequest(lease_id=reply.lease_id), metadata=md, timeout=5)
                count("forger:commit_accepted")  # must never happen
            except grpc.RpcError as e:
                count(f"forger:{e.code().name}")
            count("faults")
            stop.wait(0.05)
        channel.close()

    anon0 = rss_bytes(d.proc.pid)["RssAnon"]
    peak = anon0
    workers = [Worker(target=honest, args=(1, d.target), kwargs={"transfer": "shm"}),
               Worker(target=honest, args=(2, d.target), kwargs={"transfer": "stream"}),
               Worker(target=honest, args=(3, tcp), kwargs={"token": TOKEN_A}),
               *(Worker(target=f, args=(10 + i,)) for i, f in enumerate(
                   (pauser, pauser, abandoner, abandoner, silent, liar, tcp_forger)))]
    with CapacityWatch(d) as watch:
        for w in workers:
            w.start()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            peak = max(peak, rss_bytes(d.proc.pid)["RssAnon"])
            time.sleep(0.2)
        stop.set()
        for w in workers:
            w.result(60)
        watch.check()
    leaked = ""
    try:
        wait_quiescent(d.target, 4 * LEASE_S + 5)  # no lease, pin or call left behind
    except AssertionError as e:
        leaked = str(e)
    peak = max(peak, rss_bytes(d.proc.pid)["RssAnon"])
    growth_mib = (peak - anon0) / 2**20
    soak_record("hostile", operations=counts["operations"], faults=counts["faults"],
                wrong=counts["wrong"], hits=counts["hits"], leaked=int(bool(leaked)),
                anon_growth_mib=round(growth_mib, 1),
                **{k: v for k, v in sorted(counts.items()) if ":" in k})
    assert not leaked, leaked
    assert d.proc.poll() is None, "the daemon died"
    assert counts["wrong"] == 0, f"{counts['wrong']} wrong blocks served"
    assert counts["liar:commit_accepted"] == counts["forger:commit_accepted"] == 0
    assert counts["hits"] > 0 and counts["faults"] > 0, counts  # the soak did something
    assert growth_mib < MEMORY_BOUND_MIB, f"daemon memory grew {growth_mib:.0f} MiB"
    # And it still serves every honest prompt exactly, from whichever tier.
    with KVClient(d.target, LAYOUT, deadline_s=10) as c:
        for p in range(PROMPTS):
            n, got = c.fetch(_prompt(p))
            assert n == 0 or same_bytes(got, values[p][:, :, :n]), f"prompt {p}"
