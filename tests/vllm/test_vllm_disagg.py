"""Disaggregated prefill through kvstore (issue 17, item 2): a vLLM prefill instance
(`kv_role="kv_producer"`) and a decode instance (`kv_consumer`), real engines on the tiny random
Llama, first through one daemon, then through two daemons sharing a Redis remote tier.

vLLM's P/D flow, as its proxies run it: the request goes to the producer with one output token
(`Engine.prefill`), then to the consumer with the `kv_transfer_params` the producer returned.
The consumer's greedy tokens and top-5 log-probabilities must equal those of the same engine
computing the prompt itself (the single-instance reference: a consumer saves nothing, so its
own reference run leaves kvstore empty), and it must load every token but the last of a prompt
of whole blocks (vLLM's `num_cached_tokens`). Hostile cases: the producer is slow (the consumer
asks first and waits), died before saving anything, or died having saved only part of the
prompt: the consumer's answer is the reference's, computed from what it could load.

    .venv-vllm/bin/python -m pytest tests/vllm/test_vllm_disagg.py -m vllm    # 3 engine starts
"""

from __future__ import annotations

import importlib.util
import random
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run `bash scripts/setup_vllm.sh`",
                allow_module_level=True)

from benchmarks.vllm_disagg import PREFILL_RATE, PREFILLED, Engine
from kvstore.server.process import DaemonProcess
from tests import redis_servers
from tests.redis_servers import RedisServer
from tests.vllm.test_vllm_connector import (
    BLOCK,
    MAX_TOKENS,
    assert_same_generation,
    expected_cached,
    fetched_blocks,
)
from tests.vllm.vllm_runner import make_model

pytestmark = [pytest.mark.vllm, pytest.mark.integration]
WAIT_S = 5.0  # the consumers' kvstore.consumer_wait_s
SLOW_S = 1.0  # a slow producer starts this long after the consumer got the request
WAITED = re.compile(r"kvstore: request \S+ waited ([\d.]+) ms for its producer's blocks")


