"""KV events end to end: a real daemon process publishing on a real ZMQ PUB socket, a real SUB
socket decoding the msgpack batches (vLLM's wire format, decoded here without vLLM: the
vLLM-marked test decodes them with vLLM's own classes)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

import msgspec
import pytest
import zmq

from kvstore.client import KVClient
from kvstore.engine_blocks import spans_for, vllm_block_hashes
from kvstore.server.kv_events import (
    END_SEQ,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)
from tests.conftest import random_kv, small_layout

pytestmark = pytest.mark.integration

ENGINE_BLOCK = 16
LAYOUT = small_layout(block_tokens=64)  # 32 KiB blocks, 4 engine blocks each


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Subscriber:
    """A SUB socket that decodes batches as plain msgpack (maps tagged by `type`)."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.seqs: list[int] = []
        self.events: list[dict[str, Any]] = []

    def drain(self, until: Any, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Receive until `until(events)` holds; returns every event seen so far."""
        end = time.monotonic() + timeout
        while not until(self.events) and time.monotonic() < end:
            if self.sub.poll(100):
                _topic, seq, payload = self.sub.recv_multipart()
                self.seqs.append(int.from_bytes(seq, "big"))
                batch = msgspec.msgpack.decode(payload)
                assert isinstance(batch[0], float)  # (ts, events[, dp rank]): array-like
                self.events.extend(batch[1])
        return self.events

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


def hashes_in(events: list[dict[str, Any]], kind: str, medium: str) -> set[bytes]:
    return {h for e in events if e["type"] == kind and e.get("medium") == medium
            for h in e["block_hashes"]}


def wait_connected(sub: Subscriber, c: KVClient) -> None:
    """PUB drops what it sends before a subscriber's connection is up (ZMQ's slow joiner):
    publish a described probe block until its event arrives."""
    probe = [7] * 64
    spans = spans_for(probe, vllm_block_hashes(probe, ENGINE_BLOCK), ENGINE_BLOCK, 64)
    c.publish(probe, random_kv(LAYOUT, 64))
    end = time.monotonic() + 10
    while time.monotonic() < end:
        c.describe_blocks(probe, spans)  # re-described after a clear: emitted again
        if sub.drain(lambda ev: ev, timeout=0.3):
            return
        c.clear()
        c.publish(probe, random_kv(LAYOUT, 64))
    raise AssertionError("no KV events reached the subscriber")


@pytest.fixture
def events_daemon(daemon_factory) -> tuple[Any, str, str]:
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    d = daemon_factory("--host-bytes", "128KiB", "--disk-bytes", "4MiB", "--kv-events", pub,
                       "--kv-events-replay", replay).start()
    return d, pub, replay


def test_events_name_engine_blocks_per_tier(events_daemon):
    d, pub, replay = events_daemon
    sub = Subscriber(pub)
    try:
        with KVClient(d.target, LAYOUT) as c:
            wait_connected(sub, c)
            c.clear(all_namespaces=True)
            sub.drain(lambda ev: any(e["type"] == "AllBlocksCleared" for e in ev))
            sub.events.clear()

            prompt = list(range(1000, 1000 + 4 * 64 + 5))  # 4 kvstore blocks and a partial
            engine = vllm_block_hashes(prompt, ENGINE_BLOCK)
            assert len(engine) == 16
            spans = spans_for(prompt, engine, ENGINE_BLOCK, 64)
            # Described before it is published: kept pending, announced at commit.
            assert c.describe_blocks(prompt, spans[:2]) == 2
            assert c.publish(prompt, random_kv(LAYOUT, len(prompt))) == 256
            # Described after: announced at once for the tier holding it.
            assert c.describe_blocks(prompt, spans) == 4
            events = sub.drain(lambda ev: hashes_in(ev, "BlockStored", "CPU") >= set(engine))
            assert hashes_in(events, "BlockStored", "CPU") == set(engine)
            first = next(e for e in events if e["type"] == "BlockStored"
                         and e["block_hashes"][0] == engine[0])
            assert first["block_hashes"] == engine[:4]
            assert first["token_ids"] == prompt[:64]
            assert first["block_size"] == ENGINE_BLOCK
            assert "parent_block_hash" in first and first["parent_block_hash"] is None
            assert "group_idx" not in first  # one group: nothing said of it, as vLLM's own
            second = next(e for e in events if e["type"] == "BlockStored"
                          and e["block_hashes"][0] == engine[4])
            assert second["parent_block_hash"] == engine[3]

            # Another prompt's 4 blocks fill the 4-block host tier: the first goes to disk.
            other = list(range(5000, 5000 + 4 * 64))
            c.publish(other, random_kv(LAYOUT, len(other)))
            events = sub.drain(lambda ev: hashes_in(ev, "BlockStored", "STORAGE") >= set(engine))
            assert hashes_in(events, "BlockRemoved", "CPU") >= set(engine)
            assert hashes_in(events, "BlockStored", "STORAGE") == set(engine)

            # A fetch promotes them back: stored in CPU again (and still on disk).
            sub.events.clear()
            assert c.fetch(prompt)[0] == 256
            events = sub.drain(lambda ev: hashes_in(ev, "BlockStored", "CPU") >= set(engine))
            assert hashes_in(events, "BlockStored", "CPU") == set(engine)
            assert not hashes_in(events, "BlockRemoved", "STORAGE") & set(engine)

            c.clear(all_namespaces=True)
            events = sub.drain(lambda ev: any(e["type"] == "AllBlocksCleared" for e in ev))
            assert events[-1] == {"type": "AllBlocksCleared"}
            assert sub.seqs == sorted(sub.seqs)

            stats = c.stats()
            assert stats is not None and stats.kv_events_published >= len(sub.seqs)
            assert stats.kv_events_dropped == 0

        # The replay socket sends every buffered batch from a sequence number, then -1.
        # vLLM's subscribers ask with a DEALER (or REQ) socket: (empty, start seq).
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(replay)
        dealer.send_multipart((b"", sub.seqs[0].to_bytes(8, "big")))
        replayed: list[int] = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                assert topic == payload == b""
                break
            assert msgspec.msgpack.decode(payload)[1]  # the batch as first sent
            replayed.append(int.from_bytes(seq, "big"))
        dealer.close(linger=0)
        ctx.term()
        assert replayed[: len(sub.seqs)] == sub.seqs
    finally:
        sub.close()


def test_a_block_two_namespaces_hold_is_removed_when_the_last_copy_goes(events_daemon):
    """Two namespaces (tenants sharing a system prompt, two models with one tokenizer) hold
    blocks of the same engine hashes. One clearing its own must not tell routers the pod
    lost blocks the other still holds: before, every copy leaving sent BlockRemoved."""
    d, pub, _ = events_daemon
    sub = Subscriber(pub)
    prompt = list(range(3000, 3000 + 64))
    engine = vllm_block_hashes(prompt, ENGINE_BLOCK)
    spans = spans_for(prompt, engine, ENGINE_BLOCK, 64)
    other_layout = small_layout(block_tokens=64, model="another-model")
    try:
        with KVClient(d.target, LAYOUT) as a, KVClient(d.target, other_layout) as b:
            wait_connected(sub, a)
            a.clear(all_namespaces=True)
            sub.drain(lambda ev: any(e["type"] == "AllBlocksCleared" for e in ev))
            sub.events.clear()
            for c, layout in ((a, LAYOUT), (b, other_layout)):
                assert c.publish(prompt, random_kv(layout, 64)) == 64
                assert c.describe_blocks(prompt, spans) == 1
            sub.drain(lambda ev: sum(e["type"] == "BlockStored" for e in ev) >= 2)
            sub.events.clear()
            assert a.clear() == 1  # a's copy only
            assert b.lookup(prompt) == 64
            b.publish(list(range(9000, 9064)), random_kv(other_layout, 64))  # a later batch
            b.describe_blocks(list(range(9000, 9064)), spans_for(
                list(range(9000, 9064)), vllm_block_hashes(list(range(9000, 9064)),
                                                           ENGINE_BLOCK), ENGINE_BLOCK, 64))
            events = sub.drain(lambda ev: any(e["type"] == "BlockStored" for e in ev))
            assert any(e["type"] == "BlockStored" for e in events)  # ordered after the clear
            assert not hashes_in(events, "BlockRemoved", "CPU") & set(engine)
            assert b.clear() == 2  # the last copy goes: now it is removed
            events = sub.drain(lambda ev: hashes_in(ev, "BlockRemoved", "CPU") >= set(engine))
            assert hashes_in(events, "BlockRemoved", "CPU") >= set(engine)
    finally:
        sub.close()


def test_a_hybrid_groups_blocks_carry_its_group_in_every_event(events_daemon):
    """A block described as one KV-cache group's of a hybrid model (as the vLLM connector
    describes Gemma-shaped models: `group_idx`, kind, window) is announced with them, in CPU
    and on disk, after a restart too (the description kept on disk), and removed with its
    `group_idx`, as vLLM's own events for that group."""
    d, pub, _ = events_daemon
    prompt = list(range(300, 300 + 2 * 64))
    engine = vllm_block_hashes(prompt, ENGINE_BLOCK)
    spans = spans_for(prompt, engine, ENGINE_BLOCK, 64, group_idx=1,
                      spec_kind="sliding_window", sliding_window=512)
    group = {"group_idx": 1, "kv_cache_spec_kind": "sliding_window",
             "kv_cache_spec_sliding_window": 512}

    def of_group(events: list[dict[str, Any]], kind: str, medium: str) -> list[dict[str, Any]]:
        return [e for e in events if e["type"] == kind and e.get("medium") == medium
                and set(e["block_hashes"]) <= set(engine)]

    sub = Subscriber(pub)
    try:
        with KVClient(d.target, LAYOUT) as c:
            wait_connected(sub, c)
            sub.events.clear()
            assert c.publish(prompt, random_kv(LAYOUT, len(prompt))) == 128
            assert c.describe_blocks(prompt, spans) == 2
            events = sub.drain(lambda ev: len(of_group(ev, "BlockStored", "CPU")) == 2)
            stored = of_group(events, "BlockStored", "CPU")
            assert [e["block_hashes"] for e in stored] == [engine[:4], engine[4:]]
            assert all({k: e.get(k) for k in group} == group for e in stored), stored
        assert d.stop() == 0  # SIGTERM: the shutdown flush writes both blocks to disk
        d.start()
        sub.close()
        sub = Subscriber(pub)
        with KVClient(d.target, LAYOUT) as c:
            time.sleep(0.5)  # the subscriber's connection (slow joiner)
            assert c.fetch(prompt)[0] == 128  # promoted from disk: announced in CPU again
            events = sub.drain(lambda ev: len(of_group(ev, "BlockStored", "CPU")) == 2)
            stored = of_group(events, "BlockStored", "CPU")
            assert len(stored) == 2
            assert all({k: e.get(k) for k in group} == group for e in stored), stored
            c.clear()  # this namespace: removals one by one, each naming the group
            events = sub.drain(lambda ev: len(of_group(ev, "BlockRemoved", "STORAGE")) == 2)
            removed = of_group(events, "BlockRemoved", "STORAGE") + of_group(
                events, "BlockRemoved", "CPU")
            assert len(removed) == 4 and all(e.get("group_idx") == 1 for e in removed)
    finally:
        sub.close()


