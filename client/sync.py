"""`KVClient`: the synchronous facade over `AsyncKVClient`, for engines without an event loop.

The async client runs on a private event loop in a daemon thread; every call keeps the async
client's contract (a miss within the deadline, never an exception for a daemon problem).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import weakref
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import torch

from kvstore.client.aio import AsyncKVClient, BlockCopy, Tokens, pin_arenas
from kvstore.engine_blocks import EngineBlockSpan
from kvstore.keys import Namespace
from kvstore.layout import KVLayout
from kvstore.planner import Plan
from kvstore.proto import kvstore_pb2 as pb

T = TypeVar("T")
log = logging.getLogger("kvstore.client")


class KVClient:
    """Synchronous kvstore client. Use as a context manager, or call `close()`."""

    def __init__(self, target: str, layout: KVLayout, **kwargs: Any) -> None:
        """The options are `AsyncKVClient`'s (docs/API.md)."""
        try:
            self._aio = AsyncKVClient(target, layout, **kwargs)
        except TypeError as e:  # a misspelt option: named as the caller wrote the call
            raise TypeError(str(e).replace("AsyncKVClient.__init__()", "KVClient()")) from None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvstore-client",
                                        daemon=True)
        self._thread.start()
        # Closed by `close`, or when collected, or at exit if still open: its loop thread
        # must not run while the interpreter finalizes (kvstore/arena.py `_stop_reaper`).
        self._finalizer = weakref.finalize(self, _shut_down, self._aio, self._loop,
                                           self._thread)

    @property
    def layout(self) -> KVLayout:
        return self._aio.layout

    @property
    def namespace(self) -> Namespace:
        return self._aio.namespace

    @property
    def streams(self) -> bool:
        """Whether transfers stream through gRPC (a daemon over TCP, or `transfer="stream"`)
        rather than through the daemon's shared memory."""
        return self._aio.transfer == "stream"

    @property
    def dropped_saves(self) -> int:
        """See `AsyncKVClient.dropped_saves`."""
        return self._aio.dropped_saves

    def _run(self, coro: Coroutine[Any, Any, T], miss: T, transfer_s: float = 0.0) -> T:
        if not self._finalizer.alive or self._loop.is_closed():
            coro.close()
            raise RuntimeError("KVClient is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            # The coroutine enforces its deadline itself; this bound only guards against a
            # wedged loop, well past that deadline (`transfer_s`: a transfer's).
            return future.result(timeout=2 * transfer_s + self._aio.deadline_s * 4 + 5)
        except TimeoutError:
            future.cancel()
            return miss

    def _transfer_s(self, tokens: Tokens, budget_s: float | None = None) -> float:
        blocks = len(self._aio.keys(tokens))
        return self._aio.transfer_timeout(blocks, budget_s if budget_s else None)

    def keys(self, tokens: Tokens) -> list[bytes]:
        return self._aio.keys(tokens)

    def held(self, tokens: Tokens) -> list[bool]:
        """`AsyncKVClient.held`, waited for."""
        n = len(self._aio.keys(tokens))
        return self._run(self._aio.held(tokens), [False] * n)

    def lookup(self, tokens: Tokens, *, prefetch: bool = False) -> int:
        return self._run(self._aio.lookup(tokens, prefetch=prefetch), 0)

    def fetch(self, tokens: Tokens, into: torch.Tensor | None = None, *,
              max_blocks: int | None = None, budget_s: float | None = None,
              ) -> tuple[int, torch.Tensor | None]:
        return self._run(self._aio.fetch(tokens, into, max_blocks=max_blocks,
                                         budget_s=budget_s), (0, None),
                         self._transfer_s(tokens, budget_s))

    def plan(self, tokens: Tokens, prefill_tokens_per_s: float,
             bytes_per_token: int | None = None, *,
             consume_bytes_per_s: float | None = None) -> Plan:
        """See `AsyncKVClient.plan`: how many cached prefix blocks are worth loading at this
        prefill speed; a plan of 0 blocks (recompute) when the daemon is down or slow."""
        none = self._aio._recompute_plan(tokens, prefill_tokens_per_s, bytes_per_token)
        return self._run(self._aio.plan(tokens, prefill_tokens_per_s, bytes_per_token,
                                        consume_bytes_per_s=consume_bytes_per_s), none)

    @property
    def copy_bandwidth(self) -> float | None:
        """See `AsyncKVClient.copy_bandwidth`."""
        return self._aio.copy_bandwidth

    def publish(self, tokens: Tokens, kv: torch.Tensor) -> int:
        return self._run(self._aio.publish(tokens, kv), 0, self._transfer_s(tokens))

    def fetch_with(self, tokens: Tokens, consume: BlockCopy, *, skip_blocks: int = 0,
                   max_blocks: int | None = None, budget_s: float | None = None,
                   whole: bool = False) -> int:
        """See `AsyncKVClient.fetch_with`: `consume(blocks, views, stop)` copies the cached
        prefix's blocks out of the daemon's memory; returns the end of the intact prefix (a
        fetch cut short by its deadline keeps what it copied). `whole`: in one round."""
        return self._run(self._aio.fetch_with(tokens, consume, skip_blocks=skip_blocks,
                                              max_blocks=max_blocks, budget_s=budget_s,
                                              whole=whole), 0,
                         self._transfer_s(tokens, budget_s))

    def publish_with(self, tokens: Tokens, produce: BlockCopy) -> int:
        """See `AsyncKVClient.publish_with`: `produce(blocks, views, stop)` writes the blocks
        the daemon lacks straight into its memory; returns the prompt tokens now cached."""
        return self._run(self._aio.publish_with(tokens, produce), 0, self._transfer_s(tokens))

    def end_session(self, tokens: Tokens, shared_tokens: int = 0) -> int:
        """See `AsyncKVClient.end_session`: the conversation whose last prompt was `tokens`
        has ended; its own blocks (past `shared_tokens`) are evicted first."""
        return self._run(self._aio.end_session(tokens, shared_tokens), 0)

    def stats(self) -> pb.StatsReply | None:
        return self._run(self._aio.stats(), None)

    def clear(self, *, all_namespaces: bool = False) -> int:
        return self._run(self._aio.clear(all_namespaces=all_namespaces), 0)

    def inspect(self) -> pb.InspectReply | None:
        return self._run(self._aio.inspect(), None)

    def describe_blocks(self, tokens: Tokens, spans: Sequence[EngineBlockSpan]) -> int:
        """`AsyncKVClient.describe_blocks`, waited for."""
        return self._run(self._aio.describe_blocks(tokens, spans), 0)

    def kv_events(self) -> str:
        """`AsyncKVClient.kv_events`: the daemon's KV events endpoint, "" when off."""
        return self._run(self._aio.kv_events(), "")

    def kv_events_known(self) -> str | None:
        """`AsyncKVClient.kv_events_known`: never a call."""
        return self._aio.kv_events_known()

    def describe_blocks_later(self, tokens: Tokens, spans: Sequence[EngineBlockSpan]) -> None:
        """`describe_blocks` in the background: the caller (an engine's scheduler) never
        waits for it; a failure is the client's usual logged miss."""
        asyncio.run_coroutine_threadsafe(self._aio.describe_blocks(tokens, spans), self._loop)

    def ping(self) -> bool:
        return self._run(self._aio.ping(), False)

    def prepare(self, pin: bool = False) -> bool:
        """See `AsyncKVClient.prepare`: map the daemon's arena now. With `pin` (an engine on a
        GPU), register it with CUDA, waiting for it here, and every arena this process maps
        later in the background (`kvstore.client.aio.pin_arenas`)."""
        if pin:
            pin_arenas()
        ready = self._run(self._aio.prepare(), False)
        arena = self._aio._arena
        if pin and arena is not None:
            arena.pin()  # waited for here (engine start), not inside the first load
        return ready

    def close(self) -> None:
        self._finalizer()  # once: a second call does nothing

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _shut_down(aio: AsyncKVClient, loop: asyncio.AbstractEventLoop,
               thread: threading.Thread) -> None:
    """Close a client's async half, stop its loop and its thread."""
    if loop.is_closed():
        return
    if threading.current_thread() is thread:  # collected on its own loop: cannot wait there
        loop.stop()
        return
    try:
        asyncio.run_coroutine_threadsafe(aio.close(), loop).result(timeout=5)
    except TimeoutError:  # a wedged loop: stop it anyway (at exit, too, within 5 s)
        log.warning("closing the kvstore client to %s timed out after 5 s", aio.target)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        if not thread.is_alive():
            loop.close()
        gc.collect()  # what the loop's last callbacks let go of: see `AsyncKVClient.close`
