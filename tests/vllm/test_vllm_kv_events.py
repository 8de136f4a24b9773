"""The daemon's KV events, checked with vLLM's own code: its event classes decode them, its own
block-hash function hashes the prompt, and every block of a prompt published through the vLLM
connector, and of one published through transformers, is found under the right tier.

Run in the vLLM venv: `.venv-vllm/bin/python -m pytest tests/vllm/test_vllm_kv_events.py -m vllm`.
"""

from __future__ import annotations

import importlib.util
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.server.process import DaemonProcess

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run `bash scripts/setup_vllm.sh`",
                allow_module_level=True)

from tests.vllm.test_vllm_connector import MAX_TOKENS, Engine, one_core_per_worker, prompts
from tests.vllm.vllm_runner import make_model

pytestmark = [pytest.mark.vllm, pytest.mark.integration]
ENGINE_BLOCK = 32  # vLLM's block size in these tests (test_vllm_connector.BLOCK)
KV_BLOCK = 64  # kvstore's: each kvstore block covers two vLLM blocks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_hashes(tokens: list[int]) -> list[bytes]:
    """The block hashes vLLM computes for a prompt (its default sha256, no salt or LoRA)."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

    init_none_hash(sha256)
    out: list[bytes] = []
    parent = None
    for i in range(len(tokens) // ENGINE_BLOCK):
        parent = hash_block_tokens(sha256, parent, tokens[i * ENGINE_BLOCK:(i + 1) * ENGINE_BLOCK])
        out.append(bytes(parent))
    return out


class Subscriber:
    """A SUB socket decoding batches with vLLM's `KVEventBatch`."""

    def __init__(self, endpoint: str) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.zmq = zmq
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list[Any] = []

    def drain(self, until: Callable[[list[Any]], bool], timeout: float = 30.0) -> list[Any]:
        end = time.monotonic() + timeout
        while not until(self.events) and time.monotonic() < end:
            if self.sub.poll(100):
                _topic, _seq, payload = self.sub.recv_multipart()
                self.events.extend(self.decoder.decode(payload).events)
        return self.events

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


def hashes_in(events: list[Any], kind: str, medium: str) -> set[bytes]:
    return {h for e in events if type(e).__name__ == kind and e.medium == medium
            for h in e.block_hashes}


def in_cpu(events: list[Any]) -> set[bytes]:
    """Hashes whose last CPU event is a BlockStored (removals replayed in order)."""
    held: set[bytes] = set()
    for e in events:
        if getattr(e, "medium", None) != "CPU":
            continue
        if type(e).__name__ == "BlockStored":
            held.update(e.block_hashes)
        elif type(e).__name__ == "BlockRemoved":
            held.difference_update(e.block_hashes)
    return held


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("vllm") / "tiny-llama")


@pytest.fixture(scope="module")
def events_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess,
                                                                             str]]:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    # 2 MiB of host (32 blocks of 64 KiB): a 2 MiB filler pushes a prompt to disk.
    d = DaemonProcess(tmp_path_factory.mktemp("vllm") / "kvstore", "--host-bytes", "2MiB",
                      "--disk-bytes", "64MiB", "--kv-events", endpoint).start()
    yield d, endpoint
    d.kill()


