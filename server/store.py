"""`TieredStore`: the daemon's blocks across tiers, with leases, demotion and promotion.

The host tier is where clients meet the store: same-node clients copy straight from and into
its shared arena under a lease, remote clients stream from and into it. The disk tier sits
below: host victims are demoted to it (written, then dropped from host), disk hits are promoted
(read into host, verified, kept on disk as well). The gpu tier (optional, `gpu_bytes`) sits
above host: blocks a fetch served are copied up into it after the fetch answered (a background
lift under its own pins; kept in host as well), its victims are demoted to host (copied down
unless host holds them), and a block only it holds is copied into host scratch space for the
fetch that reads it (clients read host memory only).
Which block goes where is the placement engine's decision (`tiers.hierarchy`); this module
carries the decisions out with bytes, pins and leases.

The remote tier (optional; one Redis/Valkey Cluster shared by every daemon) sits beside them:
- write-through: committed blocks, and demoted ones the remote tier lacks, are queued (keys
  only, bounded, shedding when full) and written by one background task (`remote_writer`), so a
  publishing client never waits for the network;
- read-through: `lookup_through` asks the remote tier (one batched EXISTS) about the keys past
  the local prefix, and `fetch` reads remote hits into host (their headers first, then
  pipelined GETs straight into the room made for them, verified there: `_read_remote`), where
  they are served like any promoted block.
A remote failure is a miss; the tier's breaker makes an outage cost one deadline, not one per
call.

All bookkeeping runs on the event-loop thread, so it needs no locks; byte movement runs in
worker threads on entries that are pinned or reserved, so nothing moves under a copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import secrets
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal, TypeVar

from kvstore.errors import CapacityError, IntegrityError, InvalidArgumentError, NotFoundError
from kvstore.keys import KEY_BYTES
from kvstore.planner import BandwidthModel
from kvstore.server.fences import Fences
from kvstore.server.remote_writer import WRITE_BATCH_BYTES, RemoteWriter
from kvstore.server.tenancy import owner_tag
from kvstore.server.write_through import WriteThroughQueue
from kvstore.tiering import RecentChains, owner_of
from kvstore.tiers.base import PAGE, BlockEntry, Tier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk_index import one_line
from kvstore.tiers.gpu import GpuTier
from kvstore.tiers.hierarchy import Hierarchy, PromptShare, RoomPlan
from kvstore.tiers.host import HostTier
from kvstore.tiers.remote import RemoteTier, RemoteUnavailableError
from kvstore.worker_wait import wait_out

if TYPE_CHECKING:  # pyzmq and msgspec are imported only when events are on
    from kvstore.server.kv_events import EventTracker

log = logging.getLogger(__name__)
T = TypeVar("T")
# Remote reads go in batches this large: enough blocks to amortize a round trip, few enough
# bytes that a batch stays well inside the remote timeout and the host room it holds while
# its GETs run stays modest.
REMOTE_BATCH_BYTES = 16 << 20
REMOTE_BATCH_BLOCKS = 64
# How long a fetch without a deadline waits, at most, for other calls' promotions of its
# blocks (`TieredStore._await_promotion`): a disk read or a remote batch, normally far less.
PROMOTION_WAIT_S = 5.0
# Keys of the chains used most recently that the shutdown flush writes head first (~6 MB).
RECENT_CHAIN_KEYS = 1 << 16


@dataclass
class Lease:
    """Host entries a client holds: pinned (`FetchLease`) or reserved (`PublishLease`).

    A lease is `held` while a daemon call is working on it (the store building it, a stream
    moving its bytes): the reaper never reclaims a held lease, so a slot cannot change owner
    while bytes for its owner still move; the call ends it (and bounds its own time). Leases
    handed to a client (zero-copy) are not held: the reaper reclaims them at `expires`.
    """

    kind: ClassVar[Literal["fetch", "publish"]]
    id: int
    expires: float
    owner: str = ""  # the tenant that made it ("" unscoped); only it may end the lease
    held: bool = True
    entries: list[BlockEntry] = field(default_factory=list)
    more: bool = False  # stopped for lack of host space, not for a miss


@dataclass
class FetchLease(Lease):
    """Pinned host blocks of a fetch (and scratch space holding those not promoted), and gpu
    blocks pinned where they lie for a client that maps the gpu slab (`in_slab`)."""

    kind: ClassVar[Literal["fetch", "publish"]] = "fetch"
    tiers: list[str] = field(default_factory=list)  # where each block was found
    scratch: list[BlockEntry] = field(default_factory=list)  # freed at release (`_Room`)
    in_slab: list[bool] = field(default_factory=list)  # per entry: a gpu block, not a host one


@dataclass
class PublishLease(Lease):
    """Host reservations of a publish, made visible by `commit`."""

    kind: ClassVar[Literal["fetch", "publish"]] = "publish"
    needed: list[bool] = field(default_factory=list)  # per key: reserved, or present already
    keys: list[bytes] = field(default_factory=list)  # the chain to rank at commit
    writer: str = ""  # the zero-copy writer's lock file: its space is fenced at expiry


L = TypeVar("L", bound=Lease)


class _Skipped(Exception):
    """A disk read not started: the fetch's answer was due first (`fetch`'s `answer_within`)."""


class _ReadClock:
    """When one fetch's answer is due (`answer_within`), for its disk reads: a read starts
    only if it would end by then, at the pace of the slowest of the fetch's reads so far (a
    read of a stalled disk takes as long as the last one did). Read and written by the I/O
    threads: a float's assignment is atomic, and a lost update only shifts one decision."""

    def __init__(self, within_s: float) -> None:
        self.due = time.monotonic() + within_s
        self.slowest = 0.0

    def may_start(self) -> bool:
        return time.monotonic() + self.slowest <= self.due

    def took(self, seconds: float) -> None:
        self.slowest = max(self.slowest, seconds)


@dataclass
class _Staged:
    """One block of a fetch in progress: a pinned host hit, or a disk or remote hit read into
    `dst`: a host reservation, committed and pinned once read (a promotion), or scratch space
    that the lease frees at release (see `_Room`)."""

    tier: str
    dst: BlockEntry
    src: BlockEntry | None = None  # the disk record read into `dst` (pinned on disk until read)
    # What `dst` is; "slab": a gpu block pinned where it lies, for a client mapping the slab.
    holds: Literal["pinned", "reservation", "scratch", "slab", "nothing"] = "pinned"
    done: bool = False  # the disk read finished (its record unpinned)

    def abandon(self, store: TieredStore) -> None:
        """Give back what it holds (on an error, a cancellation, or past a failed block)."""
        if not self.done and self.src is not None and store.disk is not None:
            store.disk.complete_load(self.src)
            self.done = True
        if self.holds == "pinned":
            store.host.complete_load(self.dst)
        elif self.holds == "reservation":
            store.host.abort_store(self.dst)
        elif self.holds == "scratch":
            store.host.free_scratch(self.dst)
        elif self.holds == "slab" and store.gpu is not None:
            store.gpu.complete_load(self.dst)
        self.holds = "nothing"  # so a second call gives nothing back twice


@dataclass
class _Room:
    """How one fetch makes host room for the blocks it reads from disk or the remote tier.

    The prompt is `prior` (served by earlier calls of the same client fetch) and `keys`. Its
    share of the host tier (of its owner's share, under tenants) is the placement
    engine's call (`PromptShare`): promoted whole when
    it fits, else its first blocks, the rest read into scratch space, served like any hit and
    freed at release (no promotion, no eviction, no write). Room is made by evicting other
    blocks, never the prompt's own: they are pinned while the call runs (`held`). A prompt
    that holds more than its share (published whole) gives way from its deepest block when
    scratch space is needed, once: it holds its share afterwards.
    """

    prior: Sequence[bytes]
    keys: Sequence[bytes]
    layout_digest: bytes
    open_ended: bool  # the remote tier may extend the prompt past its local blocks
    slab_ok: bool = False  # the client reads gpu-only blocks in the slab: no host room for them
    promote_only: bool = False  # a prefetch: no scratch space (freed at release, read for nothing)
    owner: bytes = b""  # its tenant's tag (`tenancy.owner_tag`; b"" unscoped): its share's owner
    share: PromptShare | None = None  # sized at the call's first disk, gpu or remote hit
    held: list[BlockEntry] = field(default_factory=list)  # its host blocks, chain order
    wait_until: float = 0.0  # monotonic: the call waits for others' promotions until then
    gpu_bytes: int = 0  # copied out of the gpu tier into scratch space, for its read rate
    gpu_s: float = 0.0


