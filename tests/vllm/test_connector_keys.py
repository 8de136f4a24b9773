"""The connector's scheduler side hashes a request's prompt once (issue 16, item 5): a request
looked up again converts and hashes nothing, an extended one only its new blocks, a changed one
all of it again; loads and saves carry the keys (no tokens) to the workers; a finished
request's keys are dropped.

Runs the scheduler-role connector in this process on fake requests (only the fields the
connector reads), against a real daemon.
"""

from __future__ import annotations

import importlib.util
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run `bash scripts/setup_vllm.sh`",
                allow_module_level=True)

from kvstore.client import KVClient
from kvstore.keys import chain_keys
from kvstore.server.process import DaemonProcess
from tests.conftest import random_kv
from tests.unit.test_key_chain import Counted
from tests.vllm.bench_connector_keys import request, scheduler_connector
from tests.vllm.vllm_runner import make_model

pytestmark = [pytest.mark.vllm, pytest.mark.integration]
BLOCK = 32


def step(req: SimpleNamespace, block_ids: list[int], computed: int) -> SimpleNamespace:
    """A `SchedulerOutput` that schedules `req`'s prompt from token `computed` on."""
    new = SimpleNamespace(req_id=req.request_id, block_ids=(block_ids,),
                          num_computed_tokens=computed, prompt_token_ids=req.prompt_token_ids)
    return SimpleNamespace(
        preempted_req_ids=set(), scheduled_new_reqs=[new],
        num_scheduled_tokens={req.request_id: len(req.prompt_token_ids) - computed},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                              new_block_ids=[], num_computed_tokens=[]))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("vllm") / "tiny-llama")


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path / "kvstore", "--host-bytes", "64MiB",
                      "--disk-bytes", "128MiB").start()
    yield d
    d.kill()


@pytest.mark.timeout(300)
def test_prompt_is_hashed_once_and_dropped_when_finished(model_dir: Path, daemon: DaemonProcess,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         ) -> None:
    conn = scheduler_connector(model_dir, daemon.target, BLOCK, 2048)
    try:
        rng = random.Random(0)
        tokens = [rng.randrange(3, 900) for _ in range(40 * BLOCK + 7)]
        req = request("r1", tokens)
        count = Counted(monkeypatch)
        assert conn.get_num_new_matched_tokens(req, 0) == (0, False)  # nothing stored yet
        assert count.take() == (len(tokens), 40)  # by the client's keys (its KeyCache)
        for _ in range(3):  # vLLM looks a waiting request up at every step
            assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
        assert count.take() == (0, 0)

        with KVClient(daemon.target, conn._layout, deadline_s=10) as c:  # the engine's namespace
            assert c.publish(tokens[: 30 * BLOCK], random_kv(conn._layout, 30 * BLOCK)) \
                == 30 * BLOCK
            want = chain_keys(c.namespace, tokens)
        count.take()
        assert conn.get_num_new_matched_tokens(req, 0) == (30 * BLOCK, False)
        blocks = list(range(41))
        conn.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (blocks,)),
                                      30 * BLOCK)
        meta = conn.build_connector_meta(step(req, blocks, 30 * BLOCK))
        assert count.take() == (0, 0)
        # The workers get keys, not tokens: the load's blocks, and all the prompt's to save.
        (load,), (save,) = meta.loads, meta.saves
        assert (load.start, load.end) == (0, 30 * BLOCK)
        assert list(load.keys.keys) == want[:30]
        assert list(save.keys.keys) == want and save.keys.num_tokens == 40 * BLOCK

        # Extended in place (a streaming session's next turn): only the new blocks.
        tokens.extend(rng.randrange(3, 900) for _ in range(2 * BLOCK))
        assert conn.get_num_new_matched_tokens(req, 0) == (30 * BLOCK, False)
        assert count.take() == (2 * BLOCK, 2)
        # Changed (resumed with other tokens): hashed anew, the hit ends at the change.
        changed = list(tokens)
        tokens[10 * BLOCK + 3] += 1
        assert conn.get_num_new_matched_tokens(req, 0) == (10 * BLOCK, False)
        assert count.take() == (len(tokens), 42)

        # Another request with a prompt seen before: converted, but its keys come from the
        # client's cache. One that only looked up (aborted while waiting) is dropped as well.
        other = request("r2", changed[: 40 * BLOCK + 7])
        assert conn.get_num_new_matched_tokens(other, 0) == (30 * BLOCK, False)
        assert count.take() == (40 * BLOCK + 7, 0)
        assert set(conn._chains) == {("r1", 0), ("r2", 0)}  # (request, KV-cache group)
        conn.request_finished(req, blocks)
        conn.request_finished(other, [])
        assert not conn._chains and not conn._requests and not conn._matched
    finally:
        conn.shutdown()