def test_disk_block_descriptions_survive_a_restart(events_daemon):
    """A disk block's description is persisted: after a restart, promoting and removing it
    still name the engine blocks it holds."""
    d, pub, _ = events_daemon
    prompt = list(range(200, 200 + 64))
    engine = vllm_block_hashes(prompt, ENGINE_BLOCK)
    with KVClient(d.target, LAYOUT) as c:
        c.publish(prompt, random_kv(LAYOUT, 64))
        c.describe_blocks(prompt, spans_for(prompt, engine, ENGINE_BLOCK, 64))
    assert d.stop() == 0  # SIGTERM: the shutdown flush writes the host block to disk
    d.start()
    sub = Subscriber(pub)
    try:
        with KVClient(d.target, LAYOUT) as c:
            assert c.lookup(prompt) == 64
            end = time.monotonic() + 10
            # The subscriber's connection may be late (slow joiner): no event is sent before
            # the clear, so wait for the PUB side to see it, then clear.
            time.sleep(0.5)
            # Promoted from disk: announced in CPU under the description kept on disk.
            assert c.fetch(prompt)[0] == 64
            events = sub.drain(lambda ev: hashes_in(ev, "BlockStored", "CPU"),
                               timeout=max(1.0, end - time.monotonic()))
            assert hashes_in(events, "BlockStored", "CPU") == set(engine)
            c.clear()  # this namespace: removals one by one
            events = sub.drain(lambda ev: hashes_in(ev, "BlockRemoved", "STORAGE"),
                               timeout=max(1.0, end - time.monotonic()))
            assert hashes_in(events, "BlockRemoved", "STORAGE") == set(engine)
            assert hashes_in(events, "BlockRemoved", "CPU") == set(engine)
    finally:
        sub.close()