@dataclass
class _Lift:
    """A promotion into the gpu tier, run after its fetch answered (`TieredStore._lift`) under
    its own pins, so no lease it outlives can free or demote a block it reads. It copies only
    once every lease of its fetch has ended: until then the client is copying the same bytes
    out, and the lift's copy would take turns with it on the same cores."""

    prompt: list[bytes]  # root first, the earlier windows' keys included
    todo: list[bytes] = field(default_factory=list)  # to copy up, in order
    # The prompt's blocks, pinned: in host (the copies' sources among them) and in gpu.
    in_host: dict[bytes, BlockEntry] = field(default_factory=dict)
    in_gpu: list[BlockEntry] = field(default_factory=list)
    writing: BlockEntry | None = None  # the gpu reservation being copied into
    task: asyncio.Task[None] | None = None
    leases: set[int] = field(default_factory=set)  # its fetch's leases not ended yet
    clients_done: asyncio.Event = field(default_factory=asyncio.Event)  # set: `leases` empty


@dataclass
class _Prefetch:
    """A prefetch running (`TieredStore.prefetch`): its keys, and the task reading them."""

    keys: frozenset[bytes]
    task: asyncio.Task[None]


@dataclass
class StoreCounters:
    lookups: int = 0
    hit_blocks: int = 0
    miss_blocks: int = 0
    integrity_failures: int = 0
    demotions: int = 0
    promotions: int = 0
    stored_blocks: int = 0
    remote_lost_writes: int = 0  # queued for write-through, gone from every local tier first
    remote_dropped_writes: int = 0  # write-through given up: refused, or failed too often
    remote_lookup_hits: int = 0  # blocks a lookup found in the remote tier only
    scratch_reads: int = 0  # blocks a fetch read into scratch space, not promoted (`_Room`)
    expired_leases: int = 0  # reclaimed by the reaper: their client never ended them
    lifts_skipped: int = 0  # promotions into gpu not started: another prompt's was running
    late_fetches: int = 0  # answered short at `answer_within`: some reads never started
    prefetches: int = 0  # started by lookups (`prefetch`)
    prefetched_blocks: int = 0  # blocks they promoted into host
    sessions_ended: int = 0  # EndSession hints
    session_blocks_marked: int = 0  # blocks they marked to go first (once per tier)
    tier_hits: dict[str, int] = field(default_factory=dict)
    bytes_read: dict[str, int] = field(default_factory=dict)
    bytes_written: dict[str, int] = field(default_factory=dict)

    def add(self, table: dict[str, int], tier: str, n: int) -> None:
        table[tier] = table.get(tier, 0) + n


class _RemoteReads:
    """The remote side of one fetch: batches of the keys no local tier holds, each read with
    one pipelined GET straight into the host room made for it (`TieredStore._read_remote`).
    (Reading the next batch ahead while one is verified was measured slower on a 2-core
    machine: the verify thread, the reader and a local Redis contend for the cores.)"""

    def __init__(self, remote: RemoteTier, namespace: bytes, keys: Sequence[bytes],
                 layout_digest: bytes, batch: int, block_bytes: int) -> None:
        self.remote, self.namespace, self.keys = remote, namespace, keys
        self.layout_digest, self.batch, self.block_bytes = layout_digest, batch, block_bytes
        self.read: dict[int, _Staged] = {}  # the last batch's blocks by index, until taken
        self.seconds = 0.0  # spent in GETs (network and verification), for the read rate
        self.nbytes = 0  # payload bytes those GETs brought

    def take(self, i: int) -> _Staged | None:
        """`keys[i]`'s block, if the last batch read it; each is handed out once."""
        return self.read.pop(i, None)

    def abandon(self, store: TieredStore) -> None:
        """Give back the blocks read but not taken (the fetch ended before them)."""
        for s in self.read.values():
            s.abandon(store)
        self.read = {}