@pytest.mark.timeout(300)
def test_request_finished_sends_the_end_of_session_hint(model_dir: Path, daemon: DaemonProcess,
                                                        caplog: pytest.LogCaptureFixture,
                                                        ) -> None:
    """A finished request whose `kv_transfer_params` end its conversation, nothing left to
    save: the scheduler sends EndSession at once, past `kvstore_shared_tokens`; a malformed
    count is logged and no hint is sent (marking a shared prefix would cost other users)."""
    conn = scheduler_connector(model_dir, daemon.target, BLOCK, 2048)
    try:
        rng = random.Random(1)
        tokens = [rng.randrange(3, 900) for _ in range(8 * BLOCK + 5)]
        with KVClient(daemon.target, conn._layout, deadline_s=10) as c:
            assert c.publish(tokens, random_kv(conn._layout, len(tokens))) == 8 * BLOCK

            def ended(params: object) -> tuple[int, int]:
                req = request(f"r{rng.random()}", tokens)
                req.kv_transfer_params = params
                conn.request_finished(req, [])
                conn.shutdown()  # waits for the hint's thread
                stats = c.stats()
                assert stats is not None
                return int(stats.sessions_ended), int(stats.session_blocks_marked)

            assert ended(None) == (0, 0)
            assert ended({"kvstore_end_session": True, "kvstore_shared_tokens": "3"}) == (0, 0)
            assert "kvstore_shared_tokens must be an int" in caplog.text
            # Host only holds the blocks (disk is written at eviction or shutdown).
            assert ended({"kvstore_end_session": True, "kvstore_shared_tokens": 3 * BLOCK}) \
                == (1, 5)
    finally:
        conn.shutdown()


def empty_step(scheduled: int = 0) -> SimpleNamespace:
    """A `SchedulerOutput` with no request of the connector's: `scheduled` tokens of two
    others (decodes), or nothing at all."""
    return SimpleNamespace(
        preempted_req_ids=set(), scheduled_new_reqs=[], total_num_scheduled_tokens=scheduled,
        num_scheduled_tokens={"a": scheduled - scheduled // 2, "b": scheduled // 2}
        if scheduled else {},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                              new_block_ids=[], num_computed_tokens=[]))


