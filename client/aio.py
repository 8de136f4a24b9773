"""`AsyncKVClient`: lookup, fetch and publish a prompt's KV blocks against a kvstore daemon.

Keys are computed here (chained SHA-256 over the tokens, see `kvstore.keys`), or given
(`kvstore.keys.PrefixKeys`: a caller that hashes a prompt once for many calls). Over a Unix
socket the client maps the daemon's host arena and copies blocks straight in and out of shared
memory; over TCP (or when the arena cannot be mapped) it streams them.

The engine's contract: a daemon that is down, slow, full or restarting is a miss within the
call's deadline (logged once per outage), never an exception. Bad input from the caller (a
wrong shape or dtype, non-integer tokens) raises `InvalidArgumentError` naming what is wrong.

Deadlines fit the work: a control call (lookup, lease, release, commit) has `deadline_s`; a
call that moves blocks has `deadline_s` plus its bytes' time at the measured bandwidth
(`kvstore.planner.transfer_deadline`), or, given `budget_s` (what recomputing would cost),
as long as finishing it can still beat recomputing. A fetch cut short keeps the prefix it
completed. A save that does not happen is counted (`dropped_saves`) and logged: the first at
once, then a summary at most every `DROP_LOG_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import math
import mmap
import os
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, TypeVar, cast

import grpc
import numpy as np
import torch

from kvstore.arena import Arena, run_at_lowest_priority
from kvstore.client.backoff import BackoffPolicy, Breaker, LogThrottle
from kvstore.client.slab import MappedSlab, map_slab
from kvstore.engine_blocks import EngineBlockSpan
from kvstore.errors import AuthError, InvalidArgumentError, KVStoreError, PermissionDeniedError
from kvstore.keys import KeyCache, Namespace, PrefixKeys
from kvstore.layout import KVLayout
from kvstore.malloc_tuning import keep_large_buffers
from kvstore.planner import (
    DEFAULT_BANDWIDTH,
    BandwidthModel,
    Plan,
    end_to_end_bandwidth,
    transfer_deadline,
)
from kvstore.planner import plan as plan_prefix
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.worker_wait import wait_out
from kvstore.writer_lock import writer_lock

log = logging.getLogger("kvstore.client")
T = TypeVar("T")
R = TypeVar("R")
Tokens = Sequence[int] | torch.Tensor | np.ndarray | PrefixKeys
"""A prompt: its tokens, or its block keys computed ahead (`kvstore.keys.PrefixKeys`, e.g. an
engine's `KeyChain` per request, so a prompt looked up again is not converted and hashed again)."""
BlockCopy = Callable[[list[int], list[torch.Tensor], threading.Event], int | None]
"""`fn(blocks, views, stop)`: copies to or from block views (see `AsyncKVClient.fetch_with`);
returns how many of the leading blocks it copied in full (None: all of them)."""
STREAM_CHUNK = 4 << 20
STREAM_GROUP_BYTES = 8 << 20
# A transfer over TCP moves its blocks in groups of about this many bytes: a fetch hands each
# group to `consume` as it arrives, a publish streams each group `produce` filled. Through two
# buffers taken from `_stream_buffers`: memory bounded by two groups whatever the prompt,
# pages touched once per process, each group's copy overlapping the next one's transfer.
# (One buffer for the whole prefix, freshly allocated per fetch, cost its page faults in every
# load: 94 ms of a vLLM consumer's first 1,024-token load from its peer, 17 ms of each later.)
# A copy between the arena and a caller's tensor stops between pieces this large when its call
# is cancelled (about 4 ms each at memory speed), so a deadline is kept to within one piece.
COPY_PIECE_BYTES = 64 << 20
# Statuses that mean "the daemon can't serve anything now": a miss, and back off. Any other
# status refuses one call (a miss, or an error for an admin call), and the next one goes
# through: a tenant refused `clear --all` is not an outage of its own engine's cache.
_OUTAGE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# Refusals that are part of normal service (overload shedding, a lease that expired, a call
# cancelled by the daemon's shutdown): logged at debug. Others are logged once per status.
_ROUTINE = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND,
                      grpc.StatusCode.CANCELLED})
DROP_LOG_S = 60.0  # dropped saves after the first: one summary line at most this often
PROBE_TIMEOUT_S = 0.5  # a probe of a daemon that went away: an Info call this long at most
PRESUMED_MAX_KEYS = 4096
"""The daemon's `max_blocks_per_call` presumed until its `Info` reply says (its default).

A call naming more keys than the daemon's limit is refused (INVALID_ARGUMENT), so the client
splits a longer prompt into consecutive calls (`AsyncKVClient._key_limit`). It learns the
limit from `InfoReply.max_blocks_per_call`, which every daemon sends: a same-node client
asks Info anyway when it maps the arena; a TCP client, which otherwise never asks, asks it
only before its first call naming more keys than this, so a prompt within the default limit
costs its one round trip and no more. A daemon run with a smaller limit (or restarted with
one) refuses a call: the client then asks Info again and, where the limit is now lower than
the one it planned with, makes the call again within it. Chosen over parsing the refusal's
text (a message, not an interface) and over always splitting at the default (a daemon
configured lower would refuse every long prompt): the number comes from the daemon, and
costs a round trip only where a prompt outgrows what the client knew."""


PREFAULT_ENV = "KVCLIENT_PREFAULT_BYTES"  # not KVSTORE_*: the daemon reads those as its own
"""Bytes of a daemon's arena a client touches in the background once it maps it (default
16 GiB; 0: none). A block written into a page of the arena that no process has touched yet
costs the kernel's first touch of that page inside the copy: a save into fresh space ran at
~1.3 GB/s against ~3.5 GB/s into space touched before (a 4,096-token prompt of the 8B KV
shape: 305-380 ms against 151 ms). Reading one byte per page, at the lowest CPU priority,
takes that cost off the copies."""
_PREFAULT_DEFAULT = 16 << 30
# One mapping per daemon arena per process, while a client uses it (a restarted daemon's
# old arena is unmapped once no client holds it).
_arenas: weakref.WeakValueDictionary[tuple[str, int], Arena] = weakref.WeakValueDictionary()
_arenas_lock = threading.Lock()


_pin_for_cuda = False  # `pin_arenas()` was called: every arena mapped here is pinned


def pin_arenas() -> None:
    """Register every daemon arena this process maps from now on with CUDA (`Arena.pin`),
    each in the background as it is mapped (registering took 1.5 s for 16 GiB on an H100's
    host; copies out of an arena meanwhile are from pageable memory, the same bytes). For
    engines on a GPU: their loads are then DMA out of page-locked memory. Process-wide, as
    the mappings and their registration are (`KVClient.prepare(pin=True)` calls it)."""
    global _pin_for_cuda
    _pin_for_cuda = True


def _shared_arena(path: str, size: int) -> Arena:
    """The process's mapping of the arena at `path`: clients of every namespace share it, so
    it is mapped and touched once."""
    with _arenas_lock:
        arena = _arenas.get((path, size))
        if arena is not None and not arena.is_file(path):  # a new file under the old name
            arena = None
        if arena is None:
            arena = Arena.attach(path, size)
            _arenas[(path, size)] = arena
            limit = int(os.environ.get(PREFAULT_ENV, _PREFAULT_DEFAULT))
            if limit > 0 and size > 0:
                threading.Thread(target=_prefault, args=(arena, min(size, limit)),
                                 name="kvstore-prefault", daemon=True).start()
            if _pin_for_cuda:  # off the caller's thread (a client's event loop)
                threading.Thread(target=arena.pin, name="kvstore-arena-pin",
                                 daemon=True).start()
        return arena


class _CopyGate:
    """The copies between an arena and a tensor running in this process, and the same-node
    fetches they belong to (the daemon writes into the arena meanwhile). The prefault touches
    pages only while none runs: at the lowest CPU priority it still slowed the copy it exists
    to speed up (profiled by hand: a warm fetch right after the client mapped a 2.3 GiB arena
    counted the prefault's page faults inside its copy and took several times the next one's
    time)."""

    def __init__(self) -> None:
        self._running = 0
        self._idle = threading.Condition()

    def run(self, fn: Callable[..., int | None], *args: object) -> int | None:
        with self.held():
            return fn(*args)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The prefault waits while this is held (a copy, or an engine's prefill)."""
        with self._idle:
            self._running += 1
        try:
            yield
        finally:
            with self._idle:
                self._running -= 1
                if not self._running:
                    self._idle.notify_all()

    @property
    def running(self) -> bool:
        """Whether a copy, a fetch or a prefill holds the prefault off now."""
        return self._running > 0

    def wait_idle(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: not self._running)


_copies = _CopyGate()

SAVE_NICE_ENV = "KVSTORE_SAVE_NICE"
"""How far below the process's CPU priority a publish's copies run (nice increment, 0-19;
default 10): a save is background work, and on a machine whose cores the engine, its API
server and the daemon share, it should take only the CPU they leave (a request's prefill, the
scheduler, the daemon's answers come first). 0 runs them as any other thread."""
_save_pool: ThreadPoolExecutor | None = None
_save_pool_lock = threading.Lock()


def save_nice() -> int:
    """The nice increment of publish copies (`KVSTORE_SAVE_NICE`, default 10), clamped to
    0-19; a value that is not an integer is an error that names it."""
    raw = os.environ.get(SAVE_NICE_ENV, "10")
    try:
        return max(0, min(19, int(raw)))
    except ValueError:
        raise InvalidArgumentError(f"{SAVE_NICE_ENV}={raw!r}: expected an integer 0-19") \
            from None


def _lower_priority(increment: int) -> None:
    """Lower the calling thread's CPU priority by `increment` (Linux nice is per thread);
    nothing where the OS does not allow it."""
    with contextlib.suppress(AttributeError, OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid,
                       min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))


def _save_executor() -> ThreadPoolExecutor | None:
    """The threads publish copies run on, at `save_nice()` below the process (None: 0, the
    event loop's default executor). Separate from the loads' threads: a thread's nice cannot
    be raised back without privileges, so a thread that copied a save never copies a load."""
    global _save_pool
    increment = save_nice()
    if increment == 0:
        return None
    with _save_pool_lock:
        if _save_pool is None:
            _save_pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1),
                                            thread_name_prefix="kvstore-save",
                                            initializer=_lower_priority, initargs=(increment,))
        return _save_pool


def prefault_paused() -> contextlib.AbstractContextManager[None]:
    """Hold the arena prefault off while latency-critical work of this process runs (an
    engine's prefill: `CachedPrefill.prefill` holds it). The prefault starts when a client maps
    an arena, at its first fetch or publish unless `prepare()` mapped it sooner, and its page
    faults beside a forward pass slowed that forward 4-5x here (a 2,080-token warm prefill
    took 1.1-1.5 s instead of 0.25-0.3 s in 3 of 4 runs with a 2.5 GiB arena)."""
    return _copies.held()


