"""KV events: what enters and leaves each tier, in vLLM's wire format (`kv_events`).

Cache-aware routers built for vLLM (llm-d's KV-cache indexer, Dynamo's KV router) subscribe to
vLLM's `ZmqEventPublisher`: a ZMQ PUB socket sending multipart (topic, 8-byte big-endian
sequence number, msgpack `KVEventBatch`), and a ROUTER socket answering a request (an 8-byte
big-endian start sequence) with every buffered batch from there on, then an end marker (seq -1).
This module sends exactly that, from the daemon, without importing vLLM (the daemon depends on
neither vLLM nor torch): the structs below encode to the bytes vLLM's own classes encode to
(same names, tags, field order and options), which the vLLM-marked test checks by decoding them
with vLLM's classes.

The hashes in the events are the engine's: a kvstore block covers many engine blocks and is
keyed by kvstore's own chain, so a client that wants events describes each block it publishes
(`DescribeBlocks`: the engine block hashes, parent hash, token ids and block size it covers).
`EventTracker` keeps that description beside the block while any tier holds it, persisting it
for disk blocks (their own RocksDB, beside the disk index), and turns tier changes into
`BlockStored` / `BlockRemoved` per tier (`medium`: vLLM's names, "CPU" for host, "STORAGE" for
disk). Blocks nobody described produce no events: a router could not match them anyway.

A slow or absent subscriber never slows the store: events go through a bounded queue to a
publisher thread (msgpack encoding off the event loop), and a full queue drops the batch,
counted (`dropped`), as a PUB socket past its high-water mark drops messages (silently). The ZMQ
sockets themselves live in a child process (`server/event_sockets.py`): ZMQ caps no
connections, so there a flood of them takes that process's descriptors, not the daemon's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import multiprocessing
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from kvstore.server import event_sockets
from kvstore.tiers.base import BlockEntry, Tier

if TYPE_CHECKING:
    from rocksdict import Rdict

log = logging.getLogger(__name__)

# vLLM's medium names (`vllm.v1.kv_offload.base.Medium`, `kv_events.MEDIUM_*`): its own
# offloading connector reports CPU offload as "CPU" and storage tiers as "STORAGE".
MEDIUMS = {"gpu": "GPU", "host": "CPU", "disk": "STORAGE"}
END_SEQ = event_sockets.END_SEQ  # vLLM's replay end-of-sequence marker
# Descriptions of blocks no tier holds (described before commit, or after a miss): kept this
# many, and this many bytes (`description_bytes`), oldest dropped, so a client describing
# blocks it never publishes costs bounded memory. 64 MiB: ~6,500 descriptions of 256-token
# blocks, some 1.7M tokens described ahead of their commit (a connector describes a request's
# blocks as it plans their save, a step or so before they are stored).
PENDING_LIMIT = 1 << 16
PENDING_BYTES = 64 << 20


# ---- vLLM's event structs, field for field (vllm/distributed/kv_events.py, vLLM 0.32)
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events (tagged by class name, as vLLM's)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class EngineBlocks(msgspec.Struct, array_like=True, frozen=True):
    """What one kvstore block is to the engine: the engine blocks it covers, in order."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None  # of the engine block before the first; None: none
    token_ids: list[int]
    block_size: int  # engine tokens per engine block
    lora_name: str | None = None
    # A hybrid model's KV-cache group (vLLM's `group_idx`, `kv_cache_spec_kind`, window);
    # None: one group. Trailing fields with defaults: descriptions persisted before decode.
    group_idx: int | None = None
    spec_kind: str | None = None
    sliding_window: int | None = None


def description_bytes(meta: EngineBlocks) -> int:
    """About what `meta` takes in memory, with its entries in the tracker's maps: a token id
    is a Python int in a list (up to 40 bytes), a hash a bytes object in one (about 80)."""
    return (400 + 40 * len(meta.token_ids) + 80 * len(meta.block_hashes)
            + len(meta.lora_name or "") + len(meta.spec_kind or ""))