class TieredStore:
    def __init__(self, host: HostTier, disk: DiskTier | None, lease_timeout_s: float = 30.0,
                 io_threads: int = 4, remote: RemoteTier | None = None,
                 remote_queue_blocks: int = 256, fetch_window_bytes: int = 64 << 20,
                 clock: Callable[[], float] = time.monotonic, gpu: GpuTier | None = None,
                 write_fence_s: float = 600.0) -> None:
        self.host = host
        self.gpu = gpu
        self.clock = clock  # lease expiry and flush budgets (tests step a fake one)
        # Bytes one fetch promotes (disk and remote reads) before it answers with `more`: the
        # client asks for the rest at once and copies this part meanwhile (0: no limit).
        self.fetch_window_bytes = fetch_window_bytes
        self.disk = disk
        # Fastest first: the placement engine's levels, and the order Stats reports them in.
        self.tiers: list[Tier] = ([gpu] if gpu is not None else []) + [host] + (
            [disk] if disk is not None else [])
        self.host_level = self.tiers.index(host)
        # The remote tier is not in `tiers`: it is shared, with no local space or LRU to keep.
        self.remote = remote
        self.write_queue = WriteThroughQueue(remote_queue_blocks) if remote is not None else None
        self.writer = (RemoteWriter(self, remote, self.write_queue, self._run_io)
                       if remote is not None and self.write_queue is not None else None)
        self.lease_timeout_s = lease_timeout_s
        self.leases: dict[int, Lease] = {}
        # Expired zero-copy publishes whose writer may still be copying into them.
        self.fences = Fences(host.arena.path.parent, write_fence_s, host.free_scratch,
                             lambda: self.clock())
        # Every placement decision (lookup walks, victims and where they go, a prompt's share,
        # the flush order) is the engine's; this class carries them out with bytes and leases.
        self.placement = Hierarchy(self.tiers, RecentChains(RECENT_CHAIN_KEYS),
                                   serve=self.host_level, remote=remote is not None)
        self.counters = StoreCounters()
        # Measured read bandwidth per tier (bytes/s into host staging, an EWMA over fetches);
        # a tier is absent until measured. See `read_bandwidth`.
        self.read_rates = BandwidthModel(bandwidth={}, latency={})
        # Rates saved by the previous run: reported until this run measures the tier, then
        # replaced outright (not averaged in: the disk or its throttle may have changed).
        self.saved_read_bandwidth: dict[str, float] = {}
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="kvstore-io")
        self.events: EventTracker | None = None  # KV events (`kv_events`), set by the daemon
        self._lifting: _Lift | None = None  # the promotion into gpu running now (`_lift`)
        # The prefetch running now per owner (`prefetch`; the caller's tenant's tag).
        self._prefetching: dict[bytes, _Prefetch] = {}
        # Host reservations fetches are reading into (disk and remote hits), each done when it
        # lands: another fetch of the block waits for it instead of missing it.
        self._promoting: dict[bytes, asyncio.Future[None]] = {}
        self._disk_recheck_failed = ""  # why the last `recheck_disk` found no writes, logged
        self._disk_watch_failed = False  # `disk_watch` met an unexpected error (logged)

    async def _run_io(self, fn: Callable[..., T], *args: object) -> T:
        """Run byte movement in a worker. If the caller is cancelled, wait for the worker to
        finish before unwinding: its buffers are about to be freed and must not be in use."""
        fut = asyncio.get_running_loop().run_in_executor(self._io, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            await wait_out(fut)
            raise

    # ---- lookup
    def lookup(self, keys: Sequence[bytes]) -> list[str]:
        """Tier names of the longest prefix of `keys` held anywhere."""
        self.counters.lookups += 1
        found = self.placement.walk(keys)
        self.touch_chain(keys[: len(found)])
        return found

    async def held(self, keys: Sequence[bytes], namespace: bytes) -> list[bool]:
        """For each key, whether a local tier or the remote tier (one batched EXISTS for the
        keys no local tier holds) has its block: a probe (no recency touched, not counted as
        a lookup)."""
        held = [any(t.contains(k) for t in self.tiers) for k in keys]
        remote = self._remote_for(namespace)
        rest = [i for i, h in enumerate(held) if not h]
        if remote is None or not rest:
            return held
        try:
            there = await remote.exists(namespace, [keys[i] for i in rest])
        except RemoteUnavailableError as e:
            log.debug("remote probe skipped: %s", e)
            return held
        for i, has in zip(rest, there, strict=True):
            held[i] = has
        return held

    def touch_chain(self, keys: Sequence[bytes]) -> None:
        self.placement.touch(keys)

    def end_session(self, keys: Sequence[bytes]) -> int:
        """The client's hint that the conversation of prompt `keys` ended
        (`Hierarchy.end_session`); returns the blocks marked, once per tier holding one."""
        marked = self.placement.end_session(keys)
        self.counters.sessions_ended += 1
        self.counters.session_blocks_marked += marked
        return marked

    async def lookup_through(self, keys: Sequence[bytes], namespace: bytes) -> list[str]:
        """`lookup`, continued in the remote tier past the local prefix (one batched EXISTS).

        Past the local prefix a block counts when a local tier or the remote tier has it, so
        a local block after a remote one still extends the prefix.
        """
        found = self.lookup(keys)
        remote = self._remote_for(namespace)
        if len(found) == len(keys) or remote is None:
            return found
        rest = keys[len(found) :]
        try:
            present = await remote.exists(namespace, rest)
        except RemoteUnavailableError as e:
            log.debug("remote lookup skipped: %s", e)
            return found
        for key, remote_has in zip(rest, present, strict=True):
            level = self.placement.source(key)
            if level is None and not remote_has:
                break
            found.append(remote.name if level is None else self.tiers[level].name)
            self.counters.remote_lookup_hits += level is None
        return found

    def _remote_for(self, namespace: bytes) -> RemoteTier | None:
        """The remote tier, if a call naming `namespace` can use it: its keys there are
        prefixed by the namespace, which clients send with every call."""
        return self.remote if len(namespace) == KEY_BYTES else None

    # ---- prefetch
    def prefetch(self, keys: Sequence[bytes], layout_digest: bytes, namespace: bytes,
                 block_bytes: int, owner: str = "") -> bool:
        """Start promoting into host, in the background, the blocks of `keys` (a lookup's hit,
        in chain order) that host does not hold: read from the remote tier or disk as a fetch
        reads them, within the prompt's share of host (never into scratch space), then left
        unpinned. For a caller that looked a prompt up and fetches it later: a disaggregated
        decode instance waiting for the rest of its producer's blocks reads the first ones
        while the producer's daemon still writes the last ones through. A fetch of any of
        these keys waits for the prefetch rather than read them a second time. One prefetch
        per owner (each tenant, and the unscoped callers together) runs at a time: False (none
        started) while the caller's owner has one running; its next lookup asks again. Per
        owner, so a tenant looking up without end cannot keep the others' from starting."""
        # By the caller's tenant, not the namespace it sent (a Lookup's need not be 32 bytes,
        # and one that is not passes unscoped: keyed by it, a tenant took the unscoped slot).
        tag = owner_tag(owner)
        run = self._prefetching.get(tag)
        if not keys or (run is not None and not run.task.done()):
            return False
        self.counters.prefetches += 1
        task = asyncio.get_running_loop().create_task(
            self._prefetch(list(keys), layout_digest, namespace, block_bytes, owner))
        self._prefetching[tag] = _Prefetch(frozenset(keys), task)
        return True

    async def _prefetch(self, keys: list[bytes], layout_digest: bytes, namespace: bytes,
                        block_bytes: int, owner: str) -> None:
        try:
            lease = await self.fetch(keys, layout_digest, namespace, block_bytes, owner=owner,
                                     hold=True, whole=True, prefetch=True)
            self.release(lease.id)
        except CapacityError as e:  # a hint: the fetch that follows reads what is missing
            log.debug("prefetch of %d blocks stopped: %s", len(keys), e)
        except Exception:
            log.exception("prefetch of %d blocks failed", len(keys))

    async def _prefetch_done(self, keys: Sequence[bytes], within: float | None) -> None:
        """Wait (up to `within` seconds) for a running prefetch of any of `keys`: a fetch
        reaching a block it is promoting would wait for that block anyway (`_stage`), and one
        reaching a block it has not reserved yet would read it itself, beside the prefetch's
        reads (the prefetch then waits for it): the same bytes, read in two calls at once."""
        running = [run.task for run in self._prefetching.values()
                   if not run.task.done() and not run.keys.isdisjoint(keys)]
        if running:
            await asyncio.wait(running, timeout=within)

    async def stop_prefetch(self) -> None:
        """Cancel the running prefetches and wait for them to unwind (shutdown)."""
        running = [run.task for run in self._prefetching.values() if not run.task.done()]
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running)

    # ---- fetch
    async def fetch(self, keys: Sequence[bytes], layout_digest: bytes, namespace: bytes = b"",
                    block_bytes: int = 0, owner: str = "", hold: bool = False,
                    prior: Sequence[bytes] = (), slab_ok: bool = False,
                    whole: bool = False, answer_within: float | None = None,
                    prefetch: bool = False) -> FetchLease:
        """Pin the longest cached prefix in host memory (promoting disk and remote hits, or
        reading them into scratch space, see `_Room`) under a lease.

        Two passes: first every block of the prefix is pinned (host hits) or given a host
        reservation (disk hits, possibly demoting others), then all disk reads run at once,
        so the disk sees a deep queue instead of one read at a time. Remote hits are read in
        batches during the first pass and copied into host at once (their bytes are already
        in memory), then pinned like host hits. The remote tier is asked only when
        `namespace` is given; `block_bytes` sizes its batches. Past `fetch_window_bytes` of
        promotions the lease stops short with `more` set: the client asks for the rest while it
        copies this part, so the next reads overlap its copy. `prior`: the keys before `keys`
        in the same prompt (served by the client's earlier calls); with them, a prompt larger
        than the host tier is served without pushing itself out of it (`_Room`). `slab_ok`: the
        client maps the gpu tier's slab, so every block gpu holds is pinned there and served
        from it (`FetchLease.in_slab`), even one host holds too (device to device beats the
        bus), and a block only gpu holds is not copied into host scratch space. `whole`: no
        windows, for a client that can use no block before it has them all (a layer-by-layer
        load: its first layer needs every block's); the lease still stops short, with `more`,
        where host has no room for the rest. `answer_within`: seconds by which the disk reads
        should end: a read that would end later, at the pace of this fetch's slowest read so
        far, does not start (the first always does: `_ReadClock`); the lease stops short, with
        `more`, before the first read not started, so a slow or stalled disk still answers
        before the client's deadline with the prefix it read (the client asks for the rest, as
        after a window).

        `prefetch`: the call is `prefetch`'s: it promotes only (no scratch space), and counts
        its promotions in `prefetched_blocks`, not as hits; no lift, no ranking.

        The lease is held (never reaped) while it is built; with `hold` it stays held and the
        caller must release it, else it is handed over to the client's timeout.
        """
        if not prefetch:
            await self._prefetch_done(keys, answer_within)
        lease = self._new_lease(FetchLease, owner)
        staged: list[_Staged] = []
        remote = None
        if (tier := self._remote_for(namespace)) is not None and block_bytes > 0:
            batch = max(1, min(REMOTE_BATCH_BLOCKS, REMOTE_BATCH_BYTES // block_bytes))
            remote = _RemoteReads(tier, namespace, keys, layout_digest, batch, block_bytes)
        room = _Room(prior, keys, layout_digest, open_ended=remote is not None,
                     slab_ok=slab_ok and self.gpu is not None, promote_only=prefetch,
                     owner=owner_tag(owner),
                     wait_until=time.monotonic() + (PROMOTION_WAIT_S if answer_within is None
                                                    else answer_within))
        window = 0 if whole else self.fetch_window_bytes
        promoted = 0
        try:
            for i, key in enumerate(keys):
                if window and promoted >= window:
                    lease.more = True  # the rest in the client's next call, while it copies
                    break
                # A block the last remote batch read (committed: `_stage` would count it
                # as a host hit), else a local one, else a new remote batch from here.
                item = remote.take(i) if remote is not None else None
                if item is None:
                    item = await self._stage(key, layout_digest, lease, staged, room, slab_ok)
                if item is None and remote is not None and not lease.more:
                    # Up to the window's end: a block read past it would be given back.
                    limit = -(-(window - promoted) // block_bytes) if window else len(keys)
                    item = await self._stage_remote(remote, i, lease, staged, room, limit)
                if item is None:
                    break
                staged.append(item)
                if item.tier != self.host.name and item.holds != "slab":  # read for it
                    promoted += item.dst.length
            reads = [s for s in staged if s.src is not None]
            began = time.perf_counter()
            clock = _ReadClock(answer_within) if answer_within is not None else None
            errors = await asyncio.gather(
                *(self._read_disk(s, clock, first=i == 0) for i, s in enumerate(reads)))
            read_s = time.perf_counter() - began
        except BaseException:
            for s in staged:
                s.abandon(self)
            self.release(lease.id)
            raise
        finally:
            if remote is not None:
                remote.abandon(self)  # read past where the fetch stopped
            for entry in room.held:
                self.host.complete_load(entry)
        end = cut = len(staged)  # end: before the first read skipped as late
        for s, err in zip(reads, errors, strict=True):
            if err is None:
                continue
            if isinstance(err, _Skipped):
                end = min(end, staged.index(s))
                cut = min(cut, end)
                continue
            cut = min(cut, staged.index(s))
            if self.disk is not None and s.src is not None:
                self._integrity_failure(self.disk, s.src, err)
        for i, s in enumerate(staged):
            if i < cut:
                lease.entries.append(s.dst)
                lease.tiers.append(s.tier)
                lease.in_slab.append(s.holds == "slab")
                if s.holds == "scratch":
                    lease.scratch.append(s.dst)
            else:
                s.abandon(self)  # past a failed block: unpin, free
        # More to ask for: a window's end, host room's, or the late reads'; not after a failure.
        lease.more = (lease.more or end < len(staged)) and cut == end
        if end < len(staged):
            self.counters.late_fetches += 1
        if self.disk is not None:
            self.read_rates.observe(self.disk.name, sum(
                s.src.length for s, err in zip(reads, errors, strict=True)
                if err is None and s.src is not None), read_s)
        if remote is not None:
            self.read_rates.observe(remote.remote.name, remote.nbytes, remote.seconds)
        if self.gpu is not None and room.gpu_bytes:
            self.read_rates.observe(self.gpu.name, room.gpu_bytes, room.gpu_s)
        served = len(lease.entries)
        if prefetch:
            self.counters.prefetched_blocks += sum(t != self.host.name for t in lease.tiers)
            return self.hand_over(lease, hold)
        self.counters.hit_blocks += served
        if not lease.more:  # else the client asks for the rest: not a miss (yet)
            self.counters.miss_blocks += len(keys) - served
        for name in lease.tiers:
            self.counters.add(self.counters.tier_hits, name, 1)
        if self.gpu is not None and served:
            # Before the hand-over: the lift pins what it reads, so a client ending its lease
            # at once (or the reaper) frees nothing the lift still copies.
            self._request_lift(self.gpu, lease, [*prior, *keys[:served]], keys[:served], prior)
        # With the earlier windows' keys: ranking only this window would make a long prompt's
        # tail fresher than its head (evicted and flushed in the wrong order). The lift ranks
        # the prompt again when it ends (`_lift`): its blocks enter gpu as they come, root first.
        self.touch_chain([*prior, *keys[:served]])
        return self.hand_over(lease, hold)

    def count_served(self, lease: FetchLease, block: int | None = None) -> None:
        """Count as read from host the bytes of `lease`'s host hits (all, or its `block`)
        now handed to the client: an SHM lease once its reply is sent (the client copies them
        out of the arena), a streamed block once its last chunk is. Once per block served: a
        block read from another tier for the fetch was counted as that tier's read (and host's
        write, when promoted) as it was read, and a gpu block read in the slab is no host's."""
        picked = range(len(lease.entries)) if block is None else (block,)
        n = sum(lease.entries[i].length for i in picked
                if lease.tiers[i] == self.host.name and not lease.in_slab[i])
        if n:
            self.counters.add(self.counters.bytes_read, self.host.name, n)

    def _request_lift(self, gpu: GpuTier, lease: FetchLease, prompt: list[bytes],
                      keys: Sequence[bytes], prior: Sequence[bytes]) -> None:
        """Plan the blocks this fetch lifts into the gpu tier (`Hierarchy.lift`: those it
        serves from pinned host blocks; blocks in scratch space are not, a prompt past its
        host share is not kept in faster memory either), pin the prompt's blocks under the
        lift's own hold, and run it after the reply (`_lift`). One lift runs at a time: the
        next window of the prompt being lifted joins it; another prompt's lift is skipped
        (counted in `lifts_skipped`): it is lifted when it is fetched again."""
        served = {k for k, e, in_slab in zip(keys, lease.entries, lease.in_slab, strict=True)
                  if e.key == k and not in_slab}  # pinned in host: the lift's sources
        run = self._lifting
        joins = run is not None and bool(prior) and run.prompt == list(prior)
        pending = set(run.todo) if run is not None and joins else set()
        size = gpu.units_for(lease.entries[0].length) * PAGE
        todo = [k for k in self.placement.lift(prompt, pending | served, size)
                if k not in pending]
        if not todo:
            return
        if run is not None and not joins:
            self.counters.lifts_skipped += 1
            log.debug("promotion into the gpu tier skipped: another prompt's lift is running")
            return
        lift = run if run is not None else _Lift(prompt=[])
        lift.prompt = prompt
        lift.todo += todo
        lift.leases.add(lease.id)  # ended by `release`, the reaper's too
        lift.clients_done.clear()
        # The prompt's blocks in host and gpu, lifted or not, as its leases pinned them when
        # the lift ran before the reply: neither gpu's victims going down into host nor room in
        # gpu pushes the prompt out. A joining window's only: the lift holds the earlier ones.
        own = keys if joins else prompt
        lift.in_host.update((k, self.host.prepare_load(k)) for k in own if self.host.contains(k))
        lift.in_gpu += [gpu.prepare_load(k) for k in own if gpu.contains(k)]
        if run is None:
            self._lifting = lift
            lift.task = asyncio.get_running_loop().create_task(self._lift(gpu, lift))
            # Also when cancelled before its first step (its `finally` never runs then).
            lift.task.add_done_callback(lambda _: self._end_lift(gpu, lift))

    async def _lift(self, gpu: GpuTier, lift: _Lift) -> None:
        """Copy `lift.todo` up into the gpu tier from the host blocks pinned for it, in the
        background. The prompt's blocks stay pinned meanwhile: room is never made from it.
        Stops where no room can be made (gpu pinned full, or host cannot take its victims).
        An error is logged, never raised: no client waits for this."""
        gpu_level = self.tiers.index(gpu)
        lifted = 0
        try:
            while lift.todo:  # may grow while it runs: the prompt's next window joins
                if not lift.clients_done.is_set():  # a window's client still copies
                    await lift.clients_done.wait()
                key = lift.todo.pop(0)
                src = lift.in_host[key]
                try:
                    dst = await self._reserve(gpu_level, key, src.namespace, src.layout_digest,
                                              src.length)
                except CapacityError as e:
                    log.debug("promotion into the gpu tier stops: %s", e)
                    break
                if dst is not None:  # else gpu holds it already
                    lift.writing = dst
                    try:
                        await self._run_io(gpu.write_from, dst, self.host.memview(src))
                    except BaseException:
                        gpu.abort_store(dst)
                        raise
                    finally:
                        lift.writing = None
                    gpu.complete_store(dst)
                    lift.in_gpu.append(gpu.prepare_load(key))  # no victim of the next one's room
                    self.counters.promotions += 1
                    self.counters.add(self.counters.bytes_written, gpu.name, src.length)
                    lifted += 1
            if lifted:
                # Rank the prompt again, root first: the fetch ranked it before these blocks
                # entered gpu (the root first, so the oldest) and gpu's victims entered host.
                self.touch_chain(lift.prompt)
        except Exception:
            log.exception("promotion into the gpu tier failed")
        finally:
            self._end_lift(gpu, lift)

    def _end_lift(self, gpu: GpuTier, lift: _Lift) -> None:
        """Give back what a lift holds (once: it ends from its task, its done callback, or
        `close`, which cannot wait for the task to unwind)."""
        if lift.writing is not None:
            gpu.abort_store(lift.writing)
            lift.writing = None
        for entry in lift.in_host.values():
            self.host.complete_load(entry)
        for entry in lift.in_gpu:
            gpu.complete_load(entry)
        lift.in_host.clear()
        lift.in_gpu.clear()
        lift.todo.clear()
        if self._lifting is lift:
            self._lifting = None

    async def lifts_idle(self) -> None:
        """Wait until no lift runs (tests, benchmarks: a lift ends after its fetch answered)."""
        while (lift := self._lifting) is not None and lift.task is not None:
            await asyncio.wait([lift.task])

    async def stop_lifts(self) -> None:
        """Cancel the running lift and wait for it to unwind (its block copy in flight ends
        first, `_run_io`), its pins given back. For shutdown: a lift only copies host blocks."""
        if (lift := self._lifting) is not None and lift.task is not None:
            lift.task.cancel()
            await asyncio.wait([lift.task])

    def read_bandwidth(self) -> dict[str, float]:
        """Measured read bandwidth of each tier, bytes/s: the daemon's side of a fetch (disk:
        the wall time of a fetch's concurrent reads and their verification into host staging;
        remote: its batched GETs), an EWMA over fetches. A tier not measured yet by this run
        reports the figure saved by the previous run, or is absent.

        The host tier is never measured: a host hit is pinned where it lies (zero copy), and
        what it costs is the client's copy out of shared memory, which only the client sees
        (and which depends on the client: its transfer mode, its destination memory). Clients
        measure that leg themselves and add it to every tier (`kvstore.planner`).
        """
        return {**self.saved_read_bandwidth, **self.read_rates.bandwidth}

    async def _stage(self, key: bytes, layout_digest: bytes, lease: FetchLease,
                     staged: list[_Staged], room: _Room, slab_ok: bool = False,
                     ) -> _Staged | None:
        """Pin a host hit, pin a gpu hit in the slab (`slab_ok`) or copy it into scratch space,
        or take host room for a disk hit, from the level the placement engine names; None ends
        the prefix. A block another fetch is promoting into host right now is waited for (up
        to `room.wait_until`) and served from there: two requests sharing a prefix on disk
        both get it, read once."""
        if key in self._promoting:
            await self._await_promotion(key, room.wait_until)
        level = self.placement.source(key, fastest=slab_ok)  # a slab client: gpu first
        if level is None:
            return None
        tier = self.tiers[level]
        src = tier.get(key)
        if src is None or src.layout_digest != layout_digest:
            return None
        if tier is self.host:
            return _Staged(self.host.name, self.host.prepare_load(key))
        if tier is self.gpu:
            if slab_ok:  # the client reads it where it lies: nothing copied, nothing placed
                return _Staged(self.gpu.name, self.gpu.prepare_load(key), holds="slab")
            return await self._stage_gpu(self.gpu, src, lease, staged, room)
        if tier is not self.disk or self.disk is None:
            return None
        self.disk.prepare_load(key)
        try:
            dst, scratch = await self._take_room(room, key, src.namespace, src.layout_digest,
                                                 src.length)
        except BaseException as e:
            self.disk.complete_load(src)
            if isinstance(e, CapacityError):
                if key in self._promoting:  # another fetch took it meanwhile
                    return await self._stage_landed(key, room)
                lease.more = bool(staged)  # the client copies these, releases, asks again
                return None
            raise
        if dst is None:  # another call is promoting or publishing it right now
            self.disk.complete_load(src)
            return await self._stage_landed(key, room)
        return _Staged(self.disk.name, dst, src, "scratch" if scratch else "reservation")

    async def _stage_landed(self, key: bytes, room: _Room) -> _Staged | None:
        """Pin `key` in host once another fetch's promotion of it landed (waited for up to
        `room.wait_until`); None when it did not (a publish in flight is not waited for: its
        client may take its lease's whole time)."""
        if key not in self._promoting:
            return None
        await self._await_promotion(key, room.wait_until)
        return _Staged(self.host.name, self.host.prepare_load(key)) if self.host.contains(
            key) else None

    async def _stage_gpu(self, gpu: GpuTier, src: BlockEntry, lease: FetchLease,
                         staged: list[_Staged], room: _Room) -> _Staged | None:
        """Copy a block only the gpu tier holds into host scratch space for this fetch, whose
        client does not map the slab. Nothing is placed: the gpu tier keeps the block, host
        gets no second copy. None ends the prefix."""
        gpu.prepare_load(src.key)
        try:
            try:
                dst, _ = await self._take_room(room, src.key, src.namespace, src.layout_digest,
                                               src.length, scratch=True)
            except CapacityError:
                lease.more = bool(staged)  # the client copies these, releases, asks again
                return None
            if dst is None:  # never: scratch space is under no key
                return None
            s = _Staged(gpu.name, dst, holds="scratch")
            began = time.perf_counter()
            try:
                await self._run_io(gpu.read_into, src, self.host.memview(dst))
            except BaseException:
                s.abandon(self)
                raise
        finally:
            gpu.complete_load(src)
        room.gpu_s += time.perf_counter() - began
        room.gpu_bytes += src.length
        self.counters.add(self.counters.bytes_read, gpu.name, src.length)
        return s

    def _plan_room(self, room: _Room, length: int) -> PromptShare:
        """Pin the prompt's host blocks for the rest of the call and size its share of the
        host tier (`_Room`); `length` is the size of the blocks read."""
        host = self.host
        size = host.units_for(length) * PAGE  # a block's, as the prompt's blocks are alike
        room.held = [host.prepare_load(k) for k in room.prior if host.contains(k)]
        # The prompt's other blocks: served by earlier calls, or in gpu or on disk ahead of this
        # one (a gpu block takes scratch space while its lease lasts, unless read in the slab).
        rest = (len(room.prior) - len(room.held)) * size
        local = True  # every key is in a local tier
        for key in room.keys:
            if room.slab_ok and self.gpu is not None and self.gpu.contains(key):
                continue  # read where it lies in the slab (`_stage`): no host space, no pin
            if host.contains(key):
                room.held.append(host.prepare_load(key))
                continue
            level = self.placement.source(key)
            src = self.tiers[level].get(key) if level is not None else None
            if src is None or src.layout_digest != room.layout_digest:
                local = False
                break
            rest += size
        # Sized within its owner's share of host: a tenant reading a prompt larger than
        # that makes room from its own blocks, never from another tenant's within its share.
        room.share = PromptShare.size(
            host.policy.fair_share(room.owner), self.fetch_window_bytes, size,
            used=sum(e.units * PAGE for e in room.held), rest=rest,
            open_ended=room.open_ended, local=local)
        return room.share

    async def _take_room(self, room: _Room, key: bytes, namespace: bytes, layout_digest: bytes,
                         length: int, scratch: bool = False) -> tuple[BlockEntry | None, bool]:
        """Host space for a block this fetch reads: a reservation to promote it into while the
        prompt is within its share, else (or with `scratch`: a gpu hit) scratch space (True).
        None: another call is promoting `key` right now. `CapacityError` when no room can be
        made."""
        share = room.share or self._plan_room(room, length)
        size = self.host.units_for(length) * PAGE
        if room.promote_only and (scratch or not share.promotes(size)):
            raise CapacityError("a prefetch promotes within the prompt's share of host only")
        if not scratch and share.promotes(size):
            dst = await self._reserve(self.host_level, key, namespace, layout_digest, length)
            if dst is not None:
                share.used += size
                self._promoting_into(key)
            return dst, False
        level = self.host_level
        while (space := self.host.prepare_scratch(length, room.owner)) is None:
            plan = self.placement.room(level, size, partial=True, owner=room.owner)
            if plan.short:  # never another of its own, unless it holds more than its share
                victim = self._give_way(room, share)
                if victim is None:
                    raise CapacityError("host tier is full of pinned or in-flight blocks")
                plan = RoomPlan(level, size, [self.placement.move(level, victim)])
            await self._carry_out(plan)
        return space, True

    def _promoting_into(self, key: bytes) -> None:
        """Note a host reservation a fetch reads `key` into, until it lands (`_stage`)."""
        done = asyncio.get_running_loop().create_future()
        self._promoting[key] = done

        def landed() -> None:
            if self._promoting.get(key) is done:
                del self._promoting[key]
            if not done.done():
                done.set_result(None)

        self.host.when_landed(key, landed)

    async def _await_promotion(self, key: bytes, until: float) -> None:
        """Wait until another call's promotion of `key` lands (committed or given up), or
        `until` (monotonic) passes."""
        done = self._promoting.get(key)
        if done is not None and (left := until - time.monotonic()) > 0:
            await asyncio.wait([done], timeout=left)

    def _give_way(self, room: _Room, share: PromptShare) -> bytes | None:
        """The prompt's host block the placement engine picks to give way (`PromptShare.
        giving_way`), unpinned for demotion; else None."""
        host = self.host
        i = share.giving_way([host.entries.get(e.key) is e and host.policy.pin_count(e.key) == 1
                              for e in room.held])
        if i is None:
            return None
        entry = room.held.pop(i)
        host.complete_load(entry)
        share.used -= entry.units * PAGE
        return entry.key

    def _read_into_host(self, disk: DiskTier, src: BlockEntry, dst: BlockEntry,
                        clock: _ReadClock | None = None, first: bool = True) -> bool:
        """In an I/O thread: back `dst`'s pages (fresh ones after a restart), then read;
        nothing (False) when `clock` says the read would end past the fetch's answer, unless
        it is the `first`. Asked here, as the read starts: the pool starts reads in the
        fetch's order, so those skipped are the prefix's tail."""
        if clock is not None and not first and not clock.may_start():
            return False
        began = time.monotonic()
        self.host.back(dst)
        disk.read_into(src, self.host.memview(dst))
        if clock is not None:
            clock.took(time.monotonic() - began)
        return True

    async def _read_disk(self, s: _Staged, clock: _ReadClock | None = None,
                         first: bool = True) -> Exception | None:
        """Read one staged disk block into its host reservation (then commit it) or scratch
        space; give it back on failure. Returns the failure (integrity or I/O) instead of
        raising, so one bad block does not abandon its neighbours' reads; `_Skipped` when
        `clock` let it not start (never the `first`; `s` is then the caller's to give back)."""
        disk, src = self.disk, s.src
        if disk is None or src is None:
            return None  # only staged disk hits are read
        try:
            if not await self._run_io(self._read_into_host, disk, src, s.dst, clock, first):
                return _Skipped()
        except (IntegrityError, OSError) as e:
            s.abandon(self)
            return e
        disk.complete_load(src)
        s.done = True
        self.counters.add(self.counters.bytes_read, disk.name, src.length)
        if s.holds == "scratch":
            self.counters.scratch_reads += 1
            return None
        # Committed and pinned at once: other reads of this fetch still run, and meanwhile
        # other calls evict unpinned host blocks to make room.
        self.host.complete_store(s.dst)
        self.host.prepare_load(s.dst.key)
        s.holds = "pinned"
        self.counters.promotions += 1
        self.counters.add(self.counters.bytes_written, self.host.name, s.dst.length)
        return None

    async def _stage_remote(self, remote: _RemoteReads, i: int, lease: FetchLease,
                            staged: list[_Staged], room: _Room, limit: int) -> _Staged | None:
        """`keys[i]` read from the remote tier into host (a promotion, pinned like a host hit,
        or scratch space), in a new batch of up to `limit` blocks from `i` on. None ends the
        prefix."""
        await self._read_remote(remote, i, lease, staged, room, limit)
        return remote.take(i)

    def _back(self, entries: list[BlockEntry]) -> None:
        for entry in entries:
            self.host.back(entry)

    async def _read_remote(self, remote: _RemoteReads, i: int, lease: FetchLease,
                           staged: list[_Staged], room: _Room, limit: int) -> None:
        """Read a batch of up to `limit` blocks from `keys[i]` on, skipping those a local tier
        holds (the fetch stages them): which of them the remote tier holds first (their
        headers), then host room (a reservation or scratch space) for its prefix of hits,
        then one pipelined GET into those rooms, verified there. Room is made only for blocks
        the remote tier holds: a read that finds nothing moves nothing. The batch keeps its
        prefix of hits (`remote.read`); the rooms past its first miss are given back."""
        keys, size = remote.keys, remote.block_bytes
        todo = [i]
        for j in range(i + 1, len(keys)):
            if len(todo) >= max(1, min(remote.batch, limit)):
                break
            if self.placement.source(keys[j]) is None:
                todo.append(j)
        # Blocks of the last batch not taken yet (a key it skipped as local was evicted by
        # its own room-making, so the fetch reads that key now): given back, not dropped
        # with their pins; a local tier holds them now, so a later batch skips them.
        remote.abandon(self)
        began = time.perf_counter()
        try:
            held = await remote.remote.held(remote.namespace, [keys[j] for j in todo],
                                            remote.layout_digest, size)
        except RemoteUnavailableError as e:
            log.debug("remote read skipped: %s", e)
            return
        finally:
            remote.seconds += time.perf_counter() - began
        batch: list[_Staged] = []
        try:
            for j in todo[: next((n for n, h in enumerate(held) if not h), len(held))]:
                try:
                    dst, scratch = await self._take_room(room, keys[j], remote.namespace,
                                                         remote.layout_digest, size)
                except CapacityError:
                    lease.more = lease.more or (j == i and bool(staged))  # copy these, ask again
                    break
                if dst is None:  # another call is promoting or publishing it right now
                    break
                batch.append(_Staged(remote.remote.name, dst,
                                     holds="scratch" if scratch else "reservation"))
            if not batch:
                return
            if any(self.host.unbacked(s.dst) for s in batch):
                await self._run_io(self._back, [s.dst for s in batch])
            began = time.perf_counter()
            try:
                ok = await remote.remote.get_into(
                    remote.namespace, [keys[j] for j in todo[: len(batch)]],
                    remote.layout_digest, [self.host.memview(s.dst) for s in batch])
            except RemoteUnavailableError as e:
                log.debug("remote read skipped: %s", e)
                ok = []
            remote.seconds += time.perf_counter() - began
        except BaseException:
            for s in batch:
                s.abandon(self)
            raise
        hits = next((n for n, hit in enumerate(ok) if not hit), len(ok))
        remote.nbytes += hits * size
        for s in batch[hits:]:
            s.abandon(self)  # past the first miss: the prefix ends there
        self.counters.add(self.counters.bytes_read, remote.remote.name, hits * size)
        for s in batch[:hits]:
            if s.holds == "scratch":
                self.counters.scratch_reads += 1
                continue
            self.host.complete_store(s.dst)
            self.counters.promotions += 1
            self.counters.add(self.counters.bytes_written, self.host.name, s.dst.length)
            s.dst, s.holds = self.host.prepare_load(s.dst.key), "pinned"
        remote.read = dict(zip(todo, batch[:hits], strict=False))

    def _integrity_failure(self, tier: Tier, entry: BlockEntry, error: Exception) -> None:
        self.counters.integrity_failures += 1
        log.warning("integrity failure in %s tier, block %s: %s; deleting it", tier.name,
                    entry.key.hex()[:16], error)
        tier.discard(entry.key)  # hidden now; freed once other readers (failing too) let go

    # ---- publish (two-phase)
    def present(self, key: bytes) -> bool:
        return any(key in t.entries for t in self.tiers)  # committed or being written

    async def reserve(self, namespace: bytes, layout_digest: bytes, keys: Sequence[bytes],
                      length: int, owner: str = "", hold: bool = False,
                      prior: Sequence[bytes] = (), writer: str = "") -> PublishLease:
        """Reserve host space for the keys not yet stored, stopping at the first that fails.

        A block after a hole would be unreachable (lookups stop at the hole), so the lease
        covers a prefix: `needed[i]` is False for blocks already there and the list ends where
        space ran out. `hold` as for `fetch`. `prior`: the prompt's keys before `keys` (its
        earlier rounds), ranked with them at commit so the prompt's head stays the freshest.
        `writer`: the client process's lock file (`kvstore.writer_lock`), for zero-copy
        writes: should the lease expire, its space stays fenced while that process lives.
        """
        lease = self._new_lease(PublishLease, owner)
        lease.writer = writer
        try:
            for key in keys:
                if self.present(key):
                    lease.needed.append(False)
                    continue
                try:
                    entry = await self._reserve(self.host_level, key, namespace,
                                                layout_digest, length)
                except CapacityError as e:
                    log.debug("publish stops at a full host tier: %s", e)
                    lease.more = bool(lease.entries)
                    break
                if entry is None:  # another publisher reserved it while we made room
                    lease.needed.append(False)
                    continue
                lease.entries.append(entry)
                lease.needed.append(True)
            lease.keys = [*prior, *keys[: len(lease.needed)]]
        except BaseException:
            self.release(lease.id)
            raise
        return self.hand_over(lease, hold)

    def commit(self, lease_id: int, owner: str = "") -> int:
        """Make a publish lease's blocks visible and end it. The lease is checked before it is
        touched: a wrong id, kind or owner changes nothing (the lease keeps its pins)."""
        lease = self._lease(lease_id, owner)
        if not isinstance(lease, PublishLease):
            raise InvalidArgumentError(f"lease {lease_id} is a fetch lease: Commit ends publish "
                                       "leases (end a fetch lease with Release)")
        del self.leases[lease_id]
        share = self.write_queue is not None and self.placement.share_on_commit()
        for entry in lease.entries:
            self.host.complete_store(entry)
            if share and self.write_queue is not None:
                # write-through; shed (counted) when full
                self.write_queue.put(entry.key, owner=owner_of(entry.namespace))
        # The whole chain, blocks that were already present and earlier rounds' included:
        # touching only the new ones would leave their parents older than them, so LRU would
        # evict parents first and a cut-short SIGTERM flush would write children first.
        self.touch_chain(lease.keys)
        n = len(lease.entries)
        self.counters.stored_blocks += n
        self.counters.add(self.counters.bytes_written, self.host.name,
                          sum(e.length for e in lease.entries))
        return n

    async def _reserve(self, level: int, key: bytes, namespace: bytes, layout_digest: bytes,
                       length: int) -> BlockEntry | None:
        """Reserve space at `level` (host, or gpu for a promotion), carrying out the placement
        engine's room plans until it fits.

        None when another call reserved `key` there meanwhile: demotions await copies and
        disk writes, and other calls run during them. `CapacityError` when no room can be
        made: the level is full of pinned or in-flight blocks, or its victims have nowhere to
        go (a gpu victim is never dropped while host can take it).
        """
        tier = self.tiers[level]
        while True:
            if tier.holds(key):
                return None
            entry = tier.prepare_store(key, namespace, layout_digest, length)
            if entry is not None:
                return entry
            plan = self.placement.room(level, tier.units_for(length) * PAGE, partial=True,
                                       owner=owner_of(namespace))
            if plan.short:
                raise CapacityError(f"{tier.name} tier is full of pinned or in-flight blocks")
            if await self._carry_out(plan) == len(plan.moves):
                raise CapacityError(f"{tier.name} tier: the level below takes none of its "
                                    "victims")

    async def _carry_out(self, plan: RoomPlan) -> int:
        """Carry out a room plan: copy its victims down where it says (gpu to host, host to
        disk), then drop them from their level. Every victim is pinned before the first copy,
        in the same step as the plan was made, so no concurrent call picks one; a victim
        another call pins meanwhile stays. Returns how many victims stayed because the level
        below could not take them (a gpu victim host has no room for: kept, not dropped; a
        host victim the disk refuses is dropped, as a disk must not block the host tier)."""
        src = self.tiers[plan.level]
        claimed = [src.prepare_load(m.key) for m in plan.moves]  # pinned while copied down
        kept: set[bytes] = set()
        try:
            for move, entry in zip(plan.moves, claimed, strict=True):
                if move.dst is None:
                    continue
                dst = self.tiers[move.dst]
                if dst is self.disk and self.disk is not None:
                    if not self.disk.holds(move.key):
                        await self._write_disk(self.disk, entry)
                elif (dst is self.host and isinstance(src, GpuTier)
                      and not await self._demote_to_host(src, entry)):
                    kept.add(move.key)
        finally:
            for entry in claimed:
                src.complete_load(entry)
        for move, entry in zip(plan.moves, claimed, strict=True):
            if move.key in kept or not src.evict(move.key):
                continue
            if self.write_queue is not None and self.placement.share_on_leave(move):
                # The writer checks the remote tier lacks it, then reads it back from disk.
                self.write_queue.put(move.key, check_exists=True,
                                     owner=owner_of(entry.namespace))
        return len(kept)

    async def _demote_to_host(self, gpu: GpuTier, src: BlockEntry) -> bool:
        """Copy a pinned gpu victim down into host (making room there by the engine's plans);
        False when host cannot take it now."""
        try:
            dst = await self._reserve(self.host_level, src.key, src.namespace,
                                      src.layout_digest, src.length)
        except CapacityError as e:
            log.debug("gpu victim kept: %s", e)
            return False
        if dst is None:  # host holds it now (published or promoted meanwhile)
            return True
        try:
            await self._run_io(gpu.read_into, src, self.host.memview(dst))
        except BaseException:
            self.host.abort_store(dst)
            raise
        self.host.complete_store(dst)
        self.counters.demotions += 1
        self.counters.add(self.counters.bytes_written, self.host.name, src.length)
        return True

    async def _write_disk(self, disk: DiskTier, src: BlockEntry, seq: int | None = None,
                          tier: Tier | None = None) -> bool:
        """Copy a pinned block of `tier` (host by default) to disk, evicting disk blocks as
        needed; True if written."""
        level = self.tiers.index(disk)
        try:
            while (dst := disk.prepare_store(src.key, src.namespace, src.layout_digest,
                                             src.length)) is None:
                plan = self.placement.room(level, disk.units_for(src.length) * PAGE,
                                           partial=True, owner=owner_of(src.namespace))
                if plan.short:
                    return False  # disk full of in-flight blocks: drop rather than block
                for move in plan.moves:  # the last level: its victims are dropped
                    disk.evict(move.key)
        except CapacityError:
            return False  # larger than the whole disk tier
        try:
            await self._run_io(self._write_record, disk, dst, tier or self.host, src, seq)
        except OSError as e:
            log.warning("demotion to disk failed: %s", e)
            disk.abort_store(dst)
            return False
        except BaseException:
            disk.abort_store(dst)
            raise
        disk.complete_store(dst)
        self.counters.demotions += 1
        self.counters.add(self.counters.bytes_written, disk.name, src.length)
        return True

    def _write_record(self, disk: DiskTier, dst: BlockEntry, tier: Tier, src: BlockEntry,
                      seq: int | None) -> None:
        """In a worker: write `src` (host memory, or a gpu block staged through a host buffer
        first: only the shutdown flush writes gpu blocks to disk) into disk record `dst`."""
        if isinstance(tier, GpuTier):
            staged = memoryview(bytearray(src.length))
            tier.read_into(src, staged)
            disk.write(dst, staged, seq)
        else:
            disk.write(dst, self.host.memview(src), seq)

    async def flush(self, budget_s: float) -> int:
        """Write the blocks of the memory tiers (host, gpu) that disk lacks, for up to
        `budget_s` seconds, so a planned restart keeps them. Returns how many were written.

        They are written in the placement engine's order (`Hierarchy.flush_order`: each recent
        prompt from its start, never a block past a hole, as the budget may run out) and
        ranked so that, after a restart, the first written is the most recently used: parents
        ahead of children.
        """
        await self.stop_lifts()  # shutdown: no block moves up while the flush writes down
        await self.stop_prefetch()
        disk = self.disk
        if disk is None or budget_s <= 0:
            return 0
        end = self.clock() + budget_s
        below = self.tiers.index(disk)
        upper = [self.host] + [t for t in self.tiers[:below] if t is not self.host]
        bound = sum(t.committed_blocks for t in upper)  # each key comes once: a bound on ranks
        top = disk.reserve_seqs(bound) + bound - 1
        written = 0
        for rank, key in enumerate(self.placement.flush_order(below)):
            if self.clock() >= end:
                break
            tier = next((t for t in upper if t.contains(key)), None)
            if tier is None or disk.holds(key):
                continue
            entry = tier.prepare_load(key)
            try:
                written += await self._write_disk(disk, entry, seq=top - rank, tier=tier)
            finally:
                tier.complete_load(entry)
        return written

    # ---- remote write-through (the task and its batches: `server.remote_writer`)
    async def remote_writer(self) -> None:
        """The write-through task; returns at once without a remote tier."""
        if self.writer is not None:
            await self.writer.run()

    async def drain_remote(self, budget_s: float) -> bool:
        """On shutdown: wait up to `budget_s` for queued write-through; True if it finished."""
        return await self.writer.drain(budget_s) if self.writer is not None else True

    async def clear_remote(self, namespace: bytes | None) -> int:
        """Remove a namespace's blocks (all when None) from the shared remote tier, so a
        cleared prefix does not come straight back through read-through."""
        if self.remote is None:
            return 0
        try:
            return await self.remote.clear(namespace)
        except RemoteUnavailableError as e:
            log.warning("clearing the remote tier failed: %s", e)
            return 0

    async def close_remote(self) -> None:
        if self.remote is not None:
            await self.remote.close()

    # ---- leases
    def _lease(self, lease_id: int, owner: str) -> Lease:
        lease = self.leases.get(lease_id)
        if lease is None or lease.owner != owner:  # another tenant's lease: as if absent
            self.fences.end(lease_id, owner)  # a fenced writer's Commit: its copy is over
            raise NotFoundError(f"no lease {lease_id} (expired or already ended)")
        return lease

    def hand_over(self, lease: L, hold: bool = False) -> L:
        """A lease its builder is done with: still held by the caller (`hold`), or the
        client's, with `lease_timeout_s` from now."""
        lease.held = hold
        lease.expires = self.clock() + self.lease_timeout_s
        return lease

    def client_writers(self) -> int:
        """Publishes whose clients may be writing into the host arena now: zero-copy
        reservations handed out and not ended, and fenced ones (`server/fences.py`)."""
        return len(self.fences) + sum(isinstance(lease, PublishLease) and not lease.held
                                      for lease in self.leases.values())

    def _new_lease(self, cls: type[L], owner: str = "") -> L:
        # Unguessable ids: a lease is a capability (whoever names it may commit or release
        # it), so another client must not end one, or commit a half-written block, by
        # counting. Never 0: that means "no lease" on the wire.
        while ((lease_id := secrets.randbits(63)) in self.leases or lease_id in self.fences
               or lease_id == 0):
            pass
        lease = cls(lease_id, self.clock() + self.lease_timeout_s, owner)
        self.leases[lease.id] = lease
        return lease

    def release(self, lease_id: int, owner: str | None = None) -> bool:
        """End a fetch lease (unpin) or abandon a publish reservation (free its space).
        With `owner`, only a lease of that tenant is ended (False otherwise)."""
        lease = self.leases.get(lease_id)
        if lease is None or (owner is not None and lease.owner != owner):
            self.fences.end(lease_id, owner)  # a fenced writer's Release: its copy is over
            return False
        del self.leases[lease_id]
        if (lift := self._lifting) is not None and lease_id in lift.leases:
            lift.leases.discard(lease_id)
            if not lift.leases:
                lift.clients_done.set()  # its fetch's clients are done: the lift may copy
        if isinstance(lease, FetchLease):
            for entry, in_slab in zip(lease.entries, lease.in_slab, strict=True):
                if in_slab and self.gpu is not None:
                    self.gpu.complete_load(entry)
                else:
                    self.host.complete_load(entry)  # a no-op for scratch space (under no key)
            for entry in lease.scratch:
                self.host.free_scratch(entry)
        else:
            for entry in lease.entries:
                self.host.abort_store(entry)
        return True

    def reap_expired(self) -> int:
        now = self.clock()
        # A held lease belongs to a call still moving its bytes; that call bounds its own time.
        expired = [i for i, lease in self.leases.items()
                   if lease.expires <= now and not lease.held]
        for lease_id in expired:
            lease = self.leases[lease_id]
            log.info("%s lease %d expired; reclaiming its blocks", lease.kind, lease_id)
            if isinstance(lease, PublishLease) and lease.writer and self.fences.max_s > 0:
                # Its writer may still be copying into the slots: keep them out of use.
                del self.leases[lease_id]
                space = [d for e in lease.entries if (d := self.host.detach(e)) is not None]
                self.fences.fence(lease_id, lease.owner, lease.writer, space)
            else:
                self.release(lease_id)
            self.counters.expired_leases += 1
        self.fences.sweep()
        return len(expired)

    async def reaper(self, period_s: float = 0.5) -> None:
        while True:
            await asyncio.sleep(period_s)
            self.reap_expired()

    async def recheck_disk(self) -> bool:
        """If the disk tier is degraded, let it take writes again when the disk does
        (`DiskTier.try_recover`); True when it takes writes (or was never degraded)."""
        disk = self.disk
        if disk is None or not disk.degraded:
            return True
        for _ in range(3):  # again when blocks were dropped while the check ran
            try:
                handled = await self._run_io(disk.try_recover)
            except Exception as e:  # OSError, or RocksDB's plain Exception
                # Said once per kind of failure: the figures in it (free space, RocksDB's
                # file numbers and timestamps) change from one check to the next.
                kind = re.sub(r"[0-9.]+", "#", one_line(e))
                if kind != self._disk_recheck_failed:
                    log.info("disk tier still takes no writes: %s", one_line(e))
                    self._disk_recheck_failed = kind
                return False
            self._disk_recheck_failed = ""
            if disk.resume(handled):
                return True
        return False

    async def disk_watch(self, period_s: float) -> None:
        """Every `period_s`, `recheck_disk` (`disk_recheck_s`). A tier that degrades again
        within ten periods of taking writes (a disk failing now and then) waits twice as
        long before its next check each time, up to 32 periods, so it does not flap (an
        ERROR and a WARNING line, a block lost) every period."""
        hold, recovered_at = 1, None
        while True:
            await asyncio.sleep(period_s)
            disk = self.disk
            if disk is None or not disk.degraded:
                continue
            if recovered_at is not None:  # the first look since it degraded again
                flapped = disk.degraded_at - recovered_at < 10 * period_s
                hold = min(hold * 2, 32) if flapped else 1
                recovered_at = None
                if hold > 1:
                    log.warning("disk tier degraded again soon after taking writes; next "
                                "check in %.0f s", (hold - 1) * period_s)
                    await asyncio.sleep((hold - 1) * period_s)
            try:
                if await self.recheck_disk():
                    recovered_at = time.monotonic()
                self._disk_watch_failed = False
            except Exception:  # never end the watch: the tier would stay degraded for good
                log.debug("disk tier recheck failed", exc_info=True)
                if not self._disk_watch_failed:
                    log.exception("disk tier recheck failed (logged once; then at DEBUG)")
                    self._disk_watch_failed = True

    # ---- admin
    async def clear_everywhere(self, namespace: bytes | None) -> tuple[int, int]:
        """`clear`, then `clear_remote`: (local blocks removed, remote values removed). The
        write-through of the namespace's queued blocks is dropped first, and the batches
        already taken are waited for: a batch framed before the Clear would land in the
        remote tier after it, and its blocks, pinned while framed, would outlive the local
        clear."""
        if self.write_queue is not None and self.writer is not None \
                and self.remote is not None:
            for tier in self.tiers:
                for key in tier.keys(namespace):
                    self.write_queue.discard(key)
            if not await self.writer.settled(2 * self.remote.deadline_s(WRITE_BATCH_BYTES)):
                log.warning("clearing while write-through batches are still being sent: some "
                            "cleared blocks may come back")
        removed = self.clear(namespace)
        return removed, await self.clear_remote(namespace)

    def clear(self, namespace: bytes | None) -> int:
        """Remove the blocks of a namespace (all when None) from every tier. A block a
        reader pins is gone for every later lookup at once; its space is freed when the
        reader lets go (`Tier.discard`). A block being written now (a promotion, a
        demotion's copy, a publish) goes once it lands: it holds what was there before the
        Clear. Returns the blocks removed now."""
        removed: set[bytes] = set()
        loop = asyncio.get_running_loop()
        with (self.events.clearing_all() if self.events is not None and namespace is None
              else contextlib.nullcontext()):
            for tier in self.tiers:
                for key, entry in list(tier.entries.items()):
                    if namespace is not None and entry.namespace != namespace:
                        continue
                    if not entry.committed:
                        # On the next turn of the loop: whoever wrote it pins it first
                        # (a promotion is committed, then pinned for its reader).
                        tier.when_landed(key, functools.partial(loop.call_soon, tier.discard,
                                                                key))
                    elif tier.discard(key):
                        removed.add(key)
        if self.write_queue is not None:
            for key in removed:
                self.write_queue.discard(key)  # or write-through would share it after all
        return len(removed)

    def close(self) -> None:
        for run in self._prefetching.values():
            run.task.cancel()  # as a lift's: its read in flight ends in the pool shutdown
        if (lift := self._lifting) is not None and self.gpu is not None:
            # Not awaited (close is synchronous): its copy in flight ends in the pool shutdown
            # below, and the task unwinds on closed tiers if the loop runs it again.
            if lift.task is not None:
                lift.task.cancel()
            self._end_lift(self.gpu, lift)
        for lease_id in list(self.leases):
            self.release(lease_id)
        self.fences.close()
        self._io.shutdown(wait=True)
        for tier in self.tiers:
            with contextlib.suppress(Exception):
                tier.close()