def _prefault(arena: Arena, nbytes: int) -> None:
    """Read one byte of every page of the first `nbytes` of `arena` (reads change nothing the
    daemon or another client holds), at the lowest CPU priority, between copies."""
    run_at_lowest_priority()
    step = 8 << 20  # short steps: a copy that starts waits for one step at most
    try:
        for off in range(0, nbytes, step):
            _copies.wait_idle()
            int(arena.array[off : min(off + step, nbytes) : mmap.PAGESIZE].sum())
    except (ValueError, BufferError):  # the mapping went away meanwhile: nothing to do
        return


class _BufferPool:
    """Byte buffers of streamed transfers, reused by every client of the process (engines
    make a client per namespace): a buffer's pages are faulted in once, not in every call."""

    def __init__(self, kept_per_size: int) -> None:
        self._kept = kept_per_size
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()  # clients of several event loops share it

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            free = self._free.setdefault(buffer.numel(), [])
            if len(free) < self._kept:
                free.append(buffer)


_stream_buffers = _BufferPool(kept_per_size=4)  # two transfers at once reuse theirs


def _group_blocks(layout: KVLayout) -> int:
    """Blocks per group of a streamed transfer (`STREAM_GROUP_BYTES`, one at least)."""
    return max(1, STREAM_GROUP_BYTES // layout.block_bytes)


def warm_stream_buffers(layout: KVLayout) -> None:
    """Fault in the buffers of this process's streamed transfers of `layout`'s blocks ahead of
    the first one: an engine that will load from another machine's daemon (a disaggregated
    consumer's peers) calls it at start. A fresh buffer's page faults cost a vLLM consumer
    ~80 ms of its first 1,024-token load from a peer on this repository's VM."""
    nbytes = _group_blocks(layout) * layout.block_bytes
    raw = [_stream_buffers.take(nbytes) for _ in range(2)]
    for b in raw:
        b.zero_()
        _stream_buffers.give(b)


class _CopyStopped(Exception):
    """A copy stopped at its deadline before the blocks it was given were all copied."""


class _DaemonFault(KVStoreError):
    """A reply inconsistent with its request (more blocks than asked for, sizes that do not
    match the layout, data past the blocks announced): a buggy or foreign peer. A miss,
    counted (`AsyncKVClient.daemon_faults`) and logged once, never data past the prompt."""


class _Progress:
    """Blocks of a fetch copied intact so far: what a fetch cut short still returns."""

    def __init__(self, start: int) -> None:
        self.start = self.done = start

    async def unless_fault(self, work: Awaitable[T]) -> T:
        """`await work`; a daemon fault on the way (`_DaemonFault`) keeps nothing of the
        fetch, not even blocks copied before it: a peer that sent an inconsistent reply is
        not trusted for the rest of its answer either."""
        try:
            return await work
        except _DaemonFault:
            self.done = self.start
            raise


def normalize_target(target: str) -> tuple[str, bool]:
    """gRPC target and whether it is a Unix socket (`/p`, `unix:/p`, `unix:///p`, `host:port`)."""
    if target.startswith("/"):
        return f"unix:{target}", True
    if target.startswith("unix:"):
        return target, True
    return target, False


def _copy_into_planes(planes: np.ndarray, offset: int, data: np.ndarray) -> None:
    """Copy `data`, the bytes from `offset` on of a block laid out plane after plane, into
    `planes` (`[planes, plane_bytes]`, each row contiguous; `AsyncKVClient._block_planes`)."""
    width = planes.shape[1]
    row, col = divmod(offset, width)
    pos = 0
    if col:  # the end of a plane begun in an earlier chunk
        k = min(width - col, len(data))
        planes[row, col : col + k] = data[:k]
        pos, row = k, row + 1
    whole = (len(data) - pos) // width
    if whole:
        planes[row : row + whole] = data[pos : pos + whole * width].reshape(whole, width)
        pos, row = pos + whole * width, row + whole
    if pos < len(data):  # the start of a plane the next chunk ends
        planes[row, : len(data) - pos] = data[pos:]


def _place_chunk(chunk: pb.FetchChunk, block: int, filled: int, size: int,
                 planes: np.ndarray) -> int:
    """Copy a streamed fetch's `chunk` into `planes`, block `block`'s place (`filled` of its
    `size` bytes in already); returns the bytes of the block in now. A chunk out of order, or
    past the block's end, or empty, fails the fetch (a daemon fault: a miss)."""
    if chunk.block_index != block or chunk.chunk_offset != filled \
            or not chunk.data or filled + len(chunk.data) > size:
        raise _DaemonFault(f"fetch stream out of order: block {chunk.block_index} at "
                           f"{chunk.chunk_offset}+{len(chunk.data)}, expected block {block} "
                           f"at {filled} within {size} bytes")
    _copy_into_planes(planes, filled, np.frombuffer(chunk.data, np.uint8))
    return filled + len(chunk.data)


class AsyncKVClient:
    """Async client of one daemon for one layout and namespace (salt, LoRA, tenant)."""

    def __init__(
        self,
        target: str,
        layout: KVLayout,
        *,
        salt: str = "",
        lora: str = "",
        tenant: str = "",
        token: str | None = None,
        deadline_s: float = 1.0,
        transfer: Literal["auto", "shm", "stream"] = "auto",
        backoff: BackoffPolicy | None = None,
        max_message_bytes: int = 64 << 20,
    ) -> None:
        if not isinstance(layout, KVLayout):
            raise InvalidArgumentError(f"layout must be a KVLayout, got {type(layout).__name__}")
        if deadline_s <= 0:
            raise InvalidArgumentError(f"deadline_s must be positive, got {deadline_s}")
        if transfer not in ("auto", "shm", "stream"):
            raise InvalidArgumentError(f"transfer must be auto, shm or stream, got {transfer!r}")
        save_nice()  # a bad KVSTORE_SAVE_NICE fails here, at the start, not in every save
        self.target, self.is_unix = normalize_target(target)
        self.layout = layout
        self.namespace = Namespace(layout, lora=lora, tenant=tenant, salt=salt)
        self._ns = self.namespace.digest()
        # lookup, fetch and publish of one prompt (and the next turn extending it) hash once
        self._key_cache = KeyCache(self._ns, layout.block_tokens)
        self._layout_pb = pb.Layout(**layout.to_dict())
        self.deadline_s = deadline_s
        self.transfer = transfer if self.is_unix else "stream"
        if self.transfer == "stream":
            keep_large_buffers()  # 1 MiB messages from warm heap pages, not fresh mappings
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._max_msg = max_message_bytes
        self._breaker = Breaker(backoff or BackoffPolicy(), log, self.target)
        self._probe: asyncio.Task[None] | None = None  # probes a daemon that went away
        self._refusals_logged: set[grpc.StatusCode] = set()
        # The daemon's measured read bandwidth per tier, from its latest Lookup reply: what
        # a transfer's deadline is planned at.
        self._read_bandwidth: dict[str, float] = {}
        self._warned_no_each = False  # a daemon without `Lookup.each` (`held`), logged once
        # The daemon's `max_blocks_per_call`, from its latest Info reply (0: not asked yet,
        # `PRESUMED_MAX_KEYS` meanwhile): longer prompts are split into calls of this many.
        self._max_keys = 0
        self.daemon_faults = 0  # replies inconsistent with their request (`_DaemonFault`)
        self._drops = LogThrottle(DROP_LOG_S)
        self.dropped_blocks = 0
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.KVStoreStub | None = None
        self._arena: Arena | None = None
        self._arena_id = ""
        # The arena of a daemon that went away, kept mapped until its successor says which
        # arena it serves: the same file where it took it over (`host_handover_s`), whose
        # mapping, its pages faulted in already, is then used as it is.
        self._left_arena: Arena | None = None
        # The daemon's gpu slab, mapped with its arena where it can be (`kvstore.client.slab`):
        # fetches then ask for the blocks only its gpu level holds where they lie.
        self._slab: MappedSlab | None = None
        self._slab_id = ""
        # This process's lock file beside the arena, named in every Reserve so that the daemon
        # never reuses a reservation this process may still be writing (`writer_lock`).
        self._writer: str | None = None
        self._background: set[asyncio.Future[Any]] = set()  # what abandoned calls left
        # This client's own leg of every fetch: its copy out of the daemon's memory (or its
        # receive, over TCP), bytes/s, an EWMA over fetches. `plan` adds it to every tier.
        self._copy_rate = BandwidthModel(bandwidth={}, latency={})
        self._kv_events: tuple[str, float] | None = None  # (endpoint, when asked): `kv_events`

    # ---- public API
    def keys(self, tokens: Tokens) -> list[bytes]:
        """Chained keys of the full blocks of `tokens` in this client's namespace."""
        if isinstance(tokens, PrefixKeys):
            if tokens.namespace != self._ns or tokens.block_tokens != self.layout.block_tokens:
                raise InvalidArgumentError("PrefixKeys were chained in another namespace or "
                                           "over other blocks than this client's")
            return list(tokens.keys)
        return self._key_cache.keys(tokens)

    async def lookup(self, tokens: Tokens, *, prefetch: bool = False) -> int:
        """Tokens in the longest cached prefix of `tokens` (a multiple of block_tokens).

        `prefetch`: the daemon also starts promoting the prefix's blocks that its host tier
        lacks (remote or disk hits) into host in the background, for a caller that will fetch
        the prompt a little later (after waiting for more of it): the fetch then finds them in
        host. A hint: one prefetch runs at a time per tenant (the same-node callers as one),
        and a fetch never depends on it.
        """
        keys = self.keys(tokens)
        if not keys:
            return 0
        reply = await self._guard(lambda: self._lookup(keys, prefetch), None)
        return 0 if reply is None else reply.hits * self.layout.block_tokens

    async def held(self, tokens: Tokens) -> list[bool]:
        """For each block of `tokens`, whether the daemon (its local tiers, then the remote
        tier) holds it, each on its own (a lookup stops at the first miss): for blocks that
        are not every block of a chain. One call (a daemon older than `Lookup.each`: one
        lookup per block); all False when the daemon is down or slow (a miss)."""
        keys = self.keys(tokens)
        if not keys:
            return []
        reply = await self._guard(lambda: self._lookup_each(keys), None)
        if reply is None:
            return [False] * len(keys)
        if len(reply.found) == len(keys):
            return list(reply.found)
        if not self._warned_no_each:  # an older daemon ignores `each`: key by key
            log.warning("kvstore daemon predates Lookup.each: probing %d blocks one lookup "
                        "each (upgrade the daemon)", len(keys))
            self._warned_no_each = True
        gate = asyncio.Semaphore(16)

        async def one(key: bytes) -> bool:
            async with gate:
                r = await self._guard(lambda: self._lookup([key]), None)
                return r is not None and r.hits == 1
        return list(await asyncio.gather(*(one(k) for k in keys)))

    async def fetch(self, tokens: Tokens, into: torch.Tensor | None = None, *,
                    max_blocks: int | None = None, budget_s: float | None = None,
                    ) -> tuple[int, torch.Tensor | None]:
        """`(n, kv)`: the longest cached prefix, `kv` shaped `[layers, kv, n, heads, head_dim]`.

        With `into` (a tensor shaped for all of `tokens`), blocks are written into its first `n`
        tokens and `into[:, :, :n]` is returned. A miss is `(0, None)`. `max_blocks` loads at
        most that many blocks of the prefix (`plan(...).load_blocks`); None: all of them.
        `budget_s`: the seconds recomputing these tokens would take (see `fetch_with`).
        """
        keys = self.keys(tokens)[: _limit(max_blocks)]
        if into is not None:
            self.layout.check_kv(into, into.shape[2] if into.dim() == 5 else -1)
            if into.shape[2] < len(keys) * self.layout.block_tokens:
                raise InvalidArgumentError("`into` holds fewer tokens than the prompt's blocks")
        if not keys:
            return 0, None
        until = self._until(len(keys), _budget(budget_s))
        progress = _Progress(0)
        out: list[torch.Tensor | None] = [into]
        result = await self._guard(
            lambda: progress.unless_fault(self._fetch(keys, out, until, progress)), None,
            until=until)
        if result is not None:
            return result
        return self._kept(progress.done, out[0])

    async def publish(self, tokens: Tokens, kv: torch.Tensor) -> int:
        """Store the full blocks of `tokens`; returns the prompt tokens now cached (a prefix).

        `kv`: `[num_layers, kv, len(tokens), num_kv_heads, head_dim]` in the layout's dtype.
        Blocks already stored are not sent again.
        """
        keys = self.keys(tokens)
        self.layout.check_kv(kv, _count(tokens))
        if not keys:
            return 0
        if kv.device.type != "cpu":
            kv = kv[:, :, : len(keys) * self.layout.block_tokens].cpu()
        until = self._until(len(keys))
        stored = await self._save(len(keys), lambda: self._publish(keys, kv, until), until)
        return stored * self.layout.block_tokens

    async def fetch_with(self, tokens: Tokens, consume: BlockCopy, *, skip_blocks: int = 0,
                         max_blocks: int | None = None, budget_s: float | None = None,
                         whole: bool = False) -> int:
        """Fetch the longest cached prefix of `tokens` and hand its blocks to `consume`, which
        copies them where the caller wants them: one copy, no tensor allocated here.

        `consume(blocks, views, stop)` runs in a worker thread with the prompt indices of some
        blocks (ascending, from `skip_blocks` on) and a view of each, `[layers, kv,
        block_tokens, heads, head_dim]` in the layout's dtype. Over a Unix socket the views are
        the daemon's shared memory, pinned by a lease for the call only: copy out of them and
        keep no reference. Over TCP they are views of a buffer received here. `consume` is
        called once per round of the fetch (more than once when the daemon serves a long prompt
        in parts). Once `stop` is set (the transfer's deadline passed) it should return soon,
        with the number of leading blocks it copied in full (None: all).

        Deadline: `deadline_s` plus the bytes' time at the measured bandwidth; with `budget_s`
        (the seconds recomputing these tokens would take) the fetch goes on while finishing it
        can still beat recomputing (`kvstore.planner.transfer_deadline`). A fetch cut short,
        by its deadline or the daemon, keeps the prefix that was copied intact.

        Returns the end, in prompt tokens, of the prefix whose blocks reached `consume` intact
        (a multiple of block_tokens; 0 when none did). Blocks handed over past it (a copy
        stopped midway, or the daemon dropped the lease during the copy, so they may have been
        overwritten meanwhile) must be discarded by the caller. `max_blocks` ends the prefix
        after that many blocks (counted from the prompt's start, as `plan(...).load_blocks`
        is). `whole`: the daemon stages the whole prefix before `consume` is called, in one
        round, instead of in windows whose reads overlap the copies: for a `consume` that can
        use no block before it has them all (a layer-by-layer load, whose first layer needs
        every block's). A prefix that host has no room for still comes in rounds; a fetch that
        outlives its deadline keeps nothing of a round not answered yet, where windows keep
        the ones copied. Over TCP, `whole` gives `consume` every block in one call, once all
        have arrived (in a buffer of the whole prefix); without it `consume` gets them in groups
        of about `STREAM_GROUP_BYTES` as they arrive, each copied while the next arrives.
        """
        keys = self.keys(tokens)[: _limit(max_blocks)]
        if skip_blocks < 0:
            raise InvalidArgumentError(f"skip_blocks must be >= 0, got {skip_blocks}")
        if skip_blocks >= len(keys):
            return 0
        until = self._until(len(keys) - skip_blocks, _budget(budget_s))
        progress = _Progress(skip_blocks)
        blocks = await self._guard(
            lambda: progress.unless_fault(
                self._fetch_with(keys, consume, skip_blocks, until, progress, whole)), None,
            until=until)
        if blocks is None:  # cut short: what was copied intact still counts
            blocks = progress.done
        return (blocks if blocks > skip_blocks else 0) * self.layout.block_tokens

    async def publish_with(self, tokens: Tokens, produce: BlockCopy) -> int:
        """Store the full blocks of `tokens`, written by `produce` straight into the daemon's
        shared memory (one copy, no staging tensor). Returns the prompt tokens now cached.

        `produce(blocks, views, stop)` runs in a worker thread with the prompt indices of the
        blocks the daemon lacks and a writable view of each, `[layers, kv, block_tokens, heads,
        head_dim]`: it fills every view. Blocks already stored are not asked for. As with
        `fetch_with`, `stop` is set when the deadline passes; nothing is committed then. Over
        TCP the views are buffers of this process, a group of blocks at a time
        (`STREAM_GROUP_BYTES`), each group streamed while `produce` fills the next; a
        `produce` stopped there still stores the groups streamed before.
        """
        keys = self.keys(tokens)
        if not keys:
            return 0
        until = self._until(len(keys))
        stored = await self._save(len(keys), lambda: self._publish_with(keys, produce, until),
                                  until)
        return stored * self.layout.block_tokens

    async def plan(self, tokens: Tokens, prefill_tokens_per_s: float,
                   bytes_per_token: int | None = None, *,
                   consume_bytes_per_s: float | None = None) -> Plan:
        """Load or recompute: how many blocks of the cached prefix of `tokens` are worth
        loading, given that the engine prefills `prefill_tokens_per_s` tokens/s.

        One `Lookup` says where each cached block is and the daemon's measured read bandwidth
        of those tiers; this client adds its own measured copy rate (every block is copied out
        of the daemon's memory, whatever its tier) and, when given, `consume_bytes_per_s` (the
        engine taking loaded blocks into its cache, e.g. a layout conversion). A block is worth
        loading when that beats recomputing it: `bandwidth > bytes_per_token x prefill speed`
        (`kvstore.planner.plan`). Load `plan.load_blocks` blocks (`fetch(..., max_blocks=)`)
        and compute the rest. At least the last token is always computed.

        `bytes_per_token`: bytes loaded per token; default the layout's. A daemon that is down
        or slow is a plan of 0 blocks (recompute) within the deadline, never an exception.
        """
        none = self._recompute_plan(tokens, prefill_tokens_per_s, bytes_per_token)
        if consume_bytes_per_s is not None and not consume_bytes_per_s > 0:
            raise InvalidArgumentError(f"consume_bytes_per_s must be positive, got "
                                       f"{consume_bytes_per_s}")
        bt = self.layout.block_tokens
        keys = self.keys(tokens)[: max(_count(tokens) - 1, 0) // bt]  # the last token: computed
        if not keys:
            return none
        reply: pb.LookupReply | None = await self._guard(lambda: self._lookup(keys), None)
        if reply is None or reply.hits == 0:
            return none
        tiers = list(reply.tiers)
        bandwidth = end_to_end_bandwidth(tiers, dict(reply.read_bandwidth),
                                         self.copy_bandwidth, consume_bytes_per_s)
        return plan_prefix(tiers, _count(tokens), bt, self._bpt(bytes_per_token),
                           prefill_tokens_per_s, bandwidth)

    @property
    def copy_bandwidth(self) -> float | None:
        """This client's measured copy rate out of the daemon (bytes/s); None until its first
        fetch with hits."""
        return self._copy_rate.bandwidth.get("copy")

    def _observe_copy(self, blocks: int, seconds: float) -> None:
        """`blocks` whole blocks copied (or received) in `seconds`."""
        self._copy_rate.observe("copy", blocks * self.layout.block_bytes, seconds)

    def _bpt(self, bytes_per_token: int | None) -> int:
        return self.layout.bytes_per_token if bytes_per_token is None else bytes_per_token

    def _recompute_plan(self, tokens: Tokens, prefill_tokens_per_s: float,
                        bytes_per_token: int | None) -> Plan:
        """The plan that loads nothing (what a miss is); validates the arguments."""
        if not (isinstance(prefill_tokens_per_s, int | float)
                and math.isfinite(prefill_tokens_per_s) and prefill_tokens_per_s > 0):
            raise InvalidArgumentError(f"prefill_tokens_per_s must be a positive number, got "
                                       f"{prefill_tokens_per_s!r}")
        bpt = self._bpt(bytes_per_token)
        if not isinstance(bpt, int) or bpt <= 0:
            raise InvalidArgumentError(f"bytes_per_token must be a positive int, got {bpt!r}")
        return plan_prefix([], _count(tokens), self.layout.block_tokens, bpt,
                           prefill_tokens_per_s)

    async def end_session(self, tokens: Tokens, shared_tokens: int = 0) -> int:
        """Say that the conversation whose last prompt was `tokens` has ended: the daemon then
        evicts that conversation's own blocks first, keeping room for conversations that go
        on. A hint only: a later use of a block cancels it, nothing is deleted, and a daemon
        that is down or older than this call is a no-op. Returns the blocks marked (once per
        tier holding one). Send it as soon as the conversation is known to be over:
        docs/SCALE.md measures how the hit rate falls as the hint comes later.

        `shared_tokens`: the prompt's first tokens that other conversations share (a system
        prompt, a document several users ask about): their blocks are never marked. The
        daemon stops by itself at a block other conversations' blocks hang from, but it cannot
        see a prefix that others reach with only a partial last block (a short question after
        a shared document): name it here, or the document is evicted first."""
        keys = self.keys(tokens)
        if isinstance(shared_tokens, bool) or not isinstance(shared_tokens, int) \
                or not 0 <= shared_tokens <= _count(tokens):
            raise InvalidArgumentError(f"shared_tokens must be an int in [0, {_count(tokens)}] "
                                       f"(the prompt's tokens), got {shared_tokens!r}")
        keys = keys[shared_tokens // self.layout.block_tokens:]
        if not keys:
            return 0
        async def mark() -> int:  # one call per `_key_limit` keys
            limit = await self._key_limit(len(keys))
            marked = 0
            for start in range(0, len(keys), limit):
                reply: pb.EndSessionReply = await self._unary(
                    "EndSession", pb.EndSessionRequest(keys=keys[start : start + limit]))
                marked += int(reply.marked)
            return marked

        return await self._guard(mark, 0)

    async def stats(self) -> pb.StatsReply | None:
        return await self._guard(lambda: self._unary("Stats", pb.StatsRequest()), None)

    async def clear(self, *, all_namespaces: bool = False) -> int:
        """Remove this namespace's blocks (or every block); returns how many were removed.
        A refusal (a tenant asking for `all_namespaces`) raises `PermissionDeniedError`."""
        req = pb.ClearRequest(all=True) if all_namespaces else pb.ClearRequest(namespace=self._ns)
        reply: pb.ClearReply | None = await self._guard(
            lambda: self._unary("Clear", req), None, admin=True)
        return 0 if reply is None else int(reply.removed)

    async def inspect(self) -> pb.InspectReply | None:
        """Namespaces the daemon holds and their blocks per tier (a TCP tenant: its own)."""
        return await self._guard(lambda: self._unary("Inspect", pb.InspectRequest()), None,
                                 admin=True)

    async def kv_events(self) -> str:
        """The daemon's KV events endpoint ("" when it publishes none, or does not answer),
        asked once a minute: describing blocks is worth a call only when events are on."""
        now = time.monotonic()
        cached = self._kv_events
        if cached is None or now - cached[1] > 60.0:
            info = await self._guard(lambda: self._info(), None)
            cached = self._kv_events = (info.kv_events if info is not None else "", now)
        return cached[0]

    def kv_events_known(self) -> str | None:
        """`kv_events` as last asked, or None when not asked within the minute (ask then)."""
        cached = self._kv_events
        return cached[0] if cached is not None and time.monotonic() - cached[1] <= 60.0 else None

    async def describe_blocks(self, tokens: Tokens, spans: Sequence[EngineBlockSpan]) -> int:
        """Tell a daemon publishing KV events which engine blocks (`spans[i]`) the kvstore
        block `i` of `tokens` covers, so its events name them by the engine's hashes. Costs
        nothing (no call) when the daemon publishes no events. Returns blocks described."""
        keys = self.keys(tokens)[: len(spans)]
        if not keys or not await self.kv_events():
            return 0
        blocks = [pb.EngineBlocks(key=k, block_hashes=s.block_hashes,
                                  parent_block_hash=s.parent_block_hash or b"",
                                  token_ids=s.token_ids, block_size=s.block_size,
                                  lora_name=s.lora_name or "", group_idx=s.group_idx,
                                  kv_cache_spec_kind=s.spec_kind or "",
                                  sliding_window=s.sliding_window or 0)
                  for k, s in zip(keys, spans, strict=False)]

        async def describe() -> int:  # one call per `_key_limit` blocks
            limit = await self._key_limit(len(blocks))
            described = 0
            for start in range(0, len(blocks), limit):
                reply: pb.DescribeBlocksReply = await self._unary(
                    "DescribeBlocks", pb.DescribeBlocksRequest(
                        namespace=self._ns, blocks=blocks[start : start + limit]))
                described += int(reply.described)
            return described

        return await self._guard(describe, 0)

    async def ping(self) -> bool:
        return await self._guard(lambda: self._info(), None) is not None

    async def prepare(self) -> bool:
        """Map the daemon's arena now (same-node clients), rather than in the first fetch or
        publish: an engine calls this at start, so the arena is touched in the background
        before the first copy (see `PREFAULT_ENV`). False when the daemon does not answer."""
        async def attach() -> bool:
            info = await self._info()
            return self.transfer == "stream" or await self._arena_for(info.arena_id) is not None

        return bool(await self._guard(attach, False))

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)
            self._probe = None
        if self._background:  # give abandoned leases a moment to go back (they expire anyway)
            _, pending = await asyncio.wait(self._background, timeout=min(self.deadline_s, 0.5))
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self._drops.pending:
            self._log_drops("before close")
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._stub = None
        self._arena = self._slab = self._left_arena = None
        # Each finished call (a Fetch's stream above all) stays in a reference cycle holding
        # the channel's core object (19 after a test engine's run), and gRPC's asyncio poller
        # thread stops only when the last goes. Collected now, at close, rather than in the
        # interpreter's final collection, where freeing what they hold raced the exit
        # (kvstore/arena.py `_stop_reaper`).
        gc.collect()

    async def __aenter__(self) -> AsyncKVClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- deadlines
    def transfer_bandwidth(self) -> float:
        """Bytes/s a transfer's deadline is planned at: the slowest of the daemon's measured
        disk (and remote) reads and this client's own copy rate, priors where unmeasured."""
        legs = [self._read_bandwidth.get("disk") or DEFAULT_BANDWIDTH["disk"],
                self.copy_bandwidth or DEFAULT_BANDWIDTH["host"]]
        if "remote" in self._read_bandwidth:
            legs.append(self._read_bandwidth["remote"])
        return min(legs)

    def transfer_timeout(self, blocks: int, budget_s: float | None = None) -> float:
        """Seconds a call moving `blocks` blocks may take (see `transfer_deadline`)."""
        return transfer_deadline(blocks * self.layout.block_bytes, self.transfer_bandwidth(),
                                 self.deadline_s, budget_s)

    def _until(self, blocks: int, budget_s: float | None = None) -> float:
        """The event-loop time a transfer of `blocks` blocks must end by."""
        return asyncio.get_running_loop().time() + self.transfer_timeout(blocks, budget_s)

    def _left(self, until: float) -> float:
        return max(until - asyncio.get_running_loop().time(), 1e-3)

    # ---- failure policy
    async def _guard(self, call: Callable[[], Awaitable[T]], miss: T, *,
                     until: float | None = None, admin: bool = False) -> T:
        """Run `call` under its deadline (`until`, else `deadline_s`); any daemon trouble is
        `miss`. `until` leaves a control call's deadline after it, for the release that ends
        a transfer stopped at `until`."""
        ok, result = await self._attempt(call, until=until, admin=admin)
        return result if ok else miss  # type: ignore[return-value]

    async def _attempt(self, call: Callable[[], Awaitable[T]], *, until: float | None = None,
                       admin: bool = False) -> tuple[bool, T | None]:
        """`(True, result)`, or `(False, None)` when the daemon failed or refused the call
        (or the breaker answered for it)."""
        if not self._breaker.allow():
            return False, None
        timeout = self.deadline_s if until is None else self._left(until) + self.deadline_s
        try:
            async with asyncio.timeout(timeout):
                result = await self._within_limit(call)
        except InvalidArgumentError:
            raise
        except _DaemonFault as e:
            self._fault(str(e))
            return False, None
        except grpc.aio.AioRpcError as e:
            if until is not None and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                # A transfer cut at its own deadline (its bytes' time, or what recomputing
                # costs): the daemon is slow for this much data, not gone. No backoff: the
                # next control call tells.
                log.debug("kvstore transfer cut at its deadline: %s", e.details())
                return False, None
            self._failed(e.code(), e.details() or "", admin)
            return False, None
        except _CopyStopped as e:
            log.debug("kvstore copy stopped at its deadline: %s", e)
            return False, None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this task's own cancellation (its caller's): not a failure to hide
            # gRPC cancelled the call itself: a request stream that ended as the call's
            # deadline passed, say. The call failed; the caller gets a miss, not CancelledError.
            log.debug("kvstore call cancelled by gRPC")
            return False, None
        except TimeoutError:
            if until is None:
                self._outage(f"no answer within deadline_s={timeout:g} s", gone=False)
            return False, None
        except (OSError, KVStoreError) as e:
            self._outage(f"{type(e).__name__}: {e}", gone=False)
            return False, None
        self._breaker.success()
        return True, result

    async def _within_limit(self, call: Callable[[], Awaitable[T]]) -> T:
        """`call()`; made once more when the daemon refused it as invalid and its Info now
        gives a lower `max_blocks_per_call` than the client split the call by (a daemon run,
        or restarted, with a smaller limit: see `PRESUMED_MAX_KEYS`). A call goes on from
        where it stopped (a fetch keeps the blocks it copied; a publish's stored blocks are
        not asked for again)."""
        before = self._max_keys or PRESUMED_MAX_KEYS  # what the call may be split by
        try:
            return await call()
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.INVALID_ARGUMENT \
                    or not await self._limit_below(before):
                raise
        return await call()

    async def _limit_below(self, limit: int) -> bool:
        """Ask the daemon's `max_blocks_per_call` again; whether it is lower than `limit`."""
        try:
            await self._info()
        except grpc.aio.AioRpcError:
            return False
        return (self._max_keys or PRESUMED_MAX_KEYS) < limit

    async def _key_limit(self, n: int) -> int:
        """Keys one call may name, for a call that would name `n`: the daemon's limit as its
        latest Info said, else `PRESUMED_MAX_KEYS`, asking Info first (once) when `n` is more
        than that."""
        if not self._max_keys and n > PRESUMED_MAX_KEYS:
            await self._info()
        return self._max_keys or PRESUMED_MAX_KEYS

    async def _span(self, keys: list[bytes], start: int) -> tuple[list[bytes], list[bytes]]:
        """`(keys, prior_keys)` of one call from block `start` of a prompt: every key from
        `start` on and every one before it, where the daemon takes them all in one call;
        else as many as it takes (its limit counts `prior_keys` too): the first call a full
        limit of keys, each later one half a limit of new keys after the half limit just
        before them (the daemon keeps those in host and ranks them with the new ones)."""
        limit = await self._key_limit(len(keys))
        if len(keys) <= limit:
            return keys[start:], keys[:start]
        n = min(len(keys) - start, max(1, limit - min(start, limit // 2)))
        prior = min(start, limit - n)
        return keys[start : start + n], keys[start - prior : start]

    def _fault(self, what: str) -> None:
        """A reply inconsistent with its request (`_DaemonFault`): counted, a miss; the first
        logged as a warning, the rest at debug."""
        self.daemon_faults += 1
        self._breaker.success()  # it answered: not an outage
        if self.daemon_faults == 1:
            log.warning("kvstore daemon at %s sent a reply inconsistent with its request (%s); "
                        "a miss (further ones are logged at debug level, counted in "
                        "daemon_faults)", self.target, what)
        else:
            log.debug("kvstore daemon fault: %s", what)

    def _failed(self, code: grpc.StatusCode, details: str, admin: bool) -> None:
        """A call the daemon failed: an outage (back off), or a refusal of this call only."""
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise InvalidArgumentError(f"daemon rejected the request: {details}") from None
        if code in _OUTAGE:
            self._outage(f"{code.name}: {details}", gone=code == grpc.StatusCode.UNAVAILABLE)
            return
        if admin and code == grpc.StatusCode.PERMISSION_DENIED:
            raise PermissionDeniedError(f"daemon refused the call: {details}") from None
        if admin and code == grpc.StatusCode.UNAUTHENTICATED:
            raise AuthError(f"daemon refused the call: {details}") from None
        self._breaker.success()  # it answered: whatever outage there was is over
        if code in _ROUTINE or code in self._refusals_logged:
            log.debug("kvstore call refused: %s %s", code.name, details)
        else:
            self._refusals_logged.add(code)
            log.warning("kvstore daemon at %s refused a call (%s: %s); a miss (further %s "
                        "refusals are logged at debug level)", self.target, code.name,
                        details, code.name)

    def _outage(self, what: str, *, gone: bool) -> None:
        """The daemon did not answer. `gone`: it refused the connection (stopped or
        restarting), so a cheap probe finds it back; else it is slow, and only the backoff
        tries it again (each try costs a deadline)."""
        self._arena_id = ""  # the daemon may come back with another arena
        if gone:
            # Let go of the dead daemon's arena, but keep it mapped until the daemon is back
            # (`_arena_for`): a successor that took it over serves the same file. Keeping it
            # holds no memory otherwise: a daemon that does not leave its arena frees its
            # pages at shutdown, and the pages of one that died are freed by the next
            # daemon's start (`Arena.remove_stale`), mapped or not.
            self._left_arena = self._arena or self._left_arena
            self._arena = self._slab = None
        self._breaker.failure(what)
        if gone and (self._probe is None or self._probe.done()):
            self._probe = asyncio.get_running_loop().create_task(self._probe_until_back())

    async def _probe_until_back(self) -> None:
        """While the daemon is gone: an `Info` call every `probe_s` (it waits for the channel
        to reconnect, at most `PROBE_TIMEOUT_S`); the first answer lets calls through again."""
        policy = self._breaker.policy
        while self._breaker.open:
            await asyncio.sleep(policy.probe_s)
            try:
                await self._stub_().Info(pb.InfoRequest(),
                                         timeout=min(self.deadline_s, PROBE_TIMEOUT_S),
                                         metadata=self._metadata, wait_for_ready=True)
            except grpc.aio.AioRpcError:
                continue
            self._breaker.answered()
            return

    # ---- saves
    async def _save(self, blocks: int, call: Callable[[], Awaitable[int]], until: float,
                    ) -> int:
        """Run a publish of `blocks` blocks; count and log it when it stores fewer."""
        ok, stored = await self._attempt(call, until=until)
        stored = stored if ok and stored is not None else 0
        if stored < blocks:
            why = ("the daemon was unavailable" if not ok and self._breaker.open
                   else "the call failed or ran past its deadline" if not ok
                   else "the daemon lacked space" if self.transfer != "stream"
                   # over TCP the blocks before a copy stopped at its deadline are stored
                   else "the daemon lacked space, or a copy ran past its deadline")
            self._dropped(blocks - stored, blocks, why)
        return stored

    @property
    def dropped_saves(self) -> int:
        """Saves (`publish`, `publish_with`) that stored fewer blocks than asked: the daemon
        was down, slow or full, or the copy ran past its deadline."""
        return self._drops.total

    def _dropped(self, missing: int, blocks: int, why: str) -> None:
        self.dropped_blocks += missing
        if not self._drops.count():
            return
        if self._drops.first:
            self._drops.logged()
            log.warning("kvstore: a save was dropped: %d of %d blocks not stored (%s); dropped "
                        "saves are counted and summarised here at most every %.0f s",
                        missing, blocks, why, DROP_LOG_S)
        else:
            self._log_drops(f"last: {why}")

    def _log_drops(self, note: str) -> None:
        covered, since = self._drops.logged()
        log.warning("kvstore: %d saves dropped in the last %.0f s (%d saves, %d blocks in all; "
                    "%s)", covered, since, self.dropped_saves, self.dropped_blocks, note)

    # ---- transport
    def _stub_(self) -> pb_grpc.KVStoreStub:
        if self._stub is None:
            opts = [("grpc.max_receive_message_length", self._max_msg),
                    ("grpc.max_send_message_length", self._max_msg),
                    ("grpc.initial_reconnect_backoff_ms", 50),
                    # A restarted daemon is reconnected to within this; reconnecting to a
                    # Unix socket, or a refused TCP port, costs next to nothing.
                    ("grpc.max_reconnect_backoff_ms", 250),
                    # Own subchannels: gRPC otherwise shares them across a process's channels,
                    # and a new client would inherit an old one's reconnect backoff (instant
                    # misses for up to a second after a daemon restart).
                    ("grpc.use_local_subchannel_pool", 1),
                    ("grpc.enable_retries", 0)]
            self._channel = grpc.aio.insecure_channel(self.target, options=opts)
            self._stub = pb_grpc.KVStoreStub(self._channel)
        return self._stub

    async def _unary(self, method: str, request: object,
                     until: float | None = None) -> T:
        """A unary call: a control call's deadline, or until `until` (a transfer's)."""
        fn = getattr(self._stub_(), method)
        timeout = self.deadline_s if until is None else self._left(until)
        return cast(T, await fn(request, timeout=timeout, metadata=self._metadata))

    async def _info(self) -> pb.InfoReply:
        reply: pb.InfoReply = await self._unary("Info", pb.InfoRequest())
        if reply.max_blocks_per_call:
            self._max_keys = int(reply.max_blocks_per_call)
        return reply

    async def _lookup(self, keys: list[bytes], prefetch: bool = False) -> pb.LookupReply:
        """The longest cached prefix of `keys`: one Lookup, or one per `_key_limit` keys in
        order, stopping after the first not hit in full (their replies as one)."""
        limit = await self._key_limit(len(keys))
        out = pb.LookupReply()
        for start in range(0, len(keys), limit):
            part = keys[start : start + limit]
            request = pb.LookupRequest(namespace=self._ns, keys=part)
            if prefetch:
                request.prefetch = True
                request.layout.CopyFrom(self._layout_pb)
            reply: pb.LookupReply = await self._unary("Lookup", request)
            if reply.hits > len(part) or len(reply.tiers) > reply.hits:
                raise _DaemonFault(f"a lookup of {len(part)} keys answered {reply.hits} hits "
                                   f"in {len(reply.tiers)} tiers")
            if len(keys) <= limit:
                self._read_bandwidth.update(reply.read_bandwidth)
                return reply
            out.hits += reply.hits
            out.tiers.extend(reply.tiers)
            out.read_bandwidth.update(reply.read_bandwidth)
            if reply.hits < len(part):
                break
        self._read_bandwidth.update(out.read_bandwidth)
        return out

    async def _lookup_each(self, keys: list[bytes]) -> pb.LookupReply:
        """`held`'s probe: one Lookup with `each`, or one per `_key_limit` keys (their flags
        as one reply; none when a reply has no flag per key: a daemon older than `each`)."""
        limit = await self._key_limit(len(keys))
        found: list[bool] = []
        for start in range(0, len(keys), limit):
            part = keys[start : start + limit]
            request = pb.LookupRequest(namespace=self._ns, keys=part, each=True)
            reply: pb.LookupReply = await self._unary("Lookup", request)
            if len(reply.found) != len(part):
                return pb.LookupReply()  # `held` asks block by block
            found += reply.found
        leading = found.index(False) if False in found else len(found)
        return pb.LookupReply(hits=leading, found=found)

    async def _writer_name(self) -> str:
        """This process's writer lock for a Reserve (`kvstore.writer_lock`); asks Info where
        the arena lies the first time, if no arena is mapped yet."""
        if self._writer is None:
            info = await self._info()
            self._writer = writer_lock(os.path.dirname(info.arena_path)) if info.arena_path else ""
        return self._writer

    async def _arena_for(self, arena_id: str) -> Arena | None:
        """The mapped arena named `arena_id`, (re)attaching after a daemon restart."""
        if self._arena is not None and self._arena_id == arena_id:
            return self._arena
        info = await self._info()
        if info.arena_id != arena_id:
            return None  # restarted again under us: treat as a miss
        try:
            self._arena = _shared_arena(info.arena_path, info.arena_bytes)
        except (OSError, ValueError) as e:
            log.warning("cannot map the daemon's arena %s (%s); streaming instead",
                        info.arena_path, e)
            self.transfer = "stream"
            keep_large_buffers()
            return None
        self._arena_id = arena_id
        self._left_arena = None  # the same mapping as `_arena` where it was taken over
        self._writer = writer_lock(os.path.dirname(info.arena_path))
        self._slab = map_slab(info.slab) if info.HasField("slab") else None
        self._slab_id = info.slab.id if self._slab is not None else ""
        return self._arena

    async def _copy(self, fn: Callable[..., int | None], blocks: int, *args: object,
                    until: float | None = None, save: bool = False) -> int:
        """Run a copy of `blocks` blocks between the arena and a tensor in a worker thread,
        cancellably; returns how many leading blocks it copied in full. `save`: a publish's
        copy, run at a lower CPU priority (`KVSTORE_SAVE_NICE`).

        At `until` the copy is told to stop (`stop` is set) and returns what it finished: the
        caller keeps that prefix. A cancelled call stops the copy the same way and waits for
        the thread before unwinding: right after, the lease ends and its arena slots can be
        handed to another caller, and the caller may reuse its tensor. A copy left running
        would read another block into a result already reported as a miss, or write a dead
        reservation's bytes over someone else's block.
        """
        stop = threading.Event()
        loop = asyncio.get_running_loop()
        timer = loop.call_at(until, stop.set) if until is not None else None
        fut = loop.run_in_executor(_save_executor() if save else None,
                                   functools.partial(_copies.run, fn, *args, stop))
        try:
            done = await asyncio.shield(fut)
        except asyncio.CancelledError:
            stop.set()
            await wait_out(fut)
            raise
        finally:
            if timer is not None:
                timer.cancel()
        if done is None and stop.is_set():
            # Told to stop, and it did not say how far it got ("None: all"): a callback that
            # returns early without counting would have its unwritten blocks taken as copied
            # (garbage K/V loaded, or committed and served to others). Trust none of them.
            return 0
        return blocks if done is None else max(0, min(int(done), blocks))

    async def _leased(self, call: Awaitable[R], lease_of: Callable[[R], int]) -> R:
        """Await a reply that hands this client a lease. If the caller is cancelled first, the
        call still completes in the background and the lease it brings is released: the
        daemon has often granted it already, and would otherwise hold its blocks until
        `lease_timeout_s`. (The call's own deadline bounds the background part.)"""
        task = asyncio.ensure_future(call)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            def orphaned(t: asyncio.Future[R]) -> None:
                if not t.cancelled() and t.exception() is None and (lease := lease_of(t.result())):
                    self._release_later(lease)

            task.add_done_callback(orphaned)
            self._keep(task)
            raise

    def _release_later(self, lease_id: int) -> None:
        """Release a lease of a call that failed or was cancelled, without waiting for the
        daemon (which may be the reason it failed); an unreleased lease expires anyway."""

        async def release() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
                # Nobody waits on it, so it may take longer than a call's deadline.
                await self._stub_().Release(pb.ReleaseRequest(lease_id=lease_id),
                                            timeout=max(self.deadline_s, 1.0),
                                            metadata=self._metadata)

        self._keep(asyncio.get_running_loop().create_task(release()))

    def _keep(self, task: asyncio.Future[Any]) -> None:
        """Hold a background task until it ends (`close` waits a moment for them)."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _piece_blocks(self) -> int:
        """Blocks per piece of a cancellable copy."""
        return max(1, COPY_PIECE_BYTES // self.layout.block_bytes)

    def _runs(self, arena: Arena, blocks: list[int], refs: list[pb.BlockRef],
              slab: torch.Tensor | None = None) -> list[tuple[torch.Tensor, int]]:
        """Pair arena (or slab) views with prompt positions, merging blocks that are adjacent
        both in that memory and in the prompt (the usual case): one large copy per run instead
        of one per block, which torch spreads over all cores.

        Returns (arena view `[L, kv, n, T, H, D]` over the run, index of its first block).
        """
        pairs: list[tuple[torch.Tensor, int]] = []
        i = 0
        shape = self.layout.block_shape
        while i < len(refs):
            j = i + 1
            while (j < len(refs) and blocks[j] == blocks[j - 1] + 1
                   and refs[j].in_slab == refs[j - 1].in_slab
                   and refs[j].offset == refs[j - 1].offset + refs[j - 1].length):
                j += 1
            raw = _memory(arena, slab, refs[i])[
                refs[i].offset : refs[j - 1].offset + refs[j - 1].length]
            view = raw.view(self.layout.torch_dtype).view(j - i, *shape)
            # [n, L, kv, T, H, D] -> [L, kv, n, T, H, D] -> tokens of the run in order
            pairs.append((view.permute(1, 2, 0, 3, 4, 5), blocks[i]))
            i = j
        return pairs

    def _prompt_view(self, t: torch.Tensor, first: int, n: int) -> torch.Tensor:
        """`t[:, :, first*T:(first+n)*T]` as `[L, kv, n, T, H, D]`."""
        bt = self.layout.block_tokens
        part = t[:, :, first * bt : (first + n) * bt]
        return torch.unflatten(part, 2, (n, bt))

    def _tokens_slice(self, i: int) -> slice:
        bt = self.layout.block_tokens
        return slice(i * bt, (i + 1) * bt)

    def _new_out(self, blocks: int) -> torch.Tensor:
        return torch.empty(self.layout.kv_shape(blocks * self.layout.block_tokens),
                           dtype=self.layout.torch_dtype)

    def _kept(self, blocks: int, out: torch.Tensor | None) -> tuple[int, torch.Tensor | None]:
        """`fetch`'s result for the first `blocks` blocks of `out` (a miss when none)."""
        if blocks == 0 or out is None:
            return 0, None
        tokens = blocks * self.layout.block_tokens
        return tokens, out[:, :, :tokens]

    async def _fetch(self, keys: list[bytes], out: list[torch.Tensor | None], until: float,
                     progress: _Progress) -> tuple[int, torch.Tensor | None]:
        """Fetch into `out[0]` (allocated for every block on first need); `progress` follows
        the blocks copied intact, for a fetch cut short."""
        if self.transfer == "stream":
            while progress.done < len(keys):
                n, more, out[0] = await self._fetch_some(keys, progress.done, out[0], until)
                progress.done += n
                if not more or n == 0:
                    break
        else:
            async def take(arena: Arena, slab: torch.Tensor | None, head: pb.FetchChunk,
                           first: int) -> int:
                if out[0] is None:  # sized for every block asked for: later windows fill the rest
                    out[0] = self._new_out(len(keys))
                return await self._copy(self._copy_out, len(head.blocks), arena, slab,
                                        list(head.blocks), out[0], first, until=until)

            await self._windows(keys, take, until, progress)
        return self._kept(progress.done, out[0])

    async def _windows(self, keys: list[bytes],
                       take: _Take,
                       until: float, progress: _Progress, whole: bool = False) -> None:
        """Same-node fetch of `keys[progress.done:]`, advancing `progress.done` past every
        window copied intact. The daemon answers a window at a time (it stops after
        `fetch_window_bytes` of disk or remote reads, or when its staging space runs out, with
        `more` set); the rest is asked for before `take` copies the current window, so the
        daemon's reads overlap this client's copy. `take(arena, slab, head, first)` copies `head`'s
        blocks, the first being block `first` of `keys`, and returns how many leading ones it
        copied in full (fewer when it stopped at `until`); the lease is released here, and a
        lease that ended during the copy makes that window a miss (its blocks may have been
        overwritten meanwhile). `whole`: no windows (`AsyncKVClient.fetch_with`)."""
        # The prefault waits for the whole fetch, not only for its copies: the daemon reads a
        # disk or remote hit into arena pages that the prefault may be touching for the
        # first time at that moment, and the read waited for it. The first fetch after a
        # daemon restart (a fresh arena), 256 MiB from disk, took up to 2.16 s when only the
        # copies held it, 0.14-0.27 s now (`benchmarks.restart_fetch`, PERFORMANCE.md).
        with _copies.held():
            ahead: asyncio.Future[pb.FetchChunk] | None = asyncio.ensure_future(
                self._fetch_head(keys, progress.done, until=until, whole=whole))
            overlapped = False  # `ahead` was asked for while this client held the window before
            try:
                while ahead is not None:
                    head = await ahead
                    ahead = None
                    if head.hits == 0 and overlapped:
                        # Asked for while the previous window was pinned: the daemon may have
                        # lacked staging space for both. Ask again, now that it is released.
                        head = await self._fetch_head(keys, progress.done, until=until,
                                                      whole=whole)
                    n = head.hits
                    if n == 0:
                        break
                    overlapped = head.more and progress.done + n < len(keys)
                    if overlapped:
                        ahead = asyncio.ensure_future(
                            self._fetch_head(keys, progress.done + n, until=until,
                                             whole=whole))
                    got = await self._take_leased(head, progress.done, take)
                    progress.done += got
                    if got < n:
                        break
            finally:
                if ahead is not None:
                    self._drop_head(ahead)

    async def _fetch_head(self, keys: list[bytes], start: int, until: float | None = None,
                          whole: bool = False) -> pb.FetchChunk:
        """One SHM Fetch of `keys[start:]`: its header (with a lease when it hit). The daemon
        reads a window of disk or remote hits before it answers: the transfer's deadline."""
        # `prior_keys`: the blocks before `start`, which the daemon then keeps in host rather
        # than evict to make room for the rest (a prompt larger than its host tier).
        part, prior = await self._span(keys, start)
        req = pb.FetchRequest(namespace=self._ns, layout=self._layout_pb, keys=part,
                              transfer=pb.TRANSFER_SHM, prior_keys=prior,
                              slab_ok=self._slab is not None, whole=whole)
        timeout = self.deadline_s if until is None else self._left(until)
        call = self._stub_().Fetch(req, timeout=timeout, metadata=self._metadata)
        head: pb.FetchChunk = await self._leased(anext(call.__aiter__()), lambda h: h.lease_id)
        try:
            self._check_head(head, len(part), shm=True)
        except _DaemonFault:
            if head.lease_id:
                self._release_later(head.lease_id)
            raise
        if head.hits == len(part) and start + len(part) < len(keys):
            head.more = True  # a call of part of the prompt, hit in full: ask for the rest
        return head

    def _check_head(self, head: pb.FetchChunk, asked: int, shm: bool) -> None:
        """A fetch reply's header, checked against its request: no more blocks than asked
        for; over SHM, one ref per block, each a block of the layout (`_DaemonFault`)."""
        if head.hits > asked:
            raise _DaemonFault(f"a fetch of {asked} blocks answered {head.hits}")
        if shm and (len(head.blocks) != head.hits
                    or any(r.length != self.layout.block_bytes for r in head.blocks)):
            raise _DaemonFault(f"a fetch answered {head.hits} blocks with "
                               f"{len(head.blocks)} refs, not all of the layout's "
                               f"{self.layout.block_bytes} bytes")

    def _drop_head(self, ahead: asyncio.Future[pb.FetchChunk]) -> None:
        """Give back a window asked for ahead but not taken (the fetch ended before it)."""
        if not ahead.done():
            ahead.cancel()  # `_leased` releases a lease that arrives after the cancellation
            ahead.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._keep(ahead)
        elif not ahead.cancelled() and ahead.exception() is None and ahead.result().lease_id:
            self._release_later(ahead.result().lease_id)

    async def _take_leased(self, head: pb.FetchChunk, first: int,
                           take: _Take) -> int:
        """Copy a leased window with `take`, then release it; returns the leading blocks
        copied intact (0 when the copy cannot be trusted: no arena, or the lease ended before
        the copy did)."""
        released = False
        try:
            arena = await self._arena_for(head.arena_id)
            if arena is None:
                return 0
            # This window's slab, whatever a concurrent call does to `self._slab` meanwhile.
            slab = self._slab.tensor if self._slab is not None else None
            if any(ref.in_slab for ref in head.blocks) and (
                    slab is None or head.slab_id != self._slab_id):
                return 0  # a slab this client no longer maps (the daemon restarted): a miss
            for ref in head.blocks:
                if ref.offset + ref.length > _memory(arena, slab, ref).numel():
                    raise _DaemonFault(f"a block at {ref.offset}+{ref.length}, past the end "
                                       f"of the {'slab' if ref.in_slab else 'arena'}")
            began = time.perf_counter()
            got = await take(arena, slab, head, first)
            self._observe_copy(got, time.perf_counter() - began)
            reply: pb.ReleaseReply = await self._unary(
                "Release", pb.ReleaseRequest(lease_id=head.lease_id))
            released = True
        finally:
            if not released:
                self._release_later(head.lease_id)
        if not reply.released:
            # The lease expired (or the daemon restarted) before the copy ended: its blocks
            # were unpinned meanwhile and may have been overwritten. A miss.
            log.warning("fetch lease %d ended before the copy finished; a miss", head.lease_id)
            return 0
        return got

    async def _fetch_some(self, keys: list[bytes], start: int, out: torch.Tensor | None,
                          until: float) -> tuple[int, bool, torch.Tensor | None]:
        """Streamed fetch (TCP) from block `start` on, into `out` (allocated for all keys on
        first need)."""
        _, stream, head = await self._fetch_stream(keys, start, until)
        n = head.hits
        if n == 0:
            return 0, False, out
        if out is None:
            out = self._new_out(len(keys))
        began = time.perf_counter()
        await self._receive(stream, n, out, start)
        self._observe_copy(n, time.perf_counter() - began)
        return n, head.more, out

    async def _fetch_stream(self, keys: list[bytes], start: int, until: float,
                            ) -> tuple[grpc.aio.UnaryStreamCall[Any, pb.FetchChunk],
                                       AsyncIterator[pb.FetchChunk], pb.FetchChunk]:
        """A streamed Fetch (TCP) of `keys[start:]`: the call, its messages, and the first
        (the hits). The stream holds the daemon's lease on the blocks until it ends."""
        part, prior = await self._span(keys, start)
        req = pb.FetchRequest(namespace=self._ns, layout=self._layout_pb, keys=part,
                              transfer=pb.TRANSFER_STREAM, prior_keys=prior)
        call = self._stub_().Fetch(req, timeout=self._left(until), metadata=self._metadata)
        stream: AsyncIterator[pb.FetchChunk] = call.__aiter__()
        try:
            head = await anext(stream)
            self._check_head(head, len(part), shm=False)
        except BaseException:
            call.cancel()  # ends the daemon's lease with the stream
            raise
        if head.hits == len(part) and start + len(part) < len(keys):
            head.more = True  # a call of part of the prompt, hit in full: ask for the rest
        return call, stream, head

    async def _stream_groups(self, keys: list[bytes], consume: BlockCopy, until: float,
                             progress: _Progress) -> bool:
        """One streamed Fetch of `keys[progress.done:]`: each group of blocks received
        (`STREAM_GROUP_BYTES`) is handed to `consume` while the next one arrives, in the other
        of two buffers; `progress.done` advances past each group consumed intact. Returns
        whether the daemon has more of the prefix to send (it answers in rounds) and every
        block of this round was consumed."""
        start = progress.done
        call, stream, head = await self._fetch_stream(keys, start, until)
        n = head.hits
        if n == 0:
            return False
        size, group = self.layout.block_bytes, _group_blocks(self.layout)
        raw = [_stream_buffers.take(group * size) for _ in range(2)]
        shape = self.layout.kv_shape(group * self.layout.block_tokens)
        buffers = [b.view(self.layout.torch_dtype).view(shape) for b in raw]
        copying: tuple[asyncio.Future[int], int] | None = None  # a group's copy, its blocks

        async def settled() -> bool:
            """Wait for the copy in flight; whether it copied its whole group."""
            nonlocal copying
            if copying is None:
                return True
            got = await asyncio.shield(copying[0])  # cancelled, this still counts it: below
            progress.done += got
            done, copying = copying[1], None
            return got == done

        began = time.perf_counter()
        block, filled, first, side = 0, 0, 0, 0  # `first`: the block buffers[side] starts at
        try:
            planes = self._own_planes(buffers[side], 0)
            async for chunk in stream:
                if block == n:
                    raise _DaemonFault(f"a fetch stream sent data past the {n} blocks "
                                       "announced")
                filled = _place_chunk(chunk, block, filled, size, planes)
                if filled < size:
                    continue
                block, filled = block + 1, 0
                if block - first == group or block == n:  # a group is here: hand it over
                    if not await settled():
                        return False
                    views = [self._prompt_view(buffers[side], j, 1)[:, :, 0]
                             for j in range(block - first)]
                    blocks = list(range(start + first, start + block))
                    copying = (asyncio.ensure_future(self._copy(
                        consume, len(blocks), blocks, views, until=until)), len(blocks))
                    side, first = 1 - side, block
                if block < n:
                    planes = self._own_planes(buffers[side], block - first)
            if block != n:
                raise _DaemonFault(f"fetch stream ended after {block} of {n} blocks")
            self._observe_copy(n, time.perf_counter() - began)
            return await settled() and head.more
        finally:
            # Cut short (the daemon went away, the stream broke, the caller was cancelled):
            # the copy in flight ends before its buffer is reused (at `until` at the latest),
            # and the group it copied whole still counts; its bytes had all arrived.
            call.cancel()  # the daemon stops sending and ends the lease (no-op once ended)
            try:
                if copying is not None:
                    await wait_out(copying[0])
            finally:
                if copying is not None and not copying[0].cancelled() \
                        and copying[0].exception() is None:
                    progress.done += copying[0].result()
                for b in raw:
                    _stream_buffers.give(b)

    def _copy_out(self, arena: Arena, slab: torch.Tensor | None, refs: list[pb.BlockRef],
                  out: torch.Tensor, start: int, stop: threading.Event) -> int:
        """Copy `refs` into blocks `start...` of `out`; returns the blocks copied (a prefix)."""
        blocks = list(range(start, start + len(refs)))
        copied = 0
        for view, first in self._runs(arena, blocks, refs, slab):
            step = self._piece_blocks()
            for j in range(0, view.shape[2], step):
                if stop.is_set():
                    return copied
                part = view[:, :, j : j + step]
                self._prompt_view(out, first + j, part.shape[2]).copy_(part)
                copied += part.shape[2]
        return copied

    async def _receive(self, stream: AsyncIterator[pb.FetchChunk], n: int,
                       out: torch.Tensor, start: int) -> None:
        size = self.layout.block_bytes
        block, filled = 0, 0
        # A block goes straight into its place in `out` (no staging copy between), unless
        # `out` is laid out otherwise (a caller's `into`, token-major say): then through one
        # block of staging, copied into `out` as it completes.
        stage: np.ndarray | None = None
        staged: torch.Tensor | None = None

        def planes_of(b: int) -> np.ndarray:
            nonlocal stage, staged
            rows = self._block_planes(out, start + b)
            if rows is not None:
                return rows
            if stage is None:  # contiguous `[L, kv, T, H, D]`: a (layer, K/V) plane per row
                staged = torch.empty(self.layout.block_shape, dtype=self.layout.torch_dtype)
                stage = staged.view(torch.uint8).reshape(staged.shape[0] * staged.shape[1],
                                                         -1).numpy()
            return stage

        planes = planes_of(0)
        async for chunk in stream:
            if block == n:
                raise _DaemonFault(f"a fetch stream sent data past the {n} blocks announced")
            filled = _place_chunk(chunk, block, filled, size, planes)
            if filled == size:
                if staged is not None and planes is stage:
                    out[:, :, self._tokens_slice(start + block)].copy_(staged)
                block, filled = block + 1, 0
                if block < n:
                    planes = planes_of(block)
        if block != n:
            raise _DaemonFault(f"fetch stream ended after {block} of {n} blocks")

    def _own_planes(self, buffer: torch.Tensor, i: int) -> np.ndarray:
        """`_block_planes` of a buffer of this client's (contiguous: never None)."""
        rows = self._block_planes(buffer, i)
        if rows is None:
            raise KVStoreError("a stream buffer is not laid out as [L, kv, tokens, H, D]")
        return rows

    def _block_planes(self, out: torch.Tensor, i: int) -> np.ndarray | None:
        """Block `i`'s place in `out` (`[L, kv, tokens, H, D]`) as the rows its bytes fill
        in order: one per (layer, K/V) plane, each `block_tokens * H * D` elements long and
        contiguous in `out`, as uint8 (a view: writing it writes `out`). None where `out`'s
        memory is not laid out so (another order of its dimensions, or strides between)."""
        try:
            region = out[:, :, self._tokens_slice(i)].view(torch.uint8)
            rows = region.flatten(2).flatten(0, 1)  # a copy where no view can be made
        except RuntimeError:  # `view(uint8)`: its last dimension is not contiguous
            return None
        if rows.data_ptr() != region.data_ptr() or rows.stride(0) != region.stride(1) \
                or rows.stride(1) != 1:
            return None
        return rows.numpy()

    async def _publish(self, keys: list[bytes], kv: torch.Tensor, until: float) -> int:
        if self.transfer == "stream":
            return await self._publish_stream(keys, kv, until)

        async def write(arena: Arena, todo: list[int], refs: list[pb.BlockRef]) -> None:
            got = await self._copy(self._copy_in, len(todo), arena, todo, refs, kv,
                                   until=until, save=True)
            if got < len(todo):
                raise _CopyStopped(f"publish wrote {got} of {len(todo)} blocks")

        return await _in_rounds(len(keys), 0,
                                lambda d: self._reserve_write(keys, d, write, until))

    async def _reserve_write(
            self, keys: list[bytes], start: int,
            write: Callable[[Arena, list[int], list[pb.BlockRef]], Awaitable[None]],
            until: float) -> tuple[int, bool]:
        """Reserve from block `start` on, `write(arena, todo, refs)` the blocks the daemon
        lacks (prompt indices `todo`, arena offsets `refs`), commit; returns (blocks covered,
        more). A write that fails or is cancelled gives its reservation back. Reserve may make
        room by writing other blocks to disk: it has the transfer's deadline."""
        writer = await self._writer_name()  # its first time, Info: the daemon's limit too
        part, prior = await self._span(keys, start)
        reply: pb.ReserveReply = await self._leased(self._unary(
            "Reserve", pb.ReserveRequest(namespace=self._ns, layout=self._layout_pb,
                                         keys=part, prior_keys=prior, writer=writer), until),
            lambda r: r.lease_id)
        # A call of part of the prompt, covered in full: the rest in the next round.
        more = reply.more or (len(reply.needed) == len(part) and start + len(part) < len(keys))
        if len(reply.needed) > len(part):
            if reply.lease_id:
                self._release_later(reply.lease_id)
            raise _DaemonFault(f"a reserve of {len(part)} blocks answered "
                               f"{len(reply.needed)}")
        if not reply.lease_id:  # nothing to write: every block is stored or being written
            return len(reply.needed), more
        committed = False
        try:
            arena = await self._arena_for(reply.arena_id)
            if arena is None:
                return 0, False
            todo = [start + i for i, needed in enumerate(reply.needed) if needed]
            if len(reply.blocks) != len(todo) or any(
                    r.in_slab or r.length != self.layout.block_bytes
                    or r.offset + r.length > arena.size for r in reply.blocks):
                raise _DaemonFault(f"a reserve of {len(todo)} blocks answered "
                                   f"{len(reply.blocks)} refs, not all of the layout's "
                                   f"{self.layout.block_bytes} bytes within the arena")
            await write(arena, todo, list(reply.blocks))
            await self._unary("Commit", pb.CommitRequest(lease_id=reply.lease_id))
            committed = True
        finally:
            if not committed:
                self._release_later(reply.lease_id)
        return len(reply.needed), more

    def _copy_in(self, arena: Arena, todo: list[int], refs: list[pb.BlockRef],
                 kv: torch.Tensor, stop: threading.Event) -> int:
        """Copy blocks `todo` of `kv` into `refs`; returns the blocks copied (a prefix)."""
        copied = 0
        for view, first in self._runs(arena, todo, refs):
            step = self._piece_blocks()
            for j in range(0, view.shape[2], step):
                if stop.is_set():
                    return copied
                part = view[:, :, j : j + step]
                part.copy_(self._prompt_view(kv, first + j, part.shape[2]))
                copied += part.shape[2]
        return copied

    async def _publish_stream(self, keys: list[bytes], kv: torch.Tensor, until: float) -> int:
        """`kv`'s blocks over TCP, through the same groups as `publish_with`'s."""
        def produce(blocks: list[int], views: list[torch.Tensor], stop: threading.Event,
                    ) -> int:
            for i, (b, view) in enumerate(zip(blocks, views, strict=True)):
                if stop.is_set():
                    return i
                view.copy_(kv[:, :, self._tokens_slice(b)])
            return len(blocks)

        return await self._publish_with_stream(keys, produce, until)

    async def _publish_with_stream(self, keys: list[bytes], produce: BlockCopy,
                                   until: float) -> int:
        """Over TCP: the blocks the daemon lacks, filled by `produce` a group at a time
        (`STREAM_GROUP_BYTES`) into two pooled buffers, each group streamed while the next is
        filled. The daemon commits each block as its last byte arrives, so a `produce` stopped
        part-way (its deadline) still stores the blocks before the one it stopped in.
        A prompt of more blocks than the daemon takes in one call goes in consecutive
        streams (`_span`), each after the one before stored all of its blocks."""
        done = (await self._lookup(keys)).hits
        while done < len(keys):
            part, prior = await self._span(keys, done)
            end = done + len(part)
            done += await self._publish_stream_part(keys, done, end, prior, produce, until)
            if done < end:
                break
        return done

    async def _publish_stream_part(self, keys: list[bytes], have: int, end: int,
                                   prior: list[bytes], produce: BlockCopy,
                                   until: float) -> int:
        """One Publish stream of blocks `[have, end)` of `keys` (`_publish_with_stream`);
        returns how many of them the daemon has now (stored, or there already)."""
        size, group = self.layout.block_bytes, _group_blocks(self.layout)
        raw = [_stream_buffers.take(group * size) for _ in range(2)]
        # Block-major: each block's bytes contiguous, in the order the stream sends them.
        buffers = [b.view(self.layout.torch_dtype).view(group, *self.layout.block_shape)
                   for b in raw]
        starts = list(range(have, end, group))
        sent = 0  # blocks streamed whole
        filling: asyncio.Future[int] | None = None
        ended = False  # the call is over: its buffers may be another transfer's from now on
        failed: list[Exception] = []  # `produce` raised: the caller's bug, raised to it below

        def fill(g: int) -> asyncio.Future[int]:
            blocks = list(range(starts[g], min(starts[g] + group, end)))
            views = [buffers[g % 2][j] for j in range(len(blocks))]
            return asyncio.ensure_future(self._copy(produce, len(blocks), blocks, views,
                                                    until=until, save=True))

        async def messages() -> AsyncIterator[pb.PublishChunk]:
            nonlocal filling, sent
            yield pb.PublishChunk(namespace=self._ns, layout=self._layout_pb,
                                  keys=keys[have:end], prior_keys=prior)
            current = filling = fill(0)
            for g, first in enumerate(starts):
                count = min(group, end - first)
                try:
                    got = await asyncio.shield(current)
                except Exception as e:  # gRPC would take it for a cancel of the call: a miss
                    failed.append(e)
                    return
                filling = None
                if ended:  # gRPC read on after the call ended: touch no buffer
                    return
                if got == count and g + 1 < len(starts):
                    current = filling = fill(g + 1)  # into the other buffer, as this one goes
                flat = raw[g % 2].numpy()
                for j in range(got):  # the blocks filled whole; the stream ends after them
                    sent += 1
                    for off in range(0, size, STREAM_CHUNK):
                        yield pb.PublishChunk(
                            block_index=first - have + j, chunk_offset=off,
                            data=flat[j * size + off : j * size + min(off + STREAM_CHUNK, size)
                                      ].tobytes())
                if got < count:
                    return

        try:
            # Half a deadline past `until`: a `produce` stopped there ends the stream, and the
            # daemon's reply (the blocks it committed before) still comes back.
            reply: pb.PublishReply = await self._stub_().Publish(
                messages(), timeout=self._left(until) + self.deadline_s / 2,
                metadata=self._metadata)
        finally:
            ended = True
            try:
                if filling is not None:  # the stream ended early: stop the fill before reuse
                    filling.cancel()
                    await wait_out(filling)  # done when it returns, or raises our own cancel
            finally:
                for b in raw:
                    _stream_buffers.give(b)
        if failed:
            raise failed[0]
        if reply.present + reply.stored > sent:
            raise _DaemonFault(f"a publish of {sent} blocks answered {reply.stored} stored "
                               f"and {reply.present} present")
        return reply.present + reply.stored

    # ---- zero-copy variants: the caller copies straight to or from the daemon's memory
    def _block_view(self, arena: Arena, ref: pb.BlockRef,
                    slab: torch.Tensor | None = None) -> torch.Tensor:
        """One block of the arena (or the slab) as `[layers, kv, block_tokens, heads,
        head_dim]`."""
        raw = _memory(arena, slab, ref)[ref.offset : ref.offset + ref.length]
        return raw.view(self.layout.torch_dtype).view(self.layout.block_shape)

    async def _fetch_with(self, keys: list[bytes], consume: BlockCopy, skip: int,
                          until: float, progress: _Progress, whole: bool) -> int:
        """Blocks `[0, end)` of `keys` consumed intact (`skip` on none past it)."""
        if self.transfer == "stream":
            return await self._fetch_with_stream(keys, consume, skip, until, progress, whole)

        async def take(arena: Arena, slab: torch.Tensor | None, head: pb.FetchChunk,
                       first: int) -> int:
            views = [self._block_view(arena, ref, slab) for ref in head.blocks]
            return await self._copy(consume, len(views), list(range(first, first + len(views))),
                                    views, until=until)

        await self._windows(keys, take, until, progress, whole)
        return progress.done

    async def _fetch_with_stream(self, keys: list[bytes], consume: BlockCopy, skip: int,
                                 until: float, progress: _Progress, whole: bool) -> int:
        """Over TCP: blocks go to `consume` a group at a time as they arrive
        (`_stream_groups`); with `whole`, all of them in one call once every one is here."""
        if not whole:
            while progress.done < len(keys):
                before = progress.done
                more = await self._stream_groups(keys, consume, until, progress)
                if not more or progress.done == before:
                    break
            return progress.done
        out: torch.Tensor | None = None
        done = skip
        while done < len(keys):
            n, more, out = await self._fetch_some(keys, done, out, until)
            done += n
            if not more or n == 0:
                break
        if done == skip or out is None:
            return skip
        blocks = list(range(skip, done))
        got = await self._copy(consume, len(blocks), blocks,
                               [self._prompt_view(out, i, 1)[:, :, 0] for i in blocks],
                               until=until)
        return skip + got

    async def _publish_with(self, keys: list[bytes], produce: BlockCopy, until: float) -> int:
        if self.transfer == "stream":
            return await self._publish_with_stream(keys, produce, until)

        async def write(arena: Arena, todo: list[int], refs: list[pb.BlockRef]) -> None:
            got = await self._copy(produce, len(todo), todo,
                                   [self._block_view(arena, ref) for ref in refs], until=until,
                                   save=True)
            if got < len(todo):
                raise _CopyStopped(f"publish wrote {got} of {len(todo)} blocks")

        return await _in_rounds(len(keys), 0,
                                lambda d: self._reserve_write(keys, d, write, until))


_Take = Callable[[Arena, "torch.Tensor | None", pb.FetchChunk, int], Awaitable[int]]
"""Copies a leased window (`_windows`): (arena, slab, header, first block) -> blocks copied."""


def _memory(arena: Arena, slab: torch.Tensor | None, ref: pb.BlockRef) -> torch.Tensor:
    """The flat memory `ref`'s offset is into: the arena, or the gpu slab (`in_slab`: only in
    a window `_take_leased` checked against the slab this client maps)."""
    if not ref.in_slab:
        return arena.tensor
    if slab is None:
        raise KVStoreError("a block in the daemon's gpu slab, which this client does not map")
    return slab


async def _in_rounds(total: int, start: int,
                     step: Callable[[int], Awaitable[tuple[int, bool]]]) -> int:
    """Run `step(done)` until all `total` blocks are covered, a round covers none, or the daemon
    says there is no more (`more` false: a miss or an end, not a lack of staging space).
    Returns the blocks covered, counting from 0."""
    done = start
    while done < total:
        n, more = await step(done)
        done += n
        if not more or n == 0:
            break
    return done


def _limit(max_blocks: int | None) -> int | None:
    """A `max_blocks` argument as a slice end (None: no limit)."""
    if max_blocks is None:
        return None
    if isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks < 0:
        raise InvalidArgumentError(f"max_blocks must be an int >= 0 or None, got {max_blocks!r}")
    return max_blocks


def _count(tokens: Tokens) -> int:
    if isinstance(tokens, PrefixKeys):
        return tokens.num_tokens
    return int(tokens.shape[0]) if isinstance(tokens, torch.Tensor | np.ndarray) else len(tokens)


def _budget(budget_s: float | None) -> float | None:
    """A `budget_s` argument, checked (None: no recompute budget known)."""
    if budget_s is None:
        return None
    if isinstance(budget_s, bool) or not isinstance(budget_s, int | float) or not budget_s > 0:
        raise InvalidArgumentError(f"budget_s must be a positive number or None, got "
                                   f"{budget_s!r}")
    return float(budget_s)