def test_a_subscriber_that_never_reads_never_blocks_the_publisher():
    """A real SUB socket that never reads: publishing returns at once, drops are counted."""
    port = free_port()
    publisher = ZmqEventPublisher(f"tcp://127.0.0.1:{port}", max_queue=64, hwm=16)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 16)
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        time.sleep(0.3)
        hashes = [bytes([i % 256]) * 32 for i in range(64)]
        event = BlockStored(block_hashes=hashes, parent_block_hash=None,
                            token_ids=list(range(1024)), block_size=16, lora_id=None,
                            medium="CPU", lora_name=None)
        n = 20_000
        began = time.perf_counter()
        accepted = sum(publisher.publish(KVEventBatch(ts=time.time(), events=[event]))
                       for _ in range(n))
        took = time.perf_counter() - began
        # The queue (64) filled: dropped, not waited for (PUB past its high-water mark may
        # drop some of those accepted too, counted as well).
        assert publisher.dropped >= n - accepted > 0
        # Not a timing test (see docs/PERFORMANCE.md): only "returns", well within any bound.
        assert took < 30
        removed = BlockRemoved(block_hashes=hashes, medium="CPU")
        assert publisher.publish(KVEventBatch(ts=time.time(), events=[removed])) in (True, False)
    finally:
        sub.close(linger=0)
        ctx.term()
        publisher.close(timeout_s=1.0)