_meta_encoder = msgspec.msgpack.Encoder()
_meta_decoder = msgspec.msgpack.Decoder(EngineBlocks)


class ZmqEventPublisher:
    """vLLM's `ZmqEventPublisher` wire behaviour (PUB + ROUTER replay), with a queue that
    drops instead of blocking the caller. The sockets live in a child process
    (`server/event_sockets.py`, at most `max_files` descriptors, lowest CPU priority), so a
    flood of connections to them cannot take the daemon's descriptors; a thread here encodes
    the batches and is the only writer of the pipe to it."""

    START_S = 30.0  # for the child to import zmq and bind (a spawn on a loaded machine)

    def __init__(self, endpoint: str, replay_endpoint: str = "", topic: str = "",
                 max_queue: int = 10_000, buffer_steps: int = 10_000, hwm: int = 100_000,
                 max_files: int = 1024, log_level: str = "info", log_format: str = "text",
                 ) -> None:
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=max_queue)
        # Batches dropped here, each counted by one thread only (no lost increments): the
        # queue was full (the loop's `publish`), or the child is gone (the feeding thread).
        self._dropped_full = self._dropped_gone = 0
        self._gone = self._closing = False
        ctx = multiprocessing.get_context("spawn")  # no fork of a daemon running threads
        self._sent = ctx.Value("Q", 0, lock=False)
        self._failed = ctx.Value("Q", 0, lock=False)
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=event_sockets.serve, name="kvstore-kv-events", daemon=True,
            args=(child, endpoint, replay_endpoint, topic, buffer_steps, hwm, max_files,
                  self._sent, self._failed, log_level, log_format))
        self._proc.start()
        child.close()
        try:
            if not self._conn.poll(self.START_S):
                raise RuntimeError(f"the KV events process did not bind {endpoint} within "
                                   f"{self.START_S:.0f} s")
            answer = self._conn.recv()
        except EOFError:
            self._stop_process(5.0)
            raise RuntimeError(f"the KV events process exited before binding {endpoint} "
                               f"(exit code {self._proc.exitcode})") from None
        except BaseException:
            self._stop_process(0)
            raise
        if answer[0] != "ok":
            self._stop_process(5.0)
            raise zmq.ZMQError(msg=answer[1])
        self.endpoint, self.replay_endpoint = answer[1], answer[2]
        self._thread = threading.Thread(target=self._run, name="kvstore-kv-events", daemon=True)
        self._thread.start()

    @property
    def published(self) -> int:
        """Batches given a sequence number (handed to the PUB socket, which drops silently
        past its high-water mark, as vLLM's; a replay serves them)."""
        return int(self._sent.value)

    @property
    def dropped(self) -> int:
        """Batches dropped: the queue was full, a send failed, or the sockets' process was
        gone."""
        return self._dropped_full + self._dropped_gone + int(self._failed.value)

    def publish(self, batch: KVEventBatch) -> bool:
        """Queue a batch; False (counted in `dropped`) when the queue is full. Never blocks."""
        try:
            self._queue.put_nowait(batch)
            return True
        except queue.Full:
            self._dropped_full += 1
            return False

    def _run(self) -> None:
        encode = msgspec.msgpack.Encoder().encode
        while (batch := self._queue.get()) is not None and not self._closing:
            try:
                self._conn.send_bytes(encode(batch))
            except OSError:  # the sockets' process died: events are off from here
                if not self._gone:
                    self._gone = True
                    log.error("kv events: the sockets' process is gone (exit code %s); "
                              "batches are dropped from now on", self._proc.exitcode)
                self._dropped_gone += 1
        with contextlib.suppress(OSError):
            self._conn.send_bytes(b"")  # the child's cue to exit

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (for up to `timeout_s`), then stop the thread and the
        sockets' process (killed if it has not exited a second later)."""
        end = time.monotonic() + timeout_s
        while not self._queue.empty() and time.monotonic() < end:
            time.sleep(0.01)
        self._closing = True  # the thread stops at its next batch, the queue full or not
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        self._thread.join(max(0.0, end - time.monotonic()) + 0.1)
        # The child lingers up to 0.5 s for the last batches; one that does not read its pipe
        # (stopped, starved) is killed, which also frees a thread blocked writing to it.
        self._stop_process(max(0.0, end - time.monotonic()) + 1.0, close_pipe=False)
        self._thread.join(1.0)
        if not self._thread.is_alive():  # else it may still write: its descriptor stays
            self._conn.close()

    def _stop_process(self, timeout_s: float, close_pipe: bool = True) -> None:
        self._proc.join(timeout_s)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        if close_pipe:
            self._conn.close()


