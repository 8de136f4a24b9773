"""`AsyncKVClient`: lookup, fetch and publish a prompt's KV blocks against a kvstore daemon.

Keys are computed here (chained SHA-256 over the tokens, see `kvstore.keys`). Over a Unix socket
the client maps the daemon's host arena and copies blocks straight in and out of shared memory;
over TCP (or when the arena cannot be mapped) it streams them.

The engine's contract: a daemon that is down, slow, full or restarting is a miss within
`deadline_s` (logged once per outage), never an exception. Bad input from the caller (a wrong
shape or dtype, non-integer tokens) raises `InvalidArgumentError` naming what is wrong.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Literal, TypeVar

import grpc
import numpy as np
import torch

from client.backoff import BackoffPolicy, Breaker
from kvstore.arena import Arena
from kvstore.errors import InvalidArgumentError, KVStoreError
from kvstore.keys import Namespace, chain_keys
from kvstore.layout import KVLayout
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc

log = logging.getLogger("kvstore.client")
T = TypeVar("T")
Tokens = Sequence[int] | torch.Tensor | np.ndarray
STREAM_CHUNK = 4 << 20
# Statuses that mean "the daemon can't serve this now": a miss, and back off.
_OUTAGE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
           grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
           grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED}


def normalize_target(target: str) -> tuple[str, bool]:
    """gRPC target and whether it is a Unix socket (`/p`, `unix:/p`, `unix:///p`, `host:port`)."""
    if target.startswith("/"):
        return f"unix:{target}", True
    if target.startswith("unix:"):
        return target, True
    return target, False


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
        self.target, self.is_unix = normalize_target(target)
        self.layout = layout
        self.namespace = Namespace(layout, lora=lora, tenant=tenant, salt=salt)
        self._ns = self.namespace.digest()
        self._layout_pb = pb.Layout(**layout.to_dict())
        self.deadline_s = deadline_s
        self.transfer = transfer if self.is_unix else "stream"
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._max_msg = max_message_bytes
        self._breaker = Breaker(backoff or BackoffPolicy(), log, self.target)
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.KVStoreStub | None = None
        self._arena: Arena | None = None
        self._arena_id = ""

    # ---- public API
    def keys(self, tokens: Tokens) -> list[bytes]:
        """Chained keys of the full blocks of `tokens` in this client's namespace."""
        return chain_keys(self._ns, tokens, self.layout.block_tokens)

    async def lookup(self, tokens: Tokens) -> int:
        """Tokens in the longest cached prefix of `tokens` (a multiple of block_tokens)."""
        keys = self.keys(tokens)
        if not keys:
            return 0
        reply = await self._guard(lambda: self._lookup(keys), None)
        return 0 if reply is None else reply.hits * self.layout.block_tokens

    async def fetch(self, tokens: Tokens, into: torch.Tensor | None = None,
                    ) -> tuple[int, torch.Tensor | None]:
        """`(n, kv)`: the longest cached prefix, `kv` shaped `[layers, kv, n, heads, head_dim]`.

        With `into` (a tensor shaped for all of `tokens`), blocks are written into its first `n`
        tokens and `into[:, :, :n]` is returned. A miss is `(0, None)`.
        """
        keys = self.keys(tokens)
        if into is not None:
            self.layout.check_kv(into, into.shape[2] if into.dim() == 5 else -1)
            if into.shape[2] < len(keys) * self.layout.block_tokens:
                raise InvalidArgumentError("`into` holds fewer tokens than the prompt's blocks")
        if not keys:
            return 0, None
        result = await self._guard(lambda: self._fetch(keys, into), None)
        return (0, None) if result is None else result

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
        stored = await self._guard(lambda: self._publish(keys, kv), 0, publish=True)
        return stored * self.layout.block_tokens

    async def stats(self) -> pb.StatsReply | None:
        return await self._guard(lambda: self._unary("Stats", pb.StatsRequest()), None)

    async def clear(self, *, all_namespaces: bool = False) -> int:
        """Remove this namespace's blocks (or every block); returns how many were removed."""
        req = pb.ClearRequest(all=True) if all_namespaces else pb.ClearRequest(namespace=self._ns)
        reply = await self._guard(lambda: self._unary("Clear", req), None)
        return 0 if reply is None else reply.removed

    async def ping(self) -> bool:
        return await self._guard(lambda: self._info(), None) is not None

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._stub = None
        self._arena = None

    async def __aenter__(self) -> AsyncKVClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- failure policy
    async def _guard(self, call: Callable[[], Awaitable[T]], miss: T, publish: bool = False) -> T:
        if not self._breaker.allow():
            return miss
        try:
            async with asyncio.timeout(self.deadline_s):
                result = await call()
        except InvalidArgumentError:
            raise
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgumentError(f"daemon rejected the request: {e.details()}") from None
            if e.code() in _OUTAGE:
                self._outage(f"{e.code().name}: {e.details()}")
            else:  # RESOURCE_EXHAUSTED, NOT_FOUND...: this call misses, the daemon is fine
                log.debug("kvstore call missed: %s %s", e.code().name, e.details())
            return miss
        except (TimeoutError, OSError, KVStoreError) as e:
            self._outage(f"{type(e).__name__}: {e}")
            return miss
        self._breaker.success()
        return result

    def _outage(self, what: str) -> None:
        self._arena_id = ""  # the daemon may come back with another arena
        self._breaker.failure(what)

    # ---- transport
    def _stub_(self) -> pb_grpc.KVStoreStub:
        if self._stub is None:
            opts = [("grpc.max_receive_message_length", self._max_msg),
                    ("grpc.max_send_message_length", self._max_msg),
                    ("grpc.initial_reconnect_backoff_ms", 50),
                    ("grpc.max_reconnect_backoff_ms", 1000),
                    ("grpc.enable_retries", 0)]
            self._channel = grpc.aio.insecure_channel(self.target, options=opts)
            self._stub = pb_grpc.KVStoreStub(self._channel)
        return self._stub

    async def _unary(self, method: str, request: object) -> T:  # type: ignore[type-var]
        fn = getattr(self._stub_(), method)
        return await fn(request, timeout=self.deadline_s, metadata=self._metadata)

    async def _info(self) -> pb.InfoReply:
        return await self._unary("Info", pb.InfoRequest())

    async def _lookup(self, keys: list[bytes]) -> pb.LookupReply:
        return await self._unary("Lookup", pb.LookupRequest(namespace=self._ns, keys=keys))

    async def _arena_for(self, arena_id: str) -> Arena | None:
        """The mapped arena named `arena_id`, (re)attaching after a daemon restart."""
        if self._arena is not None and self._arena_id == arena_id:
            return self._arena
        info = await self._info()
        if info.arena_id != arena_id:
            return None  # restarted again under us: treat as a miss
        try:
            self._arena = Arena.attach(info.arena_path, info.arena_bytes)
        except (OSError, ValueError) as e:
            log.warning("cannot map the daemon's arena %s (%s); streaming instead",
                        info.arena_path, e)
            self.transfer = "stream"
            return None
        self._arena_id = arena_id
        return self._arena

    def _runs(self, arena: Arena, blocks: list[int], refs: list[pb.BlockRef],
              ) -> list[tuple[torch.Tensor, int]]:
        """Pair arena views with prompt positions, merging blocks that are adjacent both in
        the arena and in the prompt (the usual case): one large copy per run instead of one
        per block, which torch spreads over all cores.

        Returns (arena view `[L, kv, n, T, H, D]` over the run, index of its first block).
        """
        pairs: list[tuple[torch.Tensor, int]] = []
        i = 0
        shape = self.layout.block_shape
        while i < len(refs):
            j = i + 1
            while (j < len(refs) and blocks[j] == blocks[j - 1] + 1
                   and refs[j].offset == refs[j - 1].offset + refs[j - 1].length):
                j += 1
            raw = arena.tensor[refs[i].offset : refs[j - 1].offset + refs[j - 1].length]
            view = raw.view(self.layout.torch_dtype).view(j - i, *shape)  # type: ignore[arg-type]
            # [n, L, kv, T, H, D] -> [L, kv, n, T, H, D] -> tokens of the run in order
            pairs.append((view.permute(1, 2, 0, 3, 4, 5), blocks[i]))
            i = j
        return pairs

    def _prompt_view(self, t: torch.Tensor, first: int, n: int) -> torch.Tensor:
        """`t[:, :, first*T:(first+n)*T]` as `[L, kv, n, T, H, D]`."""
        bt = self.layout.block_tokens
        part = t[:, :, first * bt : (first + n) * bt]
        return part.unflatten(2, (n, bt))

    def _tokens_slice(self, i: int) -> slice:
        bt = self.layout.block_tokens
        return slice(i * bt, (i + 1) * bt)

    async def _fetch(self, keys: list[bytes], into: torch.Tensor | None,
                     ) -> tuple[int, torch.Tensor | None]:
        out = into
        done = 0
        while done < len(keys):
            n, more, out = await self._fetch_some(keys, done, out)
            done += n
            if not more or n == 0:
                break
        if done == 0 or out is None:
            return 0, None
        tokens = done * self.layout.block_tokens
        return tokens, out[:, :, :tokens]

    async def _fetch_some(self, keys: list[bytes], start: int, out: torch.Tensor | None,
                          ) -> tuple[int, bool, torch.Tensor | None]:
        """Fetch from block `start` on, into `out` (allocated for all keys on first need)."""
        shm = self.transfer != "stream"
        req = pb.FetchRequest(namespace=self._ns, layout=self._layout_pb, keys=keys[start:],
                              transfer=pb.TRANSFER_SHM if shm else pb.TRANSFER_STREAM)
        call = self._stub_().Fetch(req, timeout=self.deadline_s, metadata=self._metadata)
        stream: AsyncIterator[pb.FetchChunk] = call.__aiter__()
        head = await anext(stream)
        n = head.hits
        if n == 0:
            return 0, False, out
        if out is None:
            # Sized for every block asked for: the rest may still come in later rounds.
            out = torch.empty(self.layout.kv_shape(len(keys) * self.layout.block_tokens),
                              dtype=self.layout.torch_dtype)  # type: ignore[arg-type]
        if shm:
            try:
                arena = await self._arena_for(head.arena_id)
                if arena is None:
                    return 0, False, out
                await asyncio.to_thread(self._copy_out, arena, list(head.blocks), out, start)
            finally:
                await self._unary("Release", pb.ReleaseRequest(lease_id=head.lease_id))
        else:
            await self._receive(stream, n, out, start)
        return n, head.more, out

    def _copy_out(self, arena: Arena, refs: list[pb.BlockRef], out: torch.Tensor,
                  start: int) -> None:
        blocks = list(range(start, start + len(refs)))
        for view, first in self._runs(arena, blocks, refs):
            self._prompt_view(out, first, view.shape[2]).copy_(view)

    async def _receive(self, stream: AsyncIterator[pb.FetchChunk], n: int,
                       out: torch.Tensor, start: int) -> None:
        size = self.layout.block_bytes
        staging = np.empty(size, dtype=np.uint8)
        block, filled = 0, 0
        async for chunk in stream:
            if chunk.block_index != block or chunk.chunk_offset != filled:
                raise KVStoreError("fetch stream out of order")
            staging[filled : filled + len(chunk.data)] = np.frombuffer(chunk.data, np.uint8)
            filled += len(chunk.data)
            if filled == size:
                view = torch.from_numpy(staging).view(self.layout.torch_dtype)  # type: ignore[arg-type]
                out[:, :, self._tokens_slice(start + block)].copy_(
                    view.view(self.layout.block_shape))
                block, filled = block + 1, 0
        if block != n:
            raise KVStoreError(f"fetch stream ended after {block} of {n} blocks")

    async def _publish(self, keys: list[bytes], kv: torch.Tensor) -> int:
        if self.transfer == "stream":
            return await self._publish_stream(keys, kv)
        done = 0
        while done < len(keys):
            n, more = await self._publish_some(keys, done, kv)
            done += n
            if not more or n == 0:
                break
        return done

    async def _publish_some(self, keys: list[bytes], start: int, kv: torch.Tensor,
                            ) -> tuple[int, bool]:
        """Reserve, write and commit from block `start` on; returns (blocks covered, more)."""
        reply: pb.ReserveReply = await self._unary(
            "Reserve", pb.ReserveRequest(namespace=self._ns, layout=self._layout_pb,
                                         keys=keys[start:]))
        committed = False
        try:
            arena = await self._arena_for(reply.arena_id)
            if arena is None:
                return 0, False
            todo = [start + i for i, needed in enumerate(reply.needed) if needed]
            await asyncio.to_thread(self._copy_in, arena, todo, list(reply.blocks), kv)
            await self._unary("Commit", pb.CommitRequest(lease_id=reply.lease_id))
            committed = True
        finally:
            if not committed and reply.blocks:
                await self._unary("Release", pb.ReleaseRequest(lease_id=reply.lease_id))
        return len(reply.needed), reply.more

    def _copy_in(self, arena: Arena, todo: list[int], refs: list[pb.BlockRef],
                 kv: torch.Tensor) -> None:
        for view, first in self._runs(arena, todo, refs):
            view.copy_(self._prompt_view(kv, first, view.shape[2]))

    async def _publish_stream(self, keys: list[bytes], kv: torch.Tensor) -> int:
        have = (await self._lookup(keys)).hits
        if have == len(keys):
            return have
        send = keys[have:]

        async def messages() -> AsyncIterator[pb.PublishChunk]:
            yield pb.PublishChunk(namespace=self._ns, layout=self._layout_pb, keys=send)
            for j in range(len(send)):
                block = kv[:, :, self._tokens_slice(have + j)].contiguous()
                raw = block.view(torch.uint8).numpy().reshape(-1)
                for off in range(0, raw.size, STREAM_CHUNK):
                    yield pb.PublishChunk(block_index=j, chunk_offset=off,
                                          data=raw[off : off + STREAM_CHUNK].tobytes())

        reply: pb.PublishReply = await self._stub_().Publish(
            messages(), timeout=self.deadline_s, metadata=self._metadata)
        return have + reply.present + reply.stored


def _count(tokens: Tokens) -> int:
    return int(tokens.shape[0]) if isinstance(tokens, torch.Tensor | np.ndarray) else len(tokens)