def test_the_events_process_dying_costs_its_batches_and_nothing_else():
    """The sockets live in a process of their own: killed, its batches are dropped (counted),
    publishing still returns at once, and closing does not hang."""
    publisher = ZmqEventPublisher(f"tcp://127.0.0.1:{free_port()}")
    event = BlockRemoved(block_hashes=[b"x" * 32], medium="CPU")
    try:
        publisher._proc.kill()
        publisher._proc.join(10)
        for _ in range(5):
            assert publisher.publish(KVEventBatch(ts=time.time(), events=[event]))
        end = time.monotonic() + 10
        while publisher.dropped < 5:
            assert time.monotonic() < end, publisher.dropped
            time.sleep(0.05)
        assert publisher.published == 0
    finally:
        began = time.monotonic()
        publisher.close(timeout_s=1.0)
        assert time.monotonic() - began < 10


def test_closing_with_the_events_process_stopped_returns():
    """The sockets' process stopped (SIGSTOP) while the pipe to it is full: `close` (the
    daemon's drain, on its event loop) returns within its timeouts, the process killed."""
    publisher = ZmqEventPublisher(f"tcp://127.0.0.1:{free_port()}")
    os.kill(publisher._proc.pid, signal.SIGSTOP)
    try:
        event = BlockStored(block_hashes=[b"x" * 32] * 512, parent_block_hash=None,
                            token_ids=list(range(8192)), block_size=16, lora_id=None,
                            medium="CPU", lora_name=None)
        for _ in range(200):  # ~40 KB each: the pipe's buffer fills, the thread blocks
            publisher.publish(KVEventBatch(ts=time.time(), events=[event]))
        time.sleep(0.5)
        began = time.monotonic()
        publisher.close(timeout_s=1.0)
        assert time.monotonic() - began < 10
        assert not publisher._proc.is_alive()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(publisher._proc.pid, signal.SIGKILL)


def test_a_daemon_failing_to_start_after_its_events_process_exits(tmp_path):
    """Start-up fails after the KV events process is up (the metrics port is taken): the
    daemon exits with the error, and its events process with it."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = subprocess.run(
            [sys.executable, "-m", "kvstore.server", "--data-dir", str(tmp_path / "d"),
             "--host-bytes", "1MiB", "--disk-bytes", "1MiB", "--host-handover-s", "0",
             "--kv-events", "tcp://127.0.0.1:0",
             "--metrics-port", str(taken.getsockname()[1])],
            capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "Address already in use" in r.stderr, r.stderr[-2000:]


def kv_events_metrics(port: int) -> dict[str, float]:
    """The daemon's KV events counters on /metrics, by name."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(
        r"^(kvstore_kv_events_(?:published|dropped)_batches_total) (\S+)$", text, re.MULTILINE)}