def prompts(seed: int) -> list[list[int]]:
    """Token-id prompts: one of whole blocks (the consumer computes only its last token), one
    ending inside a block (it computes the tokens past the last full block)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(n)] for n in (6 * BLOCK, 5 * BLOCK + 7)]


def published(batch: list[list[int]]) -> list[dict[str, Any]]:
    """What a producer says it published: each prompt's full blocks."""
    return [{PREFILLED: len(ids) // BLOCK * BLOCK} for ids in batch]


def without_rate(params: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A producer's `kv_transfer_params` less its prefill rate, which each must carry."""
    for x in params:
        assert isinstance(x.get(PREFILL_RATE), float) and x[PREFILL_RATE] > 0, params
    return [{k: v for k, v in x.items() if k != PREFILL_RATE} for x in params]


def stats(daemon: DaemonProcess) -> Any:
    from kvstore.client import KVClient
    from tests.conftest import small_layout

    with KVClient(daemon.target, small_layout()) as c:  # Stats ignores the layout
        s = c.stats()
    assert s is not None, "daemon did not answer Stats"
    return s


def new_lines(log: Path, seen: int) -> tuple[str, int]:
    lines = log.read_text().splitlines()
    return "\n".join(lines[seen:]), len(lines)


def reference(consumer: Engine, batch: list[list[int]]) -> dict[str, Any]:
    """The single instance's answer: the consumer computing the prompts itself, before any
    producer published them (it saves nothing, so kvstore stays without them)."""
    ref = consumer.generate(batch, MAX_TOKENS)
    assert ref["cached"] == [0] * len(batch), consumer.tail()
    for tokens in ref["tokens"]:  # "the same tokens" must mean something
        assert len(set(tokens)) > 2, f"the model repeats itself: {tokens}"
    consumer.reset()
    return ref


def check_decode(got: dict[str, Any], ref: dict[str, Any], batch: list[list[int]]) -> None:
    # Every full block loaded: a prompt of whole blocks computes only its last token.
    assert got["cached"] == [expected_cached(len(ids)) for ids in batch]
    assert got["cached"][0] == len(batch[0]) - 1
    assert_same_generation(got, ref)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("disagg") / "tiny-llama")


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if not redis_servers.available():
        pytest.skip(redis_servers.SKIP_REASON)
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.kill()


def start_daemon(root: Path, redis: RedisServer) -> DaemonProcess:
    return DaemonProcess(root, "--host-bytes", "64MiB", "--remote", redis.url).start()


@pytest.fixture(scope="module")
def daemon_a(tmp_path_factory: pytest.TempPathFactory,
             redis: RedisServer) -> Iterator[DaemonProcess]:
    d = start_daemon(tmp_path_factory.mktemp("kv-a"), redis)
    yield d
    d.kill()


@pytest.fixture(scope="module")
def producer(model_dir: Path, daemon_a: DaemonProcess,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    e = Engine(model_dir, daemon_a.target, "kv_producer",
               tmp_path_factory.mktemp("logs") / "producer.log")
    yield e
    e.close()


def start_consumer(model_dir: Path, daemon: DaemonProcess, log: Path) -> Engine:
    return Engine(model_dir, daemon.target, "kv_consumer", log,
                  extra={"kvstore.consumer_wait_s": WAIT_S})


def slow_producer(producer: Engine, consumer: Engine, batch: list[list[int]],
                  ) -> dict[str, Any]:
    """The consumer gets the request (with what the producer will publish) before the
    producer has prefilled it: it must wait for the blocks, then load them."""
    consumer.send(batch, MAX_TOKENS, published(batch))
    time.sleep(SLOW_S)
    p = producer.prefill(batch)
    assert without_rate(p["kv_transfer_params"]) == published(batch)
    return consumer.read()


def assert_waited(log: str, at_least_s: float) -> None:
    waits = [float(m.group(1)) / 1e3 for m in WAITED.finditer(log)]
    assert waits and max(waits) >= at_least_s, f"the consumer did not wait:\n{log}"


@pytest.fixture(scope="class")
def consumer_a(model_dir: Path, daemon_a: DaemonProcess,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    e = start_consumer(model_dir, daemon_a, tmp_path_factory.mktemp("logs") / "c-a.log")
    yield e
    e.close()


@pytest.fixture(scope="class")
def daemon_b(tmp_path_factory: pytest.TempPathFactory,
             redis: RedisServer) -> Iterator[DaemonProcess]:
    d = start_daemon(tmp_path_factory.mktemp("kv-b"), redis)
    yield d
    d.kill()


@pytest.fixture(scope="class")
def consumer_b(model_dir: Path, daemon_b: DaemonProcess,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    e = start_consumer(model_dir, daemon_b, tmp_path_factory.mktemp("logs") / "c-b.log")
    yield e
    e.close()


class TestOneDaemon:
    """Producer and consumer on the same daemon."""

    @pytest.fixture
    def consumer(self, consumer_a: Engine) -> Engine:
        return consumer_a

    @pytest.mark.timeout(600)
    def test_consumer_loads_the_prompt_and_decodes_like_one_instance(
            self, producer: Engine, consumer: Engine, daemon_a: DaemonProcess) -> None:
        batch = prompts(seed=1)
        stored = stats(daemon_a).stored_blocks
        ref = reference(consumer, batch)
        assert stats(daemon_a).stored_blocks == stored, "the consumer saved blocks"
        p = producer.prefill(batch)
        # The producer's answer comes once its blocks are committed, and says how many.
        assert without_rate(p["kv_transfer_params"]) == published(batch)
        assert stats(daemon_a).stored_blocks - stored == sum(len(i) // BLOCK for i in batch)
        served = stats(daemon_a).hit_blocks
        got = consumer.generate(batch, MAX_TOKENS, p["kv_transfer_params"])
        check_decode(got, ref, batch)
        assert stats(daemon_a).hit_blocks - served == sum(fetched_blocks(n)
                                                          for n in got["cached"])
        assert stats(daemon_a).stored_blocks - stored == sum(len(i) // BLOCK for i in batch), \
            "the consumer saved blocks"

    @pytest.mark.timeout(600)
    def test_slow_producer_consumer_waits_for_its_blocks(self, producer: Engine,
                                                         consumer: Engine) -> None:
        batch = prompts(seed=2)
        ref = reference(consumer, batch)
        assert consumer.log_path is not None
        _, seen = new_lines(consumer.log_path, 0)
        got = slow_producer(producer, consumer, batch)
        check_decode(got, ref, batch)
        assert_waited(new_lines(consumer.log_path, seen)[0], SLOW_S / 2)

    @pytest.mark.timeout(600)
    def test_dead_producer_consumer_recomputes_within_its_wait(self, producer: Engine,
                                                               consumer: Engine) -> None:
        """No block was published (the producer died before its save): the consumer waits
        `consumer_wait_s`, then computes the whole prompt itself."""
        batch = prompts(seed=3)
        ref = reference(consumer, batch)
        assert consumer.log_path is not None
        _, seen = new_lines(consumer.log_path, 0)
        began = time.monotonic()
        got = consumer.generate(batch, MAX_TOKENS, published(batch))
        took = time.monotonic() - began
        assert WAIT_S <= took < WAIT_S + 30, took
        assert got["cached"] == [0, 0]
        assert_same_generation(got, ref)
        log = new_lines(consumer.log_path, seen)[0]
        assert f"found 0 of the {6 * BLOCK} tokens its producer published" in log, log

    @pytest.mark.timeout(600)
    def test_a_dead_producers_rate_bounds_the_wait_by_the_recompute(
            self, producer: Engine, consumer: Engine) -> None:
        """As above, but the params carry the producer's prefill rate, which says the prompt
        recomputes in 0.4 s: the consumer gives up after that, not `consumer_wait_s`."""
        batch = prompts(seed=5)
        ref = reference(consumer, batch)
        assert consumer.log_path is not None
        _, seen = new_lines(consumer.log_path, 0)
        params = [{**x, PREFILL_RATE: x[PREFILLED] / 0.4} for x in published(batch)]
        began = time.monotonic()
        got = consumer.generate(batch, MAX_TOKENS, params)
        took = time.monotonic() - began
        assert 0.4 <= took < WAIT_S, took
        assert got["cached"] == [0, 0]
        assert_same_generation(got, ref)
        log = new_lines(consumer.log_path, seen)[0]
        assert f"recomputing {6 * BLOCK} tokens at the producer's" in log, log

    @pytest.mark.timeout(600)
    def test_producer_died_mid_save_consumer_loads_what_arrived(
            self, producer: Engine, consumer: Engine) -> None:
        """Only the first blocks of the prompt were published (what a producer that died
        while saving leaves): the consumer loads them and computes the rest."""
        batch = prompts(seed=4)[:1]
        ref = reference(consumer, batch)
        part = 3 * BLOCK
        p = producer.prefill([batch[0][:part]])
        assert without_rate(p["kv_transfer_params"]) == [{PREFILLED: part}]
        got = consumer.generate(batch, MAX_TOKENS, published(batch))
        assert got["cached"] == [part]
        assert_same_generation(got, ref)


class TestTwoDaemons:
    """The producer on daemon A, the consumer on daemon B: A writes through to redis, B reads
    through from it (and waits for what the write-through has not delivered yet)."""

    @pytest.fixture
    def consumer(self, consumer_b: Engine) -> Engine:
        return consumer_b

    @pytest.mark.timeout(600)
    def test_consumer_on_another_daemon_loads_through_redis(
            self, producer: Engine, consumer: Engine, daemon_b: DaemonProcess) -> None:
        batch = prompts(seed=11)
        ref = reference(consumer, batch)
        before = stats(daemon_b)
        p = producer.prefill(batch)
        assert without_rate(p["kv_transfer_params"]) == published(batch)
        got = consumer.generate(batch, MAX_TOKENS, p["kv_transfer_params"])
        check_decode(got, ref, batch)
        after = stats(daemon_b)
        # Daemon B never had these blocks locally: every one came from redis.
        assert after.remote.lookup_hits - before.remote.lookup_hits >= sum(
            len(i) // BLOCK for i in batch)
        # The consumer's lookups asked B to read them into host ahead of its fetch.
        assert after.prefetches > before.prefetches
        assert after.hit_blocks - before.hit_blocks == sum(fetched_blocks(n)
                                                           for n in got["cached"])

    @pytest.mark.timeout(600)
    def test_slow_producer_across_daemons(self, producer: Engine, consumer: Engine) -> None:
        batch = prompts(seed=12)
        ref = reference(consumer, batch)
        assert consumer.log_path is not None
        _, seen = new_lines(consumer.log_path, 0)
        got = slow_producer(producer, consumer, batch)
        check_decode(got, ref, batch)
        assert_waited(new_lines(consumer.log_path, seen)[0], SLOW_S / 2)

    @pytest.mark.timeout(600)
    def test_redis_down_consumer_recomputes(self, producer: Engine, consumer: Engine,
                                            redis: RedisServer) -> None:
        """The remote tier is gone after the producer's daemon committed (its write-through
        never arrives): the consumer waits, then computes the prompt itself. Runs last: it
        kills redis."""
        batch = prompts(seed=13)
        ref = reference(consumer, batch)
        redis.kill()
        p = producer.prefill(batch)
        assert without_rate(p["kv_transfer_params"]) == published(batch)
        began = time.monotonic()
        got = consumer.generate(batch, MAX_TOKENS, p["kv_transfer_params"])
        assert time.monotonic() - began < WAIT_S + 30
        assert got["cached"] == [0, 0]
        assert_same_generation(got, ref)


PEER_TOKEN = "peer-token-0123456789abcdef"


@pytest.fixture(scope="class")
def peer_daemons(tmp_path_factory: pytest.TempPathFactory,
                 ) -> Iterator[tuple[DaemonProcess, DaemonProcess, str]]:
    """Two daemons and no remote tier: the producer's listens on TCP as well (its
    `peer_target`); the consumer's can only get the prompt from there."""
    port = redis_servers.free_port()
    p = DaemonProcess(tmp_path_factory.mktemp("kv-p"), "--host-bytes", "64MiB",
                      "--listen", f"127.0.0.1:{port}", "--token", PEER_TOKEN).start()
    c = DaemonProcess(tmp_path_factory.mktemp("kv-c"), "--host-bytes", "64MiB").start()
    yield p, c, f"127.0.0.1:{port}"
    p.kill()
    c.kill()


@pytest.fixture(scope="class")
def peer_engines(model_dir: Path, peer_daemons: tuple[DaemonProcess, DaemonProcess, str],
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine]]:
    p, c, address = peer_daemons
    logs = tmp_path_factory.mktemp("logs")
    producer = Engine(model_dir, p.target, "kv_producer", logs / "peer-producer.log",
                      extra={"kvstore.peer_target": address})
    try:
        consumer = Engine(model_dir, c.target, "kv_consumer", logs / "peer-consumer.log",
                          extra={"kvstore.consumer_wait_s": WAIT_S, "kvstore.peers": address,
                                 "kvstore.peer_token": PEER_TOKEN})
    except BaseException:
        producer.close()
        raise
    yield producer, consumer
    consumer.close()
    producer.close()


class TestPeer:
    """The producer's daemon serves its consumer directly (`kvstore.peer_target` and
    `kvstore.peers`): no remote tier, no wait for a write-through."""

    @pytest.mark.timeout(600)
    def test_consumer_loads_from_the_producers_daemon_without_waiting(
            self, peer_engines: tuple[Engine, Engine],
            peer_daemons: tuple[DaemonProcess, DaemonProcess, str]) -> None:
        producer, consumer = peer_engines
        p_daemon, c_daemon, address = peer_daemons
        batch = prompts(seed=21)
        ref = reference(consumer, batch)
        assert consumer.log_path is not None
        _, seen = new_lines(consumer.log_path, 0)
        p = producer.prefill(batch)
        assert without_rate(p["kv_transfer_params"]) == [{**x, "kvstore_peer": address}
                                                         for x in published(batch)]
        served, own = stats(p_daemon).hit_blocks, stats(c_daemon).hit_blocks
        got = consumer.generate(batch, MAX_TOKENS, p["kv_transfer_params"])
        check_decode(got, ref, batch)
        # Every block came from the producer's daemon; the consumer's own had none.
        assert stats(p_daemon).hit_blocks - served == sum(fetched_blocks(n)
                                                          for n in got["cached"])
        assert stats(c_daemon).hit_blocks == own
        assert not WAITED.search(new_lines(consumer.log_path, seen)[0])

    @pytest.mark.timeout(600)
    def test_a_peer_the_consumer_does_not_list_is_ignored(
            self, peer_engines: tuple[Engine, Engine],
            peer_daemons: tuple[DaemonProcess, DaemonProcess, str]) -> None:
        """`kv_transfer_params` come with the request: an address the operator did not list
        could serve forged K/V. The consumer ignores it (warns), waits, and computes."""
        producer, consumer = peer_engines
        p_daemon, _, address = peer_daemons
        batch = prompts(seed=22)[:1]
        ref = reference(consumer, batch)
        producer.prefill(batch)  # the blocks are on the producer's daemon
        assert consumer.log_path is not None
        _, seen = new_lines(consumer.log_path, 0)
        served = stats(p_daemon).hit_blocks
        forged = [{**published(batch)[0], "kvstore_peer": p_daemon.target}]  # not listed
        got = consumer.generate(batch, MAX_TOKENS, forged)
        assert got["cached"] == [0]
        assert_same_generation(got, ref)
        assert stats(p_daemon).hit_blocks == served
        log = new_lines(consumer.log_path, seen)[0]
        assert "not in kvstore.peers" in log and address in log, log

    @pytest.mark.timeout(600)
    def test_the_producers_daemon_down_consumer_recomputes(
            self, peer_engines: tuple[Engine, Engine],
            peer_daemons: tuple[DaemonProcess, DaemonProcess, str]) -> None:
        """The producer's daemon died after answering: the consumer's lookups there miss, it
        waits `consumer_wait_s` and computes the prompt. Runs last: it kills that daemon."""
        producer, consumer = peer_engines
        p_daemon = peer_daemons[0]
        batch = prompts(seed=23)[:1]
        ref = reference(consumer, batch)
        p = producer.prefill(batch)
        p_daemon.kill()
        began = time.monotonic()
        got = consumer.generate(batch, MAX_TOKENS, p["kv_transfer_params"])
        assert time.monotonic() - began < WAIT_S + 30
        assert got["cached"] == [0]
        assert_same_generation(got, ref)