@pytest.mark.timeout(300)
def test_a_step_that_computes_nothing_sleeps_while_a_consumer_waits(
        model_dir: Path, daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer waiting for its producer's blocks: a step that schedules nothing sleeps until
    its next lookup is due (at most the 20 ms lookup interval) instead of vLLM's engine loop
    spinning through empty steps; a step that computes something, or one with no consumer
    waiting, does not sleep."""
    import kvstore.client.integrations.vllm as connector_module

    conn = scheduler_connector(model_dir, daemon.target, BLOCK, 2048, role="kv_consumer")
    real_sleep = time.sleep
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        if threading.current_thread() is threading.main_thread():  # the scheduler's
            slept.append(seconds)
        real_sleep(seconds)

    try:
        rng = random.Random(2)
        tokens = [rng.randrange(3, 900) for _ in range(8 * BLOCK + 1)]
        req = request("c1", tokens)
        req.kv_transfer_params = {"kvstore_prefilled_tokens": 8 * BLOCK}
        assert conn.get_num_new_matched_tokens(req, 0) == (None, False)  # its producer's blocks
        monkeypatch.setattr(connector_module.time, "sleep", sleep)
        conn.build_connector_meta(empty_step())
        assert len(slept) == 1 and 0 < slept[0] <= connector_module._WAIT_LOOKUP_S, slept
        conn.build_connector_meta(empty_step(scheduled=6))  # others' decodes: no pause
        assert len(slept) == 1

        with KVClient(daemon.target, conn._layout, deadline_s=10) as c:  # the producer's save
            assert c.publish(tokens[: 8 * BLOCK], random_kv(conn._layout, 8 * BLOCK)) \
                == 8 * BLOCK
        real_sleep(connector_module._WAIT_LOOKUP_S)  # the next lookup is due
        assert conn.get_num_new_matched_tokens(req, 0) == (8 * BLOCK, False)
        assert not conn._waiting
        conn.build_connector_meta(empty_step())  # nobody waits: vLLM's loop idles by itself
        assert len(slept) == 1
    finally:
        conn.shutdown()


@pytest.mark.timeout(300)
def test_a_consumer_waits_no_longer_than_recomputing_at_the_producers_rate(
        model_dir: Path, daemon: DaemonProcess, caplog: pytest.LogCaptureFixture) -> None:
    """A consumer request whose producer sent its prefill rate waits for the missing tokens
    no longer than recomputing them at that rate takes; `consumer_wait_s` still caps it; a
    malformed rate is ignored (the default 2 s). And a producer sends the rate it measured
    from scheduling to its answer, only when it computed a block or more."""
    rng = random.Random(3)
    tokens = [rng.randrange(3, 900) for _ in range(8 * BLOCK + 1)]
    want = 8 * BLOCK

    def waits(conn: Any, rid: str, rate: object, after_s: float) -> bool:
        """Whether a request with `rate` still waits `after_s` after its first lookup."""
        req = request(rid, tokens)
        req.kv_transfer_params = {"kvstore_prefilled_tokens": want,
                                  "kvstore_prefill_tokens_per_s": rate}
        assert conn.get_num_new_matched_tokens(req, 0) == (None, False)
        time.sleep(after_s)
        got = conn.get_num_new_matched_tokens(req, 0)
        conn.request_finished(req, [])
        return got == (None, False)

    conn = scheduler_connector(model_dir, daemon.target, BLOCK, 2048, role="kv_consumer")
    try:
        assert waits(conn, "c1", want / 5.0, 0.3)  # recomputing takes 5 s: it waits
        assert not waits(conn, "c2", want / 0.2, 0.3)  # 0.2 s: it has given up
        assert f"recomputing {want} tokens at the producer's {want / 0.2:.0f} tokens/s" \
            in caplog.text
        for bad in ("fast", -1.0, 0, float("nan"), float("inf"), True, None):
            assert waits(conn, f"bad{bad}", bad, 0.3), bad  # no bound: 2 s
        assert not conn._waiting
    finally:
        conn.shutdown()
    conn = scheduler_connector(model_dir, daemon.target, BLOCK, 2048, role="kv_consumer",
                               extra={"kvstore.consumer_wait_s": 0.1})
    try:
        assert not waits(conn, "c3", want / 5.0, 0.3)  # the cap is below the recompute
        assert "kvstore.consumer_wait_s" in caplog.text
    finally:
        conn.shutdown()

    conn = scheduler_connector(model_dir, daemon.target, BLOCK, 2048, role="kv_producer")
    try:
        def produced(rid: str, computed: int, prefill_s: float) -> dict[str, Any]:
            """A producer's request whose first `len(tokens) - computed` tokens vLLM's own
            cache held, answered `prefill_s` after it was scheduled."""
            req = request(rid, tokens)
            assert conn.get_num_new_matched_tokens(req, len(tokens) - computed) == (0, False)
            blocks = list(range(9))
            conn.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (blocks,)),
                                          0)
            time.sleep(prefill_s)
            _, params = conn.request_finished(req, blocks)
            assert params is not None and params["kvstore_prefilled_tokens"] == want
            return params

        began = time.monotonic()
        rate = produced("p1", len(tokens), 0.25)["kvstore_prefill_tokens_per_s"]
        took = time.monotonic() - began
        assert len(tokens) / took <= rate <= len(tokens) / 0.25, rate
        assert "kvstore_prefill_tokens_per_s" not in produced("p2", BLOCK - 1, 0.05)
    finally:
        conn.shutdown()