def test_events_off_by_default_cost_no_call(daemon_factory):
    port = free_port()
    d = daemon_factory("--host-bytes", "8MiB", "--metrics-port", str(port)).start()
    prompt = list(range(64))
    spans = spans_for(prompt, vllm_block_hashes(prompt, ENGINE_BLOCK), ENGINE_BLOCK, 64)
    with KVClient(d.target, LAYOUT) as c:
        c.publish(prompt, random_kv(LAYOUT, 64))
        assert c.describe_blocks(prompt, spans) == 0  # Info says off: nothing sent
        stats = c.stats()
        assert stats is not None and stats.kv_events_published == 0
    # Exported at 0 while off, as Stats reports them.
    assert kv_events_metrics(port) == {"kvstore_kv_events_published_batches_total": 0.0,
                                       "kvstore_kv_events_dropped_batches_total": 0.0}


def test_metrics_count_published_and_dropped_batches(daemon_factory):
    """A one-batch queue (`--kv-events-queue 1`) and four clients publishing described
    prompts at once: the loop emits batches faster than the publisher thread takes them, so
    some are dropped; /metrics counts them as Stats does. No subscriber is needed: a PUB
    socket never waits for one, the queue is what overflows."""
    port = free_port()
    d = daemon_factory("--host-bytes", "2MiB", "--disk-bytes", "16MiB", "--kv-events",
                       f"tcp://127.0.0.1:{free_port()}", "--kv-events-queue", "1",
                       "--metrics-port", str(port)).start()
    kv = random_kv(LAYOUT, 4 * 64)

    def client(w: int, round_: int) -> None:
        with KVClient(d.target, LAYOUT) as c:
            for i in range(40):
                base = (round_ * 8 + w) * 100_000 + i * 1000
                p = list(range(base, base + 4 * 64))
                c.publish(p, kv)
                c.describe_blocks(p, spans_for(p, vllm_block_hashes(p, ENGINE_BLOCK),
                                               ENGINE_BLOCK, 64))

    end = time.monotonic() + 60
    round_ = 0
    # Drops depend on thread scheduling: ~15% of ~450 batches per round here; more rounds
    # on a machine where the publisher thread keeps up better.
    while kv_events_metrics(port)["kvstore_kv_events_dropped_batches_total"] == 0:
        assert time.monotonic() < end, "no KV event batch was dropped in 60 s"
        threads = [threading.Thread(target=client, args=(w, round_)) for w in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        round_ += 1
    time.sleep(0.5)  # the publisher thread sends what is left in its queue
    with KVClient(d.target, LAYOUT) as c:
        stats = c.stats()
    assert stats is not None
    got = kv_events_metrics(port)
    assert got["kvstore_kv_events_dropped_batches_total"] == stats.kv_events_dropped > 0
    assert got["kvstore_kv_events_published_batches_total"] == stats.kv_events_published > 0


def test_transformers_prefill_is_described_by_vllm_hashes(events_daemon):
    """A prompt prefilled through transformers (`CachedPrefill`) appears under vLLM's block
    hashes of its tokens (16-token engine blocks, 64-token kvstore blocks)."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    import torch

    from kvstore.client.integrations.hf import CachedPrefill, layout_for_model
    from tests.integration.test_hf import tiny_llama

    d, pub, _ = events_daemon
    model = tiny_llama(torch.float32)
    assert isinstance(model, transformers.PreTrainedModel)
    layout = layout_for_model(model, block_tokens=64)
    ids = torch.randint(0, 512, (1, 2 * 64 + 9), generator=torch.Generator().manual_seed(5))
    want = vllm_block_hashes(ids[0].tolist()[: 2 * 64], ENGINE_BLOCK)
    sub = Subscriber(pub)
    try:
        time.sleep(0.5)  # the SUB connection is up before the events are sent
        with KVClient(d.target, layout) as c:
            CachedPrefill(model, c, event_block_size=ENGINE_BLOCK).prefill(ids)
        events = sub.drain(lambda ev: hashes_in(ev, "BlockStored", "CPU") >= set(want))
        assert hashes_in(events, "BlockStored", "CPU") == set(want)
    finally:
        sub.close()
