"""The client against what a daemon answers, over both transports:

- a prompt of more blocks than the daemon's `max_blocks_per_call` works as a short one does
  (the client splits its calls by that limit, learned from Info): byte-identical round trips,
  the whole prefix found, while a prompt within the limit still costs one round trip;
- a peer whose replies are inconsistent with the request (more blocks than asked for, block
  sizes off the layout, offsets past the arena, data past the blocks it announced) is a miss,
  counted in `daemon_faults`, never an exception and never data past the prompt: a fake
  daemon (a real gRPC server) on TCP and on a Unix socket;
- `fetch(into=...)` fills an `into` of any memory layout over TCP as over the Unix socket.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

import kvstore.client.aio as aio
from kvstore.client import KVClient
from kvstore.client.aio import AsyncKVClient
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from tests.conftest import random_kv, same_bytes, small_layout
from tests.redis_servers import free_port

LAYOUT = small_layout()  # 16-token blocks of 8 KiB
BT = LAYOUT.block_tokens
LIMIT = 8  # the daemon's --max-blocks-per-call
BLOCKS = 30  # the prompt: several calls' worth, not a multiple of the limit


@pytest.fixture
def limited(daemon_factory):
    """A daemon taking at most `LIMIT` keys per call, on its Unix socket and loopback TCP."""
    address, token = f"127.0.0.1:{free_port()}", secrets.token_hex(16)
    daemon = daemon_factory("--host-bytes", "8MiB", "--max-blocks-per-call", str(LIMIT),
                            "--listen", address, "--token", token).start()
    return {"unix": (daemon.target, None), "tcp": (address, token)}


class Calls:
    """Records the unary calls clients make (`AsyncKVClient._unary`), by method name."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.names: list[str] = []
        unary = AsyncKVClient._unary

        async def recorded(client: AsyncKVClient, method: str, request: object,
                           until: float | None = None) -> Any:
            self.names.append(method)
            return await unary(client, method, request, until)

        monkeypatch.setattr(AsyncKVClient, "_unary", recorded)


def _consumer() -> tuple[dict[int, torch.Tensor], Callable[..., int | None]]:
    got: dict[int, torch.Tensor] = {}

    def consume(blocks: list[int], views: list[torch.Tensor], stop: threading.Event) -> None:
        for b, v in zip(blocks, views, strict=True):
            assert b not in got  # each block handed over once
            got[b] = v.clone()

    return got, consume


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_a_prompt_several_times_the_daemon_limit_round_trips(limited, transport):
    target, token = limited[transport]
    tokens = list(range(BLOCKS * BT + 5))  # and a partial last block
    full = BLOCKS * BT
    kv = random_kv(LAYOUT, len(tokens))
    with KVClient(target, LAYOUT, token=token) as c:
        assert c.publish(tokens, kv) == full
        assert c.lookup(tokens) == full
        assert c.held(tokens) == [True] * BLOCKS
        n, got = c.fetch(tokens)
        assert n == full and same_bytes(got, kv[:, :, :full])
        into = torch.zeros(LAYOUT.kv_shape(len(tokens)), dtype=LAYOUT.torch_dtype)
        n, got = c.fetch(tokens, into=into)
        assert n == full and same_bytes(into[:, :, :full], kv[:, :, :full])
        for whole in (False, True):
            blocks, consume = _consumer()
            assert c.fetch_with(tokens, consume, whole=whole) == full
            assert sorted(blocks) == list(range(BLOCKS))
            assert all(same_bytes(blocks[b], kv[:, :, b * BT : (b + 1) * BT]) for b in blocks)
        blocks, consume = _consumer()
        assert c.fetch_with(tokens, consume, skip_blocks=LIMIT + 3) == full
        assert sorted(blocks) == list(range(LIMIT + 3, BLOCKS))
        assert c.plan(tokens, prefill_tokens_per_s=1.0).load_blocks == BLOCKS

        # publish_with: a second prompt, written block by block
        other = [t + 100_000 for t in tokens]
        kv2 = random_kv(LAYOUT, len(other), seed=1)

        def produce(blocks: list[int], views: list[torch.Tensor], stop: threading.Event,
                    ) -> None:
            for b, v in zip(blocks, views, strict=True):
                v.copy_(kv2[:, :, b * BT : (b + 1) * BT])

        assert c.publish_with(other, produce) == full
        n, got = c.fetch(other)
        assert n == full and same_bytes(got, kv2[:, :, :full])
        assert c.end_session(other) >= BLOCKS


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_a_long_lookup_stops_at_the_first_part_not_hit_in_full(limited, transport):
    target, token = limited[transport]
    tokens = list(range(BLOCKS * BT))
    kv = random_kv(LAYOUT, len(tokens))
    cached = 2 * LIMIT + 3  # inside the third call's part
    with KVClient(target, LAYOUT, token=token) as c:
        assert c.publish(tokens[: cached * BT], kv[:, :, : cached * BT]) == cached * BT
        assert c.lookup(tokens) == cached * BT
        n, got = c.fetch(tokens)
        assert n == cached * BT and same_bytes(got, kv[:, :, : cached * BT])
        assert c.held(tokens) == [True] * cached + [False] * (BLOCKS - cached)
        # the rest stored now: the whole prefix, past the earlier miss
        assert c.publish(tokens, kv) == len(tokens)
        assert c.lookup(tokens) == len(tokens)