@pytest.mark.timeout(900)
def test_events_carry_vllm_block_hashes_per_tier(model_dir: Path, events_daemon) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm.distributed.kv_events import AllBlocksCleared, BlockStored

    from kvstore.client import KVClient
    from kvstore.client.integrations.hf import CachedPrefill, layout_for_model
    from tests.conftest import random_kv, small_layout

    daemon, endpoint = events_daemon
    sub = Subscriber(endpoint)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    try:
        time.sleep(0.5)  # the SUB connection is up before anything is published
        # 1. Through the vLLM connector.
        ids = tokenizer(prompts(seed=11)[0])["input_ids"]
        ids = ids[: len(ids) // KV_BLOCK * KV_BLOCK + 5]  # whole kvstore blocks and a tail
        want = vllm_hashes(ids)
        assert len(want) >= 8
        engine = Engine(model_dir, daemon.target, extra={"kvstore.block_tokens": KV_BLOCK})
        try:
            engine.generate([ids])
        finally:
            engine.close()
        events = sub.drain(lambda ev: hashes_in(ev, "BlockStored", "CPU") >= set(want))
        assert hashes_in(events, "BlockStored", "CPU") >= set(want), \
            f"{len(hashes_in(events, 'BlockStored', 'CPU') & set(want))} of {len(want)} found"
        stored = [e for e in events if isinstance(e, BlockStored) and e.block_hashes[0] in want]
        for e in stored:
            i = want.index(e.block_hashes[0])
            assert e.block_hashes == want[i : i + KV_BLOCK // ENGINE_BLOCK]
            assert e.parent_block_hash == (want[i - 1] if i else None)
            assert e.token_ids == ids[i * ENGINE_BLOCK : i * ENGINE_BLOCK + KV_BLOCK]
            assert e.block_size == ENGINE_BLOCK

        # 2. Through transformers, hashed by kvstore's re-implementation of vLLM's hash.
        hf_ids = tokenizer(prompts(seed=12)[0])["input_ids"]
        hf_want = vllm_hashes(hf_ids[: len(hf_ids) // KV_BLOCK * KV_BLOCK])
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        layout = layout_for_model(model, block_tokens=KV_BLOCK, model_id=str(model_dir))
        with KVClient(daemon.target, layout) as client:
            CachedPrefill(model, client, event_block_size=ENGINE_BLOCK).generate(
                torch.tensor([hf_ids]), MAX_TOKENS)
        events = sub.drain(lambda ev: hashes_in(ev, "BlockStored", "CPU") >= set(hf_want))
        assert hashes_in(events, "BlockStored", "CPU") >= set(hf_want)

        # 3. Eviction to disk: removed from CPU, stored on STORAGE (vLLM's medium names).
        # Over the whole history: some blocks may have gone to disk already (the host tier is
        # small and the transformers run published meanwhile).
        filler = small_layout(block_tokens=KV_BLOCK * 2)  # 64 KiB blocks of another model
        with KVClient(daemon.target, filler) as c:
            n = 32 * KV_BLOCK * 2  # 32 blocks: the host tier's size
            c.publish(list(range(n)), random_kv(filler, n))

        def evicted(ev: list[Any]) -> bool:
            return (hashes_in(ev, "BlockStored", "STORAGE") >= set(want)
                    and not in_cpu(ev) & set(want))

        events = sub.drain(evicted)
        assert hashes_in(events, "BlockStored", "STORAGE") >= set(want)
        assert not in_cpu(events) & set(want), "blocks still in CPU after the filler"

        # 4. Clear: one AllBlocksCleared.
        with KVClient(daemon.target, filler) as c:
            c.clear(all_namespaces=True)
        events = sub.drain(lambda ev: any(isinstance(e, AllBlocksCleared) for e in ev))
        assert isinstance(events[-1], AllBlocksCleared)
    finally:
        sub.close()


@pytest.mark.timeout(900)
def test_block_stored_as_two_shards_is_described_once(model_dir: Path, events_daemon) -> None:
    """Tensor parallel 2: every block is stored as two shards, one per rank's KV head. The
    events describe the first shard only (which rank 0 saves): each vLLM block hash of the
    prompt is in exactly one CPU `BlockStored`, not one per shard, with its tokens."""
    from transformers import AutoTokenizer
    from vllm.distributed.kv_events import BlockStored

    daemon, endpoint = events_daemon
    sub = Subscriber(endpoint)
    try:
        time.sleep(0.5)  # the SUB connection is up before anything is published
        ids = AutoTokenizer.from_pretrained(model_dir)(prompts(seed=13)[0])["input_ids"]
        ids = ids[: len(ids) // KV_BLOCK * KV_BLOCK + 5]
        want = vllm_hashes(ids)
        with one_core_per_worker(2):
            engine = Engine(model_dir, daemon.target, extra={"kvstore.block_tokens": KV_BLOCK},
                            llm_kwargs={"tensor_parallel_size": 2,
                                        "distributed_executor_backend": "mp"})
        try:
            engine.generate([ids])
        finally:
            engine.close()
        sub.drain(lambda ev: hashes_in(ev, "BlockStored", "CPU") >= set(want))
        events = sub.drain(lambda ev: False, timeout=3.0)  # and whatever else follows
        stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"
                  and set(e.block_hashes) & set(want)]
        assert sorted(h for e in stored for h in e.block_hashes) == sorted(want)
        for e in stored:
            i = want.index(e.block_hashes[0])
            assert e.token_ids == ids[i * ENGINE_BLOCK : i * ENGINE_BLOCK + KV_BLOCK]
    finally:
        sub.close()


@pytest.mark.timeout(900)
def test_hybrid_groups_are_described_as_vllm_names_them(events_daemon,
                                                        tmp_path_factory: pytest.TempPathFactory,
                                                        ) -> None:
    """A Gemma-4-shaped model (a sliding-window group of 64-token vLLM blocks beside a
    full-attention group of 32-token ones, tests/vllm/test_vllm_gemma4.py): each group's
    kvstore blocks are announced with its `group_idx`, kind and window, by the hashes vLLM
    gives that group's blocks (`BlockHashListWithBlockSize` over the request's 32-token
    hashes), at its block size, each block's tokens, and the parent in the group's own
    chain."""
    from vllm.distributed.kv_events import BlockStored
    from vllm.v1.core.kv_cache_utils import BlockHashListWithBlockSize

    from tests.vllm.models import HYBRID_WINDOW, make_gemma4_model
    from tests.vllm.vllm_runner import corpus_ids

    model = make_gemma4_model(tmp_path_factory.mktemp("vllm-events-gemma4") / "tiny-gemma4")
    daemon, endpoint = events_daemon
    sub = Subscriber(endpoint)
    try:
        time.sleep(0.5)  # the SUB connection is up before anything is published
        ids = corpus_ids(model, 71, 4 * KV_BLOCK + 12)  # 4 kvstore blocks and a tail
        at32 = vllm_hashes(ids)  # vLLM hashes a hybrid request at the groups' GCD, 32
        at64 = [bytes(h) for h in BlockHashListWithBlockSize(at32, ENGINE_BLOCK, 2 * ENGINE_BLOCK)]
        groups = {0: (at64, 2 * ENGINE_BLOCK, "sliding_window", HYBRID_WINDOW),
                  1: (at32, ENGINE_BLOCK, "full_attention", None)}
        everything = set(at32)
        engine = Engine(model, daemon.target)
        try:
            engine.generate([ids])
        finally:
            engine.close()

        def stored(ev: list[Any]) -> list[Any]:
            return [e for e in ev if isinstance(e, BlockStored) and e.medium == "CPU"
                    and set(e.block_hashes) <= everything]

        events = stored(sub.drain(lambda ev: len(stored(ev)) >= 8))
        assert sorted(e.group_idx for e in events) == [0] * 4 + [1] * 4, events
        for idx, (want, size, kind, window) in groups.items():
            mine = [e for e in events if e.group_idx == idx]
            assert sorted(h for e in mine for h in e.block_hashes) == sorted(want[: 4 * KV_BLOCK
                                                                                // size])
            for e in mine:
                i = want.index(e.block_hashes[0])
                assert e.block_hashes == want[i : i + KV_BLOCK // size]
                assert e.parent_block_hash == (want[i - 1] if i else None)
                assert e.token_ids == ids[i * size : i * size + KV_BLOCK]
                assert (e.block_size, e.kv_cache_spec_kind,
                        e.kv_cache_spec_sliding_window) == (size, kind, window)
    finally:
        sub.close()