class _MetaDB:
    """Descriptions of disk blocks, persistent (RocksDB beside the disk index), so a restarted
    daemon still names the engine blocks when it removes a disk block.

    Never raises: it sits in the tiers' listener, on the same disk as the tier. A RocksDB
    whose log write failed (a full disk) fails every later write on that handle but still
    reads, so after a failure writes are skipped (a description not saved only leaves that
    block's removal unannounced after a restart) and reads go on; the store is reopened once
    the disk takes writes again (`heal`). Opened where the disk cannot be written, it starts
    read-only (or empty, if even that fails) and heals the same way."""

    REOPEN_S = 30.0  # after a reopen that failed (each leaves a RocksDB LOG file behind)

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.failures = 0
        self._failed_at: float | None = None  # the first failure since it last worked
        self._reopen_failed_at = -math.inf  # the last reopen that failed
        self.db: Rdict | None = None
        try:
            self.db = self._open()
        except Exception as e:
            self._failed(e)
            self.db = self._open_read_only()

    def _open(self) -> Rdict:
        from rocksdict import Rdict  # the disk tier's dependency already

        return Rdict(str(self.path))

    def _open_read_only(self) -> Rdict | None:
        from rocksdict import AccessType, Options, Rdict

        try:
            return Rdict(str(self.path), Options(), access_type=AccessType.read_only(False))
        except Exception as e:
            log.debug("kv events: the description store cannot be read either: %s", e)
            return None

    @property
    def failed(self) -> bool:
        return self._failed_at is not None

    def heal(self) -> None:
        """Reopen for writing after a failure (call when the disk takes writes again); at
        most every `REOPEN_S`. A reopen that fails keeps what can still be read."""
        if self._failed_at is None or (time.monotonic() - self._reopen_failed_at
                                       < self.REOPEN_S):
            return
        self._close()
        try:
            self.db = self._open()
        except Exception as e:
            self._failed(e)
            self._reopen_failed_at = time.monotonic()
            self.db = self._open_read_only()
            return
        log.info("kv events: the store of disk block descriptions works again")
        self._failed_at = None

    def _failed(self, e: Exception) -> None:
        if self._failed_at is None:
            log.warning("kv events: the store of disk block descriptions failed (%s); "
                        "descriptions are not saved until the disk takes writes again",
                        " ".join(str(e).split()))
        self.failures += 1
        self._failed_at = time.monotonic()

    def put(self, key: bytes, meta: EngineBlocks) -> None:
        if self.db is None or self._failed_at is not None:
            return
        value = _meta_encoder.encode(meta)  # (outside the try: not a failure of the store)
        try:
            self.db[key] = value
        except Exception as e:
            self._failed(e)

    def get(self, key: bytes) -> EngineBlocks | None:
        if self.db is None:
            return None
        try:
            raw = self.db.get(key)
        except Exception as e:
            log.debug("kv events: reading a description failed: %s", e)
            return None
        if raw is None:
            return None
        try:
            return _meta_decoder.decode(raw)
        except msgspec.DecodeError:
            return None

    def delete(self, key: bytes) -> None:
        if self.db is None or self._failed_at is not None:
            return
        try:
            del self.db[key]
        except Exception as e:
            self._failed(e)

    def _close(self) -> None:
        db, self.db = self.db, None
        if db is not None:
            try:
                db.close()
            except Exception as e:  # a handle whose log write failed fails its flush too
                log.debug("kv events: closing the description store: %s", e)

    def close(self) -> None:
        self._close()


