"""The vLLM connector's part in the daemon's KV events (`kv_events`, `server.kv_events`).

A router built for vLLM indexes blocks by vLLM's block hashes at the engine's block size; a
kvstore block covers `block_tokens / block_size` of them and is keyed by kvstore's own chain.
When a request's prompt is about to be saved, the scheduler side describes each of its kvstore
blocks to the daemon by the hashes vLLM computed for the request (`request.block_hashes`, the
ones vLLM's own events carry), in the background: the scheduler never waits on it, and when
the daemon publishes no events (asked once a minute) nothing is built or sent.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.engine_blocks import spans_for
from kvstore.keys import PrefixKeys

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from kvstore.client import KVClient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EventGroup:
    """A hybrid model's KV-cache group as vLLM's events name it: `index` (`group_idx`), `kind`
    (`KVCacheSpecKind`'s value), its sliding window (None: full attention) and block size."""

    index: int
    kind: str
    sliding_window: int | None
    block_size: int


def describe_request(client: KVClient, request: Request, keys: PrefixKeys,
                     block_size: int, group: EventGroup | None = None) -> int:
    """Describe the kvstore blocks named by `keys` (the request's prompt's full blocks) by the
    vLLM block hashes they cover; returns the blocks described (0: events off, or vLLM has
    not hashed the prompt: prefix caching off). `block_size`: the tokens of one of
    `request.block_hashes`. `group`: a hybrid model's KV-cache group whose blocks `keys` are,
    described as vLLM's own events describe that group's: by the hashes at its own block size,
    with its index, kind and window."""
    if client.kv_events_known() == "" or not keys.keys:
        return 0  # events known to be off: nothing to build
    # getattr: a request object without them (another vLLM version, a test's stand-in) is
    # simply not described; events are never worth failing a schedule for.
    hashes = getattr(request, "block_hashes", None) or []
    tokens = getattr(request, "prompt_token_ids", None)
    if tokens is None or len(hashes) * block_size < keys.num_tokens:
        return 0
    lora = getattr(request, "lora_request", None)
    lora_name = lora.lora_name if lora is not None else None
    if group is None:
        spans = spans_for(tokens[: keys.num_tokens], hashes, block_size, keys.block_tokens,
                          lora_name)
    else:
        # vLLM's hash of a block of the group's (larger) size is the last hash at
        # `block_size` inside it (`BlockHashListWithBlockSize`): each is chained over its
        # whole prefix already.
        if group.block_size % block_size:
            return 0
        step = group.block_size // block_size
        spans = spans_for(tokens[: keys.num_tokens], hashes[step - 1 :: step], group.block_size,
                          keys.block_tokens, lora_name, group_idx=group.index,
                          spec_kind=group.kind, sliding_window=group.sliding_window)
    client.describe_blocks_later(keys, spans)
    return len(spans)