def test_a_prompt_within_the_limit_is_one_round_trip(limited, monkeypatch):
    """A TCP client learns the limit when a call is refused (then asks Info), or by asking
    Info before a call over `PRESUMED_MAX_KEYS`; a prompt within it costs one Lookup."""
    target, token = limited["tcp"]
    calls = Calls(monkeypatch)
    short, long = list(range(LIMIT * BT)), list(range(BLOCKS * BT))
    with KVClient(target, LAYOUT, token=token) as c:
        assert c.lookup(short) == 0
        assert calls.names == ["Lookup"]
        calls.names.clear()
        assert c.lookup(long) == 0  # within the presumed limit: sent, refused, split
        assert calls.names == ["Lookup", "Info", "Lookup"]  # the first part missed
        calls.names.clear()
        assert c.lookup(short) == 0
        assert calls.names == ["Lookup"]
    monkeypatch.setattr(aio, "PRESUMED_MAX_KEYS", 4)
    kv = random_kv(LAYOUT, len(long))
    with KVClient(target, LAYOUT, token=token) as c:
        calls.names.clear()
        assert c.publish(long, kv) == len(long)  # over the presumed limit: Info first
        assert calls.names[:2] == ["Info", "Lookup"]
        calls.names.clear()
        assert c.lookup(long) == len(long)
        assert calls.names == ["Lookup"] * -(-BLOCKS // LIMIT)


# ---- a peer whose replies do not fit the request
BB = LAYOUT.block_bytes
ARENA_BYTES = 64 * BB
LEASE = 7


class Garbage(pb_grpc.KVStoreServicer):
    """A fake daemon (grpc.aio) answering in `mode`; records the leases released and the
    reservations committed."""

    def __init__(self, mode: str, arena_path: str = "") -> None:
        self.mode = mode
        self.arena_path = arena_path
        self.released: list[int] = []
        self.committed: list[int] = []

    async def Info(self, request: pb.InfoRequest, context: Any) -> pb.InfoReply:
        return pb.InfoReply(version="0", arena_path=self.arena_path, arena_bytes=ARENA_BYTES,
                            arena_id="a", max_message_bytes=64 << 20, max_blocks_per_call=4096)

    async def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupReply:
        n = len(request.keys)
        if request.each:
            return pb.LookupReply(hits=n, found=[True] * (n + 3 * (self.mode == "more")))
        hits = {"more": n + 5, "publish_more": 0}.get(self.mode, n)
        return pb.LookupReply(hits=hits, tiers=["host"] * hits)

    async def Fetch(self, request: pb.FetchRequest, context: Any,
                    ) -> AsyncIterator[pb.FetchChunk]:
        n = len(request.keys)
        hits = n + 2 if self.mode == "more" else n
        length = BB // 2 if self.mode == "short_refs" else BB
        base = ARENA_BYTES - BB // 2 if self.mode == "past_arena" else 0
        refs = [pb.BlockRef(offset=base + i * BB, length=length, tier="host")
                for i in range(hits)]
        if request.transfer == pb.TRANSFER_SHM:
            yield pb.FetchChunk(hits=hits, lease_id=LEASE, blocks=refs, arena_id="a")
            return
        yield pb.FetchChunk(hits=hits, blocks=refs)
        for i in range(hits + (self.mode == "extra_data") - (self.mode == "short_data")):
            yield pb.FetchChunk(block_index=i, chunk_offset=0, data=bytes([i + 1]) * BB)

    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseReply:
        self.released.append(request.lease_id)
        return pb.ReleaseReply(released=True)

    async def Publish(self, request_iterator: Any, context: Any) -> pb.PublishReply:
        async for _ in request_iterator:
            pass
        return pb.PublishReply(stored=10**6)

    async def Reserve(self, request: pb.ReserveRequest, context: Any) -> pb.ReserveReply:
        n = len(request.keys) + 3 * (self.mode == "more")
        base = ARENA_BYTES - BB // 2 if self.mode == "past_arena" else 0
        return pb.ReserveReply(lease_id=LEASE, needed=[True] * n, arena_id="a", blocks=[
            pb.BlockRef(offset=base + i * BB, length=BB, tier="host") for i in range(n)])

    async def Commit(self, request: pb.CommitRequest, context: Any) -> pb.CommitReply:
        self.committed.append(request.lease_id)
        return pb.CommitReply(stored=10**6)

    async def EndSession(self, request: pb.EndSessionRequest,
                         context: Any) -> pb.EndSessionReply:
        return pb.EndSessionReply(marked=0)


async def _against(fake: Garbage, listen: str,
                   body: Callable[[Callable[[], AsyncKVClient]], Awaitable[None]]) -> None:
    """Run `body(new)` against `fake`, served on `listen` (`127.0.0.1:0`: a free port);
    `new()` makes a client of it (each closed at the end)."""
    server = grpc.aio.server()
    pb_grpc.add_KVStoreServicer_to_server(fake, server)
    port = server.add_insecure_port(listen)
    await server.start()
    target = listen.removeprefix("unix:") if listen.startswith("unix:") \
        else f"127.0.0.1:{port}"
    clients: list[AsyncKVClient] = []

    def new() -> AsyncKVClient:
        clients.append(AsyncKVClient(target, LAYOUT, deadline_s=2.0))
        return clients[-1]

    try:
        await body(new)
    finally:
        for c in clients:
            await c.close()
        await server.stop(0)


PROMPT = list(range(4 * BT))  # 4 blocks


@pytest.mark.parametrize("mode", ["more", "extra_data", "short_data"])
def test_a_tcp_peer_answering_more_than_asked_is_a_miss(mode):
    """Each call by a fresh client (no earlier failure's backoff answering for it): a miss
    or within the prompt, no exception, `consume` never handed a block past the prompt."""
    fake = Garbage(mode)

    async def body(new: Callable[[], AsyncKVClient]) -> None:
        c = new()
        assert c.transfer == "stream"
        assert await c.lookup(PROMPT) == (0 if mode == "more" else len(PROMPT))
        assert (await new().plan(PROMPT, 1.0)).load_blocks == (0 if mode == "more" else 3)
        for whole in (False, True):
            seen: list[int] = []
            got_tokens = await (c := new()).fetch_with(
                PROMPT, lambda b, v, s, seen=seen: seen.extend(b), whole=whole)
            assert got_tokens == 0 and all(b < 4 for b in seen)
            assert c.daemon_faults == 1
        n, got = await (c := new()).fetch(PROMPT)
        assert (n, got) == (0, None)
        assert c.daemon_faults == 1 and not c._breaker.open  # it answered: no outage
        into = torch.zeros(LAYOUT.kv_shape(len(PROMPT)), dtype=LAYOUT.torch_dtype)
        assert (await new().fetch(PROMPT, into=into))[0] == 0
        assert len(await new().held(PROMPT)) == 4

    asyncio.run(_against(fake, "127.0.0.1:0", body))


def test_a_tcp_peer_claiming_more_stored_than_sent_is_a_dropped_save():
    fake = Garbage("publish_more")

    async def body(new: Callable[[], AsyncKVClient]) -> None:
        c = new()
        assert await c.publish(PROMPT, random_kv(LAYOUT, len(PROMPT))) == 0
        assert await c.publish_with(PROMPT, lambda b, v, s: None) == 0
        assert c.daemon_faults == 2 and c.dropped_saves == 2

    asyncio.run(_against(fake, "127.0.0.1:0", body))


@pytest.mark.parametrize("mode", ["more", "short_refs", "past_arena"])
def test_a_same_node_peer_with_refs_off_the_layout_or_arena_is_a_miss(tmp_path: Path, mode):
    """Over the Unix socket (zero-copy): the fake's arena is a plain file of `ARENA_BYTES`."""
    arena = tmp_path / "arena"
    arena.write_bytes(b"\0" * ARENA_BYTES)
    sock = f"{tmp_path}/fake.sock"
    fake = Garbage(mode, str(arena))

    async def body(new: Callable[[], AsyncKVClient]) -> None:
        c = new()
        assert c.transfer != "stream"
        n, got = await c.fetch(PROMPT)
        assert n == 0 and got is None
        seen: list[int] = []
        assert await c.fetch_with(PROMPT, lambda b, v, s: seen.extend(b)) == 0
        assert seen == []  # refused before any view was made
        if mode != "short_refs":  # a Reserve's refs: more than asked, or past the arena
            assert await c.publish(PROMPT, random_kv(LAYOUT, len(PROMPT))) == 0
            assert await c.publish_with(PROMPT, lambda b, v, s: None) == 0
            assert fake.committed == []
        assert c.daemon_faults >= 2
        await asyncio.sleep(0.2)  # the leases go back in the background
        assert fake.released and set(fake.released) == {LEASE}

    if len(sock) > 100:
        pytest.skip("tmp_path too long for a Unix socket path")
    asyncio.run(_against(fake, f"unix:{sock}", body))


# ---- fetch(into=...) of any memory layout
def _intos() -> dict[str, torch.Tensor]:
    L, K, T, H, D = LAYOUT.kv_shape(64)
    dt = LAYOUT.torch_dtype
    return {
        "token-major": torch.zeros(T, L, K, H, D, dtype=dt).permute(1, 2, 0, 3, 4),
        "strided last dim": torch.zeros(L, K, T, H, 2 * D, dtype=dt)[..., ::2],
        "head-major": torch.zeros(L, K, H, T, D, dtype=dt).transpose(2, 3),
    }


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_fetch_into_a_tensor_of_another_memory_layout(daemon_factory, transport):
    address, token = f"127.0.0.1:{free_port()}", secrets.token_hex(16)
    d = daemon_factory("--host-bytes", "8MiB", "--listen", address, "--token", token).start()
    target, tok = (d.target, None) if transport == "unix" else (address, token)
    tokens = list(range(64))
    kv = random_kv(LAYOUT, 64)
    with KVClient(target, LAYOUT, token=tok) as c:
        assert c.publish(tokens, kv) == 64
        for name, into in _intos().items():
            n, got = c.fetch(tokens, into=into)
            assert n == 64, name
            assert same_bytes(into, kv), name
            assert got is not None and got.data_ptr() == into.data_ptr(), name