@dataclass
class _Batching:
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    scheduled: bool = False


class EventTracker:
    """Turns tier changes of described blocks into events, batched per event-loop turn.

    Runs on the daemon's event-loop thread (the tiers' listener), like all bookkeeping.
    """

    def __init__(self, publisher: ZmqEventPublisher, tiers: Iterable[Tier],
                 meta_path: Path | None = None) -> None:
        self.publisher = publisher
        self.tiers = list(tiers)
        self.meta: dict[bytes, EngineBlocks] = {}  # blocks some tier holds, or pending
        # Described, in no tier yet: each one's `description_bytes`, oldest first.
        self._pending: OrderedDict[bytes, int] = OrderedDict()
        self.pending_bytes = 0
        self.pending_dropped = 0  # pending descriptions dropped past the limits
        self.db = _MetaDB(meta_path) if meta_path is not None else None
        self._batch = _Batching([])
        # Stored copies of each engine block per medium: two kvstore blocks can cover the same
        # engine blocks (tenants sharing a system prompt, each in its own namespace), and a
        # router told one copy left must not forget the other. Counted from this process's
        # changes only: a disk block held since before a restart counts as unknown.
        self._copies: dict[tuple[str, int | None, bytes | int], int] = {}
        # During a clear of everything, its removals (one AllBlocksCleared replaces them).
        self._clearing: list[BlockRemoved] | None = None
        for tier in self.tiers:
            tier.listener = self._on_change

    # ---- descriptions from clients
    def describe(self, key: bytes, meta: EngineBlocks) -> None:
        """Attach `meta` to block `key`; tiers already holding it announce it now."""
        before = self.meta.get(key)
        if before == meta:
            return
        self.meta[key] = meta
        held = [t for t in self.tiers if t.contains(key)]
        for tier in held:
            if before is not None:  # re-described: its old engine blocks are not held
                self._removed(tier, before)
            self._stored(tier, key, meta)
        self._unpend(key)  # (re-)described: its latest description, newest
        if not held:
            self._pending[key] = cost = description_bytes(meta)
            self.pending_bytes += cost
            while len(self._pending) > PENDING_LIMIT or self.pending_bytes > PENDING_BYTES:
                old, cost = self._pending.popitem(last=False)
                self.pending_bytes -= cost
                if not self.pending_dropped:
                    log.warning("kv events: more blocks described than stored (over %d "
                                "descriptions or %d MiB kept for blocks no tier holds); the "
                                "oldest are dropped, and their blocks, if stored later, send "
                                "no events", PENDING_LIMIT, PENDING_BYTES >> 20)
                self.pending_dropped += 1
                if not any(t.contains(old) for t in self.tiers):
                    self.meta.pop(old, None)

    def _unpend(self, key: bytes) -> None:
        cost = self._pending.pop(key, None)
        if cost is not None:
            self.pending_bytes -= cost

    # ---- tier changes
    def _on_change(self, tier: Tier, entry: BlockEntry, stored: bool) -> None:
        key = entry.key
        if self.db is not None and self.db.failed and self._disk_writable():
            self.db.heal()
        meta = self.meta.get(key)
        if meta is None and self.db is not None and (tier.name == "disk" or any(
                t.name == "disk" and key in t.entries for t in self.tiers)):
            # Described before a restart: the description is in the disk tier's own store
            # (a block only in host was described since, or never).
            meta = self.db.get(key)
            if meta is not None:
                self.meta[key] = meta
        if stored:
            if meta is not None:
                self._unpend(key)
                self._stored(tier, key, meta)
            return
        if tier.name == "disk" and self.db is not None and meta is not None:
            self.db.delete(key)
        if meta is None:
            return
        self._removed(tier, meta)
        if not any(t.contains(key) for t in self.tiers):
            self.meta.pop(key, None)

    def _disk_writable(self) -> bool:
        """The disk tier takes writes (the description store lives on its filesystem)."""
        return any(t.name == "disk" and not getattr(t, "degraded", "") for t in self.tiers)

    def _stored(self, tier: Tier, key: bytes, meta: EngineBlocks) -> None:
        if tier.name == "disk" and self.db is not None:
            self.db.put(key, meta)
        medium = MEDIUMS.get(tier.name, tier.name.upper())
        for h in meta.block_hashes:
            copy = (medium, meta.group_idx, h)
            self._copies[copy] = self._copies.get(copy, 0) + 1
        # Sent for every copy: a router takes a second BlockStored as the same fact.
        self._emit(BlockStored(block_hashes=list(meta.block_hashes),
                               parent_block_hash=meta.parent_block_hash,
                               token_ids=list(meta.token_ids), block_size=meta.block_size,
                               lora_id=None, medium=MEDIUMS.get(tier.name, tier.name.upper()),
                               lora_name=meta.lora_name, group_idx=meta.group_idx,
                               kv_cache_spec_kind=meta.spec_kind,
                               kv_cache_spec_sliding_window=meta.sliding_window))

    def _removed(self, tier: Tier, meta: EngineBlocks) -> None:
        """A copy of `meta`'s engine blocks left `tier`: announce those no other copy there
        covers (an engine block never counted, held since before a restart, is announced)."""
        medium = MEDIUMS.get(tier.name, tier.name.upper())
        gone: list[bytes | int] = []
        for h in meta.block_hashes:
            copy = (medium, meta.group_idx, h)
            left = self._copies.get(copy, 0) - 1
            if left > 0:
                self._copies[copy] = left
                continue
            self._copies.pop(copy, None)
            gone.append(h)
        if not gone:
            return
        removed = BlockRemoved(block_hashes=gone, medium=medium, group_idx=meta.group_idx)
        if self._clearing is not None:
            self._clearing.append(removed)
        else:
            self._emit(removed)

    def clearing_all(self) -> _ClearAll:
        """Context for `TieredStore.clear(None)`: its removals become one AllBlocksCleared
        when every tier ends empty (else, a copy of a block still held, one by one)."""
        return _ClearAll(self)

    # ---- batching: one KVEventBatch per event-loop turn
    def _emit(self, event: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
        self._batch.events.append(event)
        if not self._batch.scheduled:
            self._batch.scheduled = True
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # no loop (a test driving the store directly): send now
                self.flush()

    def flush(self) -> None:
        batch, self._batch = self._batch, _Batching([])
        if batch.events:
            self.publisher.publish(KVEventBatch(ts=time.time(), events=batch.events))

    def close(self, host_gone: bool = False) -> None:
        """Stop listening; with `host_gone` (the daemon stopping: the arena goes with it),
        first announce the removal of the described host blocks."""
        if host_gone:
            for tier in self.tiers:
                if tier.name in ("gpu", "host"):  # memory tiers; disk blocks stay stored
                    for key, meta in self.meta.items():
                        if tier.contains(key):
                            self._removed(tier, meta)
        self.flush()
        for tier in self.tiers:
            tier.listener = None
        if self.db is not None:
            self.db.close()


class _ClearAll:
    def __init__(self, tracker: EventTracker) -> None:
        self.tracker = tracker

    def __enter__(self) -> _ClearAll:
        self.tracker._clearing = []
        return self

    def __exit__(self, *exc: object) -> None:
        removed, self.tracker._clearing = self.tracker._clearing or [], None
        if all(t.committed_blocks == 0 for t in self.tracker.tiers):
            self.tracker._copies.clear()
            self.tracker._emit(AllBlocksCleared())
        else:
            for event in removed:
                self.tracker._emit(event)
