"""`KVStoreConnector`: vLLM's v1 KV connector backed by a kvstore daemon.

Load it with

    KVTransferConfig(kv_connector="KVStoreConnector",
                     kv_connector_module_path="kvstore.client.integrations.vllm", kv_role="kv_both",
                     kv_connector_extra_config={"kvstore.target": "unix:///path/kv.sock"})

Extra config keys (all optional): `kvstore.target`, `kvstore.token`, `kvstore.block_tokens`
(a multiple of vLLM's block size; default: vLLM's block size), `kvstore.model` (the model id in
the layout; default: vLLM's model path), `kvstore.deadline_s`, `kvstore.transfer`,
`kvstore.tenant`, `kvstore.async_save`, `kvstore.save_queue`, `kvstore.consumer_wait_s`,
`kvstore.shared_model`, `kvstore.async_load`, `kvstore.layerwise_load`,
`kvstore.layerwise_min_tokens`, `kvstore.whole_loads`.

Blocks are keyed with kvstore's own chained keys over the prompt tokens, in the namespace of a
`KVLayout` derived from vLLM's KV-cache spec, with `request.cache_salt` as the salt: a block
published through the transformers integration (`kvstore.client.integrations.hf`) is found here
when the model and layout agree. The scheduler keeps each request's keys (`KeyChain`) from its
first lookup until `request_finished`: a request looked up again (waiting for blocks, resumed
after preemption) or extended (a streaming session's next turn) hashes only its new blocks,
and the workers get the keys with each load and save (`PrefixKeys`), not the tokens.

Scheduler side: `get_num_new_matched_tokens` looks the prompt up and claims the cached prefix
but the prompt's last token (vLLM computes at least one token: a prompt whose blocks are all
stored loads all but its last token, the last vLLM block partly), `update_state_after_alloc`
records what to load and
`build_connector_meta` hands the worker one `LoadSpec` per request with a hit and one `SaveSpec`
per request whose prefill completes this step. Worker side: `start_load_kv` starts the step's
loads, copying each block once, from the daemon's shared memory straight into vLLM's pages
(`KVClient.fetch_with`, under the fetch's lease): layer by layer in a thread beside the
forward, each attention layer waiting (`wait_for_layer_load`) only for its own layer, the
forward's thread copying unclaimed layers while it waits (`kvstore.layerwise_load`, the
default on CPU caches, for steps that load at least `kvstore.layerwise_min_tokens`; the result
is settled after the forward, in `wait_for_save`); otherwise whole, before the forward.
`wait_for_save` hands the prompt's full blocks to a background thread, which copies them from
vLLM's pages straight into blocks reserved in the daemon's memory (`KVClient.publish_with`) and
commits them: the step that returns the first token does not wait for the store. Until that
thread is done with a request, vLLM keeps its blocks (`request_finished` delays their free and
`get_finished` reports the end; a preempted request's pending saves are waited for in
`handle_preemptions`, before its blocks can be reused). A full save queue drops the save (a
future miss), never blocks the step. `kvstore.async_save=false` publishes synchronously in
`wait_for_save` instead. `kvstore.async_load=true` loads in a background thread instead (on the
CPUs vLLM's compute threads are not bound to), reported to vLLM as an asynchronous load: the
request waits, unscheduled, while the engine runs the others; a load that comes short is
recomputed whole.

A load's deadline follows its size and the measured bandwidth, and the time this engine takes
to recompute what it carries (learnt from its own full prefills): it is abandoned only when
finishing it can no longer beat recomputing. A load cut short, or a failed or short fetch,
keeps the prefix that arrived intact; only the blocks after it are reported through
`get_block_ids_with_load_errors`, and vLLM recomputes those: never garbage, never more than
what is missing. A daemon that is down is a lookup miss within the client's deadline, so vLLM
computes as if there were no connector. Background saves copy on the CPUs vLLM's compute
threads are not bound to (`VLLM_CPU_NUM_OF_RESERVED_CPU`), so they do not take turns with
the decode steps that run meanwhile. A save that does not happen (queue full, daemon down,
slow or full) is counted and logged: the first at once, then a summary at most once a
minute.

Disaggregated prefill (`kv_role`; docs/ENGINES.md): `kv_both` loads and saves as above. A
`kv_producer` (prefill instance) loads too (a prefix cached already is not recomputed) and
saves synchronously, in the step that completes the prompt's blocks: the proxy gets the
producer's answer only once those blocks are committed, and its `request_finished` returns
`{"kvstore_prefilled_tokens": N, "kvstore_prefill_tokens_per_s": R}` as the request's
`kv_transfer_params`. A `kv_consumer`
(decode instance) loads and saves nothing (the producer stored the prompt; generated tokens
are never stored). A consumer request carrying those params that a lookup finds short (the
producer's daemon still writing through to the remote tier) stays waiting, unscheduled, and is
looked up again every 20 ms, no longer than recomputing the missing tokens at the producer's
rate would take (`kvstore_prefill_tokens_per_s`, which the producer returns too) and at most
`kvstore.consumer_wait_s`; then vLLM computes what is missing: a slow or dead producer
costs time, never a wrong answer. Those lookups ask the daemon to prefetch what has arrived
into host meanwhile, and an engine step that computes nothing
while they wait sleeps until the next lookup is due rather than spin. A producer with
`kvstore.peer_target` (its daemon's TCP address) returns it too (`kvstore_peer`); a consumer
that lists it in `kvstore.peers` and finds fewer tokens on its own daemon looks the prompt up
there and, when that finds more, loads it from the producer's daemon at once.

A conversation's last turn can say so: `{"kvstore_end_session": true}` in its
`kv_transfer_params` (`extra_body` of an OpenAI request, `SamplingParams.extra_args` offline),
with `"kvstore_shared_tokens": N` when its first N tokens are shared with other conversations
(a system prompt, a document). Once that request's blocks are saved, the scheduler sends the
daemon `EndSession` for its prompt (`KVClient.end_session`): the conversation's own blocks are
then evicted first (docs/SCALE.md measures what that buys).

MLA models (DeepSeek-V2/V3-shaped) store their latent cache, one plane per layer
(`kv_kind="mla"`: one "head" of kv_lora_rank + rope dims, 576 for DeepSeek), copied by the
kernels in the layout read from vLLM's source for the running version and backend
(`kernels.vllm_engine_kv`; on the CPU, by their torch twin). vLLM's CPU build turns its own
prefix cache off for MLA, so there the connector is the only prefix cache. On the CPU, vLLM's
`rotary_embedding` op mis-rotates MLA's strided q_pe/k_pe (models with plain RoPE; DeepSeek's
YaRN runs in torch), which makes such a model's output depend on batching: the connector warns
at start (`cpu_mla_rope_is_batch_dependent`, docs/ENGINES.md).

Hybrid models (several KV-cache groups: sliding-window and full-attention layers, Gemma-2/3,
gpt-oss): the connector implements `SupportsHMA`, so vLLM keeps its hybrid KV-cache manager on
(it turns it off for a connector without it), and each group's blocks are stored under a
layout of their own (`groups_for_vllm`). Every group stores every full block of the prompt
(each sliding-window block is the window of some resumable prefix length); a lookup's hit is
the shortest of the groups' cached prefixes (a block missing in any group is a miss from
there); a load fetches every full-attention block and, for a sliding-window group, only the
blocks vLLM allocates at the resumed length (the window's: those behind it are vLLM's null
block). Loads are asynchronous (`get_num_new_matched_tokens` returns True): a group that comes
short fails the request's load (`failed_recving`) and vLLM recomputes it, as vLLM takes no
per-block load error with several groups. Saves are synchronous, in every step that completes
prompt blocks: vLLM frees a sliding-window group's blocks behind the window while the request
runs, so a background copy could read reused pages. Groups whose pages differ in bytes per
token (Gemma 4: full-attention heads of 512 beside sliding ones of 256) get different block
sizes from vLLM, which makes their pages equal: a kvstore block then spans whole blocks of every
group (the least common multiple of their sizes). docs/ENGINES.md, "Hybrid models".

Tensor parallel (docs/ENGINES.md, "Tensor parallel"): each worker loads and saves its own
rank's shard of the heads, under layouts naming the degree and rank (`MODEL#tp=2:rank=1`; at
TP=1 the layouts are those of before). The scheduler keys each prompt for every rank and
counts a block cached only when every rank's shard (of every group) is: the minimum of their
lookups. The workers agree on each load (an all-reduce of the tokens each rank loaded), so a
load short on one rank is reported as the same failed blocks by all, and no rank publishes
what that step computed; vLLM recomputes from the first failed block on every rank. An MLA
latent, the same on every rank, is stored once (`MODEL#tp=2`): rank 0 saves it, all load it.

Pipeline parallel (docs/ENGINES.md, "Pipeline parallel"): each stage's workers load and save
their layers' shard, under layouts naming the layers (`MODEL#pp=2:layers=2-3`); the scheduler,
given stage 0's cache config, derives every stage's layers with vLLM's `get_pp_indices`. The
stages agree on each load down the pipeline (stage s takes the minimum of its figure and stage
s-1's, and sends it on), so no stage publishes K/V computed over an earlier stage's failed load.

Sharing across parallel degrees (`kvstore.shared_model`, docs/ENGINES.md): every block is
stored one KV head at a time under layouts naming the shared id and the head
(`SHARED#kv-head=1:of=8`), not the degree, so engines of any tensor-parallel size read each
other's blocks; each rank moves the heads its cache holds through head slices of vLLM's pages
(`KVShard`, `PagedCache.head_slice`). Off by default: two degrees' K/V differ in the last bits.

Limits: full attention, MLA, and sliding window beside them (no Mamba, linear-attention or
other state groups, chunked local attention, static sink attention, padded pages, hybrid MLA,
DeepSeek-V3.2/V4 sparse or compressed MLA caches, quantized caches other than per-tensor
fp8), hybrid models at pipeline parallel size 1 only, text prompts (requests with multimodal
inputs or prompt embeddings bypass the store); a block stored as several shards (TP > 1,
PP > 1, `kvstore.shared_model`) is described in KV events by its first, a hybrid model's
blocks by group (`group_idx`).
"""

from __future__ import annotations

import functools
import logging
import math
import queue
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvstore.client.aio import warm_stream_buffers
from kvstore.client.backoff import LogThrottle
from kvstore.client.cli import DEFAULT_TARGET
from kvstore.client.integrations.layerwise import LayerwiseLoad
from kvstore.client.integrations.paged import (
    VLLM_CPU_ISAS,
    PagedCache,
    View,
    load_cpus,
    native_copy,
    run_on,
    side_cpus,
    token_pages,
)
from kvstore.client.integrations.settings import read_extra
from kvstore.client.integrations.vllm_events import EventGroup, describe_request
from kvstore.client.sync import KVClient
from kvstore.kernels.errors import KernelArgumentError
from kvstore.kernels.layouts import EngineKV, EngineLayout, vllm_engine_kv
from kvstore.keys import KeyChain, PrefixKeys
from kvstore.layout import KVLayout
from kvstore.planner import PrefillModel

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvstore.vllm")
_MAX_CLIENTS = 16  # one client per (salt, LoRA) namespace; salts are few in practice
_COPY_PIECE_BYTES = 64 << 20  # a load checks its deadline between copies of about this size
_LAYER_PIECE_BYTES = 8 << 20  # a layer-by-layer load's pieces: one layer of several blocks
_SHUTDOWN_SAVE_S = 10.0  # at shutdown, pending saves get this long to finish
_DROP_LOG_S = 60.0  # saves dropped for a full queue after the first: a summary this often
PREFILLED_TOKENS = "kvstore_prefilled_tokens"
"""The `kv_transfer_params` key a producer returns and a consumer reads (disaggregated
prefill): the tokens of the prompt's full blocks the producer published."""
PREFILL_RATE = "kvstore_prefill_tokens_per_s"
"""The `kv_transfer_params` key a producer returns beside `PREFILLED_TOKENS`: the tokens it
computed for the prompt per second of its prefill (from its first scheduling to its answer).
A consumer waits for the producer's blocks no longer than computing the missing tokens at
that rate would take."""
PEER = "kvstore_peer"
"""The `kv_transfer_params` key a producer with `kvstore.peer_target` returns: its daemon's
address, which a consumer listing it in `kvstore.peers` loads the prompt from."""
END_SESSION = "kvstore_end_session"
"""The `kv_transfer_params` key (true) of a conversation's last turn: its blocks go first."""
SHARED_TOKENS = "kvstore_shared_tokens"
"""With `END_SESSION`: the prompt's first tokens other conversations share (never marked)."""
_WAIT_LOOKUP_S = 0.02  # a consumer waiting for a producer's blocks looks up this often
_WAIT_NO_RATE_S = 2.0  # unset `consumer_wait_s`: the wait when the producer sent no rate
_WAIT_MAX_S = 60.0  # unset `consumer_wait_s`: the most a producer's rate may justify
_NULL_BLOCK = 0  # vLLM's null block (BlockPool's first, never handed out): a dropped block
_PP_LOAD_TAG = 0x6B76  # tags the stages' load agreement apart from vLLM's own sends


class ConnectorConfigError(ValueError):
    """The connector's configuration cannot work with this engine (raised at start)."""


@dataclass(frozen=True)
class ConnectorConfig:
    """The connector's settings, from `kv_connector_extra_config` (`kvstore.*` keys)."""

    target: str = DEFAULT_TARGET
    """The daemon: `unix:///abs/path/kv.sock` or `host:port` (TCP needs `token`)."""
    token: str | None = None
    """Bearer token for a TCP daemon."""
    block_tokens: int | None = None
    """Tokens per kvstore block: a multiple of vLLM's block size (default: equal to it)."""
    model: str | None = None
    """Model id in the layout (default: vLLM's model path); set it to share blocks with
    engines that name the model differently."""
    deadline_s: float = 1.0
    """Deadline of a control call (lookup, lease, release): a daemon slower than this is a
    miss. A load or save also gets its bytes' time at the daemon's measured bandwidth, and a
    load goes on as long as finishing it beats recomputing (`AsyncKVClient.fetch_with`)."""
    transfer: str = "auto"
    """`auto`, `shm` or `stream` (see `AsyncKVClient`)."""
    tenant: str = ""
    """Tenant in the namespace: blocks of different tenants never mix."""
    async_save: bool = True
    """Publish in a background thread (the first token does not wait for the store); false:
    synchronously, in the step that completes the prompt's blocks."""
    save_queue: int = 64
    """Saves waiting for the background thread at most; a save past it is dropped."""
    consumer_wait_s: float | None = None
    """`kv_role="kv_consumer"`: how long at most a request whose `kv_transfer_params` say a
    producer published its prompt (`kvstore_prefilled_tokens`) waits, unscheduled, for
    blocks a lookup does not find yet (a write-through to the remote tier still on its way);
    then it loads what is there and vLLM computes the rest. Whatever this is, a request whose
    producer sent its prefill rate (`kvstore_prefill_tokens_per_s`, kvstore producers do)
    waits no longer than computing the tokens missing at its first lookup would take at that
    rate: a wait that outlasts the recompute it would save is given up. Unset: that bound, up
    to 60 s (a long prompt on a slow engine is worth a long wait), and 2 s for requests
    without a rate."""
    async_load: bool = False
    """Load in a background thread while the engine runs other requests: vLLM schedules a
    request once its load is done (`WAITING_FOR_REMOTE_KVS`), and a load that comes short is
    recomputed whole. False: loads run in the step that schedules the request, before its
    forward (a load cut short keeps the prefix that arrived). Hybrid models always report
    their loads asynchronously (synchronously carried out unless this is set)."""
    layerwise_load: bool = True
    """Synchronous loads copy layer by layer beside the forward: each attention layer waits
    (`wait_for_layer_load`) only for its own layer's K/V, and the forward's thread copies
    while it waits. False: the whole load is copied before the forward starts. CPU caches
    only (the kernels' engine caches copy every layer at once)."""
    layerwise_min_tokens: int = 0
    """With `layerwise_load`, a step whose loads come to fewer tokens than this copies them
    whole before the forward instead, on every CPU. 0 (the default): every load layer by
    layer. On this repository's 2-core machine, whole was not faster at 2,048 tokens and was
    slower from 4,096 on (docs/PERFORMANCE.md, "Layer-by-layer loads"); a machine whose
    forward is short against its copies may set it."""
    whole_loads: bool = True
    """With `layerwise_load`, ask the daemon for each load's whole prefix in one round
    (`fetch_with(..., whole=True)`) instead of in windows of its `fetch_window_bytes`. A layer
    is ready for the forward only once one call brought every block, so a disk load in
    windows makes the forward wait for all of it: 8k / 16k-token disk loads gave TTFT 0.176 /
    0.343 s with this against 0.236 / 0.475 s without (docs/PERFORMANCE.md, "Disk loads in one
    round"). A slow disk still answers in time: the daemon starts no read after half the
    call's deadline and answers with the prefix it read, the rest asked for in further rounds
    (a stalled load keeps the prefix that arrived, as in windows). False: windows."""
    peer_target: str = ""
    """`kv_role="kv_producer"`: where consumers reach this engine's daemon (`host:port` of its
    `--listen`), sent with each prefilled request (`kvstore_peer` in its `kv_transfer_params`):
    a consumer that lists it in `peers` loads the prompt from that daemon at once, rather than
    wait for the remote tier's write-through. Empty: not sent."""
    peers: str = ""
    """`kv_role="kv_consumer"`: the producers' daemons (their `peer_target`s, comma-separated)
    this engine may load a producer's blocks from directly. A `kvstore_peer` not listed here
    is ignored: `kv_transfer_params` come with the request, and an address nobody vetted
    could serve forged K/V that vLLM's prefix cache would then hand to other requests."""
    peer_token: str | None = None
    """Bearer token for the peers' TCP listeners (default: `token`)."""
    shared_model: str | None = None
    """Share blocks across tensor-parallel degrees: store each block one KV head at a time
    (an MLA latent once) under this model id instead of the degree's own layouts, so that an
    engine of this model at any tensor-parallel size reads what one at another size stored.
    Configurations compute K/V that differ in the last bits, so this is the operator's
    choice, never the default (docs/ENGINES.md, "Sharing across parallel degrees")."""

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorConfig:
        cfg = cls(**read_extra(cls, extra, "connector", ConnectorConfigError))
        # Checked here, at engine start, rather than at the first request's lookup.
        if cfg.deadline_s <= 0:
            raise ConnectorConfigError(f"kvstore.deadline_s must be positive, got "
                                       f"{cfg.deadline_s}")
        if cfg.transfer not in ("auto", "shm", "stream"):
            raise ConnectorConfigError(f"kvstore.transfer must be auto, shm or stream, got "
                                       f"{cfg.transfer!r}")
        if cfg.save_queue < 1:
            raise ConnectorConfigError(f"kvstore.save_queue must be positive, got "
                                       f"{cfg.save_queue}")
        if cfg.shared_model is not None and not cfg.shared_model.strip():
            raise ConnectorConfigError("kvstore.shared_model must name the model, got an empty "
                                       "string (leave it out to keep parallel degrees apart)")
        if cfg.layerwise_min_tokens < 0:
            raise ConnectorConfigError(f"kvstore.layerwise_min_tokens must not be negative, "
                                       f"got {cfg.layerwise_min_tokens}")
        if cfg.consumer_wait_s is not None and not 0 <= cfg.consumer_wait_s < math.inf:
            raise ConnectorConfigError(f"kvstore.consumer_wait_s must be a non-negative number "
                                       f"of seconds, got {cfg.consumer_wait_s}")
        if cfg.peers and not all(p.strip() for p in cfg.peers.split(",")):
            raise ConnectorConfigError(f"kvstore.peers must list daemon addresses separated by "
                                       f"commas, got {cfg.peers!r}")
        return cfg

    def peer_set(self) -> frozenset[str]:
        """The daemons `peers` lists."""
        return frozenset(p.strip() for p in self.peers.split(",") if p.strip())


def layout_for_vllm(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None,
                    cfg: ConnectorConfig) -> KVLayout:
    """The `KVLayout` of this engine's KV cache (one KV-cache group), or
    `ConnectorConfigError` naming what is unsupported. Both roles derive it the same way, so
    their keys agree. Hybrid models (several groups): `groups_for_vllm`."""
    groups = groups_for_vllm(vllm_config, kv_cache_config, cfg)
    if len(groups) != 1:
        raise ConnectorConfigError("this model has several KV-cache groups: see "
                                   "groups_for_vllm")
    return groups[0].layout


@dataclass(frozen=True)
class KVShard:
    """What one KV-cache group's blocks are stored as: one slice of the model's KV heads (all
    of them at TP=1; a rank's at TP > 1; one head with `kvstore.shared_model`), under its own
    layout (so its own keys). A block is cached only when every shard of it is."""

    index: int
    layout: KVLayout
    ranks: tuple[int, ...]
    """The tensor-parallel ranks whose caches hold these heads: each loads them, the first
    saves them (an MLA latent and replicated KV heads are the same on several ranks)."""
    first_head: int = 0
    """The first of its heads among the model's KV heads."""
    stage: int = 0
    """The pipeline-parallel stage whose layers these are (0 at PP=1): its workers hold it."""


@dataclass(frozen=True)
class KVGroup:
    """One vLLM KV-cache group as the connector stores it: its layers, the sliding window of
    its layers (None: full attention), the layout of one rank's cache of them, and the
    shards its blocks are stored as."""

    index: int
    layout: KVLayout
    """This rank's cache of the group (its share of the heads); also the layout its blocks
    are stored under unless `shards` slice them otherwise."""
    layer_names: tuple[str, ...]
    sliding_window: int | None = None
    rank: int = 0
    """The tensor-parallel rank whose shard of the heads `layout` holds (0 at TP=1)."""
    first_head: int = 0
    """The first of this rank's heads among the model's KV heads."""
    shards: tuple[KVShard, ...] = ()
    """Every worker's shards of the group's blocks, all stages' (one, `layout`'s, when
    empty)."""
    stage: int = 0
    """The pipeline-parallel stage whose layers `layout` holds (0 at PP=1)."""
    block_size: int = 16
    """vLLM's block size for this group: the tokens of one of its block ids (groups may
    differ; the layout's `block_tokens` is a multiple of every group's)."""

    def shards_of(self, rank: int, stage: int = 0) -> list[KVShard]:
        """The shards the worker of tensor-parallel `rank` in pipeline `stage` holds (loads)."""
        return [s for s in self.all_shards if s.stage == stage and rank in s.ranks]

    @property
    def all_shards(self) -> tuple[KVShard, ...]:
        return self.shards or (KVShard(0, self.layout, (self.rank,), self.first_head,
                                       self.stage),)


def _layer_index(name: str) -> int:
    found = re.findall(r"\.(\d+)\.", f".{name}.")
    return int(found[0]) if found else -1


def groups_for_vllm(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None,
                    cfg: ConnectorConfig, rank: int = 0, stage: int = 0) -> list[KVGroup]:
    """The groups of this engine's KV cache, each with the layout its blocks are stored
    under, or `ConnectorConfigError` naming what is unsupported.

    One group (full attention or MLA): the layout is the model's, as before hybrid support, so
    blocks stay shared with the transformers integration. Several groups (vLLM's hybrid
    KV-cache manager: sliding-window and full-attention layers, Gemma-2/3, gpt-oss): each
    group's layout names the model plus its layers and window in `model`
    (`MODEL#kv-group:layers=0,2:sliding_window=64`), so two groups of equal shape never share
    keys, and a group's blocks are found (or missing) on their own.

    Tensor parallel > 1: the layouts of tensor-parallel rank `rank`, whose cache holds its
    shard of the KV heads (vLLM's spec counts the heads per rank): `model` names the parallel
    degree and the rank (`MODEL#tp=2:rank=1`, after the group's tag), so shards of different
    ranks, and blocks of other parallel degrees, never share keys; at TP=1 the layouts are
    exactly those of before. An MLA latent is the same on every rank: stored once
    (`MODEL#tp=2`), by rank 0, loaded by all.

    Pipeline parallel > 1: pipeline `stage`'s layers (vLLM's `get_pp_indices`; the scheduler
    is given stage 0's cache config, and derives the other stages' layers the same way), each
    stage's blocks a shard of their own, its layers named in `model` (`MODEL#pp=2:layers=2-3`,
    before the TP rank's tag), so a block is cached only when every stage's layers of it are.

    `kvstore.shared_model`: every group's blocks are stored as one shard per KV head of the
    model (`SHARED#kv-head=3:of=8`; an MLA latent as one shard, `SHARED`), whatever the
    tensor-parallel degree, so engines of any tensor-parallel size share them; each rank moves
    the heads its cache holds (`KVGroup.shards`). At PP > 1 the shards name their layers
    (`SHARED#layers=0-1#kv-head=3:of=8`): shared with engines whose stages split the layers
    the same way."""
    parallel = vllm_config.parallel_config
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    if not 0 <= rank < tp:
        raise ConnectorConfigError(f"tensor-parallel rank {rank} outside [0, {tp})")
    if not 0 <= stage < pp:
        raise ConnectorConfigError(f"pipeline-parallel stage {stage} outside [0, {pp})")
    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        raise ConnectorConfigError("the kvstore connector needs a KV cache (attention-free "
                                   "models have none)")
    fp8 = _fp8_cache_dtype(vllm_config)
    # vLLM gives groups whose pages differ in bytes block sizes that make them equal (Gemma
    # 4: full-attention layers of head dim 512 beside sliding ones of 256). A kvstore block
    # spans whole blocks of every group: the least common multiple of their sizes.
    sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups]
    block_tokens = cfg.block_tokens or math.lcm(*sizes)
    if any(block_tokens % size for size in sizes):
        raise ConnectorConfigError(f"kvstore.block_tokens={block_tokens} must be a multiple of "
                                   f"vLLM's block size of every KV-cache group {sizes}")
    model_config = vllm_config.model_config
    model = cfg.model or model_config.model
    hybrid = len(kv_cache_config.kv_cache_groups) > 1
    if hybrid and pp > 1:
        raise ConnectorConfigError(f"the kvstore connector supports pipeline parallel size "
                                   f"{pp} for models of one KV-cache group only, not hybrid "
                                   f"models (docs/ENGINES.md, \"Pipeline parallel\")")
    stages = _stage_layers(vllm_config, pp)
    out: list[KVGroup] = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if getattr(spec, "page_size_padded", None) is not None:
            # vLLM pads a page it cannot size by block size alone: rows then sit at a
            # stride the paged-cache views do not model.
            raise ConnectorConfigError(f"KV-cache group {index}'s pages are padded to "
                                       f"{spec.page_size_padded} bytes (vLLM could not make "
                                       f"every group's page the same size by block size): "
                                       f"not supported")
        mla = type(spec) is MLAAttentionSpec
        window: int | None = None
        if mla:
            # One latent row per token (kv_c_normed, then k_pe), the same on every TP rank.
            # DeepSeek-V4's sparse caches pad, compress and index theirs: not this layout.
            if (hybrid or spec.alignment is not None or spec.model_version is not None
                    or getattr(spec, "tokens_per_state", 1) != 1
                    or spec.sliding_window is not None or spec.attention_chunk_size is not None):
                raise ConnectorConfigError("the kvstore connector stores one MLA latent row per "
                                           "token only, not DeepSeek-V4's sparse or compressed "
                                           "MLA caches nor hybrid MLA models")
        elif hybrid and type(spec) is SlidingWindowSpec and spec.head_size_v == spec.head_size \
                and spec.extra_retained_tokens == 0:
            window = spec.sliding_window
        elif (type(spec) is not FullAttentionSpec or spec.sliding_window is not None
                or spec.attention_chunk_size is not None or spec.head_size_v != spec.head_size):
            # Mamba / linear-attention state (MambaSpec), chunked local attention, attention
            # sinks, encoder caches: not token-addressed K/V the store can key by prefix.
            raise ConnectorConfigError(f"the kvstore connector supports full attention, MLA "
                                       f"and (with vLLM's hybrid KV-cache manager) sliding "
                                       f"window attention only, got {type(spec).__name__} in "
                                       f"KV-cache group {index}")
        if mla and fp8 is not None:
            raise ConnectorConfigError("fp8 KV caches are supported for full and sliding-window "
                                       "attention, not MLA (not tested): use kv_cache_dtype "
                                       "'auto' for an MLA model")
        if mla:
            _warn_cpu_mla_rope(vllm_config)
        else:  # vLLM's CPU MLA cache is plain rows: no ISA packing
            _check_cpu_isa(vllm_config, spec)
        names = tuple(sorted(group.layer_names, key=_layer_index))
        tag = ""
        if hybrid:
            kind = f"sliding_window={window}" if window is not None else "full"
            tag = f"#kv-group:layers={','.join(str(_layer_index(n)) for n in names)}:{kind}"
        # At PP > 1, the scheduler's cache config is stage 0's; a worker's, its own stage's.
        if pp > 1 and [_layer_index(n) for n in names] != list(range(*stages[stage])):
            raise ConnectorConfigError(f"pipeline stage {stage}'s KV caches are layers "
                                       f"{[_layer_index(n) for n in names]}, not "
                                       f"{stages[stage]} as vLLM's get_pp_indices splits the "
                                       f"model's layers")
        local = 1 if mla else spec.num_kv_heads
        layout = functools.partial(
            KVLayout, model_revision=model_config.revision or "", num_kv_heads=local,
            head_dim=spec.head_size, dtype=getattr(torch, fp8) if fp8 else spec.dtype,
            block_tokens=block_tokens,
            kv_kind="mla" if mla else "kv")
        every = tuple(range(tp))
        total = local * tp  # the model's KV heads: asked of vLLM only where they matter
        firsts = [r * local for r in every]
        if cfg.shared_model is not None and not mla:
            total = model_config.get_total_num_kv_heads()
            firsts = [_first_head(total, local, tp, r) for r in every]
        mine: list[KVLayout] = []  # each stage's layout of this rank's cache
        shards: list[KVShard] = []
        for s, (start, end) in enumerate(stages):  # each stage's shards, numbered in order
            n = end - start if pp > 1 else len(names)
            degree = f"#pp={pp}:layers={start}-{end - 1}" if pp > 1 else ""
            mine.append(layout(f"{model}{tag}{degree}" + (f"#tp={tp}" if tp > 1 else "")
                               + (f":rank={rank}" if tp > 1 and not mla else ""), num_layers=n))
            if cfg.shared_model is not None:
                base = f"{cfg.shared_model}{tag}" + (f"#layers={start}-{end - 1}" if pp > 1
                                                     else "")
                if mla:
                    shards.append(KVShard(len(shards), layout(base, num_layers=n), every, 0, s))
                    continue
                shards += [KVShard(len(shards) + h,
                                   layout(f"{base}#kv-head={h}:of={total}", num_layers=n,
                                          num_kv_heads=1),
                                   tuple(r for r in every if firsts[r] <= h < firsts[r] + local),
                                   h, s) for h in range(total)]
            elif mla and tp > 1:
                shards.append(KVShard(len(shards), mine[s], every, 0, s))
            elif tp > 1:
                shards += [KVShard(len(shards) + r,
                                   layout(f"{model}{tag}{degree}#tp={tp}:rank={r}",
                                          num_layers=n), (r,), r * local, s) for r in every]
            elif pp > 1:
                shards.append(KVShard(len(shards), mine[s], (0,), 0, s))
        first = 0 if mla else firsts[rank]
        out.append(KVGroup(index, mine[stage], names, window, rank, first, tuple(shards), stage,
                           spec.block_size))
    return out


FP8_CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
                    "fp8_e5m2": "float8_e5m2"}
"""vLLM's per-tensor fp8 KV caches (`--kv-cache-dtype`), stored as the bytes vLLM wrote. Their
pages are uint8 in vLLM; a kvstore block names the fp8 format, so an fp8 engine's blocks are
misses for an engine of another cache dtype, and e4m3 and e5m2 never mix."""


def _fp8_cache_dtype(vllm_config: VllmConfig) -> str | None:
    """The fp8 format of vLLM's KV cache (a `FP8_CACHE_DTYPES` value), None for "auto" (the
    model's dtype); any other quantized cache is refused with the reason."""
    cache = vllm_config.cache_config
    if cache.cache_dtype == "auto":
        return None
    if cache.cache_dtype not in FP8_CACHE_DTYPES:
        raise ConnectorConfigError(
            f"KV cache dtype {cache.cache_dtype!r} is not supported: its per-token scales or "
            f"packing are not part of a kvstore block; use kv_cache_dtype 'auto' or a "
            f"per-tensor fp8 cache ({', '.join(FP8_CACHE_DTYPES)})")
    if getattr(cache, "kv_cache_dtype_skip_layers", None):
        raise ConnectorConfigError(
            f"kv_cache_dtype_skip_layers {cache.kv_cache_dtype_skip_layers} is not supported: "
            f"layers of two cache dtypes in one model (vLLM pads their pages to one size)")
    # The scales K and V are quantized with are the checkpoint's (1.0 where it has none):
    # like the weights, they are named by the model (`kvstore.model`, its revision).
    return FP8_CACHE_DTYPES[cache.cache_dtype]


def _event_group(group: KVGroup) -> EventGroup:
    """How vLLM's own KV events name a hybrid model's group (its index, kind and window)."""
    kind = "sliding_window" if group.sliding_window is not None else "full_attention"
    return EventGroup(group.index, kind, group.sliding_window, group.block_size)


def _stage_layers(vllm_config: VllmConfig, pp: int) -> list[tuple[int, int]]:
    """`[start, end)` of each pipeline stage's layers, as vLLM splits them."""
    if pp == 1:
        return [(0, 0)]
    from vllm.distributed.utils import get_pp_indices

    total = vllm_config.model_config.get_total_num_hidden_layers()
    return [get_pp_indices(total, s, pp) for s in range(pp)]


def _first_head(total: int, local: int, tp: int, rank: int) -> int:
    """The first of the model's `total` KV heads in `rank`'s cache, as vLLM's
    `QKVParallelLinear` splits them: `local` heads per rank, ranks in order; a tensor-parallel
    size above the head count replicates each head on consecutive ranks."""
    replicas = max(1, tp // total)
    if local * tp != total * replicas:
        raise ConnectorConfigError(f"{local} KV heads per rank at tensor parallel size {tp} do "
                                   f"not split the model's {total}")
    return rank // replicas * local


def cpu_mla_rope_is_batch_dependent(vllm_config: VllmConfig) -> bool:
    """Whether this MLA model's RoPE runs through vLLM's C++ `rotary_embedding` op on the
    CPU: plain RoPE (`rope_type` "default"; DeepSeek's YaRN runs in torch) with that custom op
    on. Up to vLLM 0.32 at least, that op takes its query and key as `[tokens, heads *
    head_size]` rows, `stride(-2)` apart; MLA hands it the strided views q_pe `[tokens, heads,
    64]` and k_pe `[tokens, 1, 64]`, so it rotates the wrong elements and most tokens' q_pe and
    k_pe not at all. What such a model computes then depends on where a token sits in its
    step's batch: a prefix loaded from kvstore (or a request batched with others) changes the
    output, which a prefix recomputed in one step would not."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    rope = getattr(vllm_config.model_config.hf_text_config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        return False
    ops = list(vllm_config.compilation_config.custom_ops or [])
    return "-rotary_embedding" not in ops and ("+rotary_embedding" in ops or "none" not in ops)


def _warn_cpu_mla_rope(vllm_config: VllmConfig) -> None:
    if cpu_mla_rope_is_batch_dependent(vllm_config):
        log.warning("kvstore: vLLM's CPU rotary_embedding op mis-rotates MLA's strided q_pe/k_pe, "
                    "so this model's output depends on batching and a prefix loaded from "
                    "kvstore will not reproduce a recompute; run vLLM with "
                    "compilation_config={'custom_ops': ['-rotary_embedding']} (torch RoPE)")


def _check_cpu_isa(vllm_config: VllmConfig, spec: Any) -> None:
    """Refuse at start, in the scheduler too, a CPU attention ISA whose cache layout
    `PagedCache.vllm_cpu` does not decode (the worker checks the layers' own ISA again)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    try:  # private in vLLM: where it moves, the worker's check still holds
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return
    # vLLM's CPU attention picks its ISA by the model's dtype (an fp8 cache's spec says uint8).
    isa = _get_attn_isa(vllm_config.model_config.dtype, spec.block_size, spec.head_size,
                        vllm_config.cache_config.cache_dtype)
    if isa not in VLLM_CPU_ISAS:
        raise ConnectorConfigError(f"vLLM's CPU attention would use ISA {isa!r}, whose packed "
                                   f"cache layout the kvstore connector does not decode "
                                   f"(supported: {sorted(VLLM_CPU_ISAS)})")
    if isa == "amx" and vllm_config.cache_config.cache_dtype != "auto":
        # Its tiles pair 16-bit values; how it packs bytes was not seen on a CPU with AMX.
        raise ConnectorConfigError(
            f"vLLM's CPU attention would keep this {vllm_config.cache_config.cache_dtype} cache "
            f"in AMX tiles, which the kvstore connector does not decode for 1-byte elements: "
            f"run the model in float32 (vLLM then picks the 'vec' ISA) or with "
            f"kv_cache_dtype 'auto'")


# ---- what the scheduler tells the workers (pickled across processes: plain fields only)
@dataclass
class LoadSpec:
    """Load tokens `[start, end)` into `block_ids` (the request's vLLM blocks from its first
    token). `keys`: those of the prompt's blocks up to the one holding token `end - 1` (the
    blocks to fetch); `end` need not end a block."""

    req_id: str
    keys: PrefixKeys
    salt: str
    lora: str
    block_ids: list[int]
    start: int
    end: int
    group: int = 0
    """The KV-cache group (hybrid models: one spec per group; `block_ids` are its own)."""
    shard: int = 0
    """The group's shard (`KVShard.index`; one spec per shard, `keys` its own): the ranks
    holding it load it."""
    peer: str | None = None
    """Load from this daemon, a producer's (`kvstore_peer`), not the engine's own."""


@dataclass
class SaveSpec:
    """Publish the prompt's full kvstore blocks, named by `keys`, which sit in `block_ids`."""

    req_id: str
    keys: PrefixKeys
    salt: str
    lora: str
    block_ids: list[int]
    group: int = 0
    shard: int = 0
    """The group's shard (`KVShard.index`; one spec per shard, `keys` its own): the first
    rank holding it saves it."""


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    """Requests preempted this step: their pages may be reused by this step's forward."""
    prefill: tuple[int, int] | None = None
    """`(start, end)` when this step computes only prompt tokens `[start, end)` of one
    request, with nothing to load: the worker times such steps to learn what recomputing
    costs (a chunked prefill gives one per chunk)."""


@dataclass
class _Wait:
    """A consumer request waiting for its producer's blocks (`_must_wait`)."""

    began: float  # its first lookup (time.monotonic())
    last: float  # its latest lookup
    budget: float  # seconds from `began` it waits at most
    why: str  # what set `budget`, for the log


@dataclass
class _Request:
    """Scheduler-side state of one request the connector follows."""

    shard_keys: list[list[PrefixKeys]]  # of the prompt's full blocks, [KV-cache group][shard]
    num_tokens: int  # in the prompt
    salt: str
    lora: str
    save_end: int  # tokens in the prompt's full kvstore blocks
    hit_end: int  # tokens kvstore held at lookup
    block_ids: list[list[int]] = field(default_factory=list)  # per KV-cache group
    load: tuple[int, int] | None = None  # [start, end) to load in the next step
    save_issued: bool = False  # a SaveSpec went to the worker: it reports when it is done
    saved_to: int = 0  # hybrid: the prompt's tokens saves were issued for so far
    peer: str | None = None  # consumer: the producer's daemon its hit is on (`kvstore_peer`)
    scheduled_at: float = 0.0  # producer: when it was first scheduled (time.monotonic())
    reused: int = 0  # producer: prompt tokens it did not compute (vLLM's cache, kvstore's)

    @property
    def keys(self) -> list[PrefixKeys]:
        """The first shard's keys, per KV-cache group."""
        return [shards[0] for shards in self.shard_keys]


def _namespace_of(request: Request) -> tuple[str, str] | None:
    """`(salt, lora)` of a request the store can serve, or None when keys over its prompt
    tokens would not identify its KV (multimodal inputs, prompt embeddings)."""
    if request.prompt_token_ids is None or request.mm_features \
            or request.prompt_embeds is not None:
        return None
    lora = request.lora_request
    return request.cache_salt or "", f"{lora.lora_name}@{lora.lora_path}" if lora else ""


def _prefilled_tokens(request: Request) -> int | None:
    """The tokens a disaggregated producer published for `request` (`kv_transfer_params`,
    `PREFILLED_TOKENS`), or None."""
    params = request.kv_transfer_params
    want = params.get(PREFILLED_TOKENS) if isinstance(params, dict) else None
    return want if isinstance(want, int) and not isinstance(want, bool) else None


def _prefill_rate(request: Request) -> float | None:
    """The producer's prefill rate, tokens/s, sent with `request` (`PREFILL_RATE`), or None
    when absent or not a positive finite number (params come with the request: a malformed
    one only loses the bound it gives)."""
    params = request.kv_transfer_params
    rate = params.get(PREFILL_RATE) if isinstance(params, dict) else None
    if isinstance(rate, bool) or not isinstance(rate, int | float) \
            or not 0 < rate < math.inf:
        return None
    return float(rate)


class _CopyGuard:
    """Keeps a copy callback from touching vLLM's pages once its call has returned.

    The client runs the callback in a worker thread and, on a deadline, stops it between
    pieces; but a caller that gave up on a wedged client could otherwise race a late piece
    against vLLM reusing the pages. A piece starts only while open (several may run at
    once: a layer-by-layer load's helpers); `close` waits for the running ones.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = True
        self._running = 0

    def run(self, stop: threading.Event, piece: Callable[[], None]) -> bool:
        with self._cond:
            if not self._open or stop.is_set():
                return False
            self._running += 1
        try:
            piece()
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()
        return True

    def close(self) -> None:
        with self._cond:
            self._open = False
            self._cond.wait_for(lambda: self._running == 0)


def _pieces(items: list[View], bytes_per_page: int) -> Iterable[list[View]]:
    """`items` in groups of about `_COPY_PIECE_BYTES` (whole items)."""
    group: list[View] = []
    size = 0
    for item in items:
        group.append(item)
        size += len(item[2]) * bytes_per_page
        if size >= _COPY_PIECE_BYTES:
            yield group
            group, size = [], 0
    if group:
        yield group


class _Saver:
    """A background thread that runs saves in order, with a bounded queue, counting the
    saves pending per request."""

    def __init__(self, save: Callable[[SaveSpec, float], None], maxsize: int) -> None:
        self._save = save
        self._queue: queue.Queue[tuple[SaveSpec, float] | None] = queue.Queue(maxsize)
        self._pending: Counter[str] = Counter()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kvstore-saver", daemon=True)
        self._thread.start()

    def submit(self, spec: SaveSpec) -> bool:
        """Queue a save; False (and nothing pending) when the queue is full."""
        with self._cond:
            self._pending[spec.req_id] += 1
        try:
            self._queue.put_nowait((spec, time.perf_counter()))
        except queue.Full:
            self._done(spec.req_id)
            return False
        return True

    def pending(self, req_id: str) -> bool:
        with self._cond:
            return self._pending[req_id] > 0

    def wait(self, req_ids: Iterable[str], timeout: float | None = None) -> bool:
        """Wait until none of `req_ids` has a save pending; False on timeout."""
        ids = list(req_ids)
        with self._cond:
            return self._cond.wait_for(lambda: not any(self._pending[r] for r in ids),
                                       timeout)

    def close(self, timeout: float) -> bool:
        """Finish the queued saves within `timeout`; False when some were left running."""
        deadline = time.monotonic() + timeout
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return False
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            spec, queued = item
            try:
                self._save(spec, queued)
            except Exception:  # a failed save is a future miss, never the engine's problem
                log.exception("kvstore save failed for request %s", spec.req_id)
            finally:
                self._done(spec.req_id)

    def _done(self, req_id: str) -> None:
        with self._cond:
            self._pending[req_id] -= 1
            if self._pending[req_id] <= 0:
                del self._pending[req_id]
            self._cond.notify_all()


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM v1 connector over a kvstore daemon; see the module docstring."""

    # Hits come from the daemon's host arena or its disk tier: attribute them to host memory.
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._cfg = ConnectorConfig.from_extra(
            dict(self._kv_transfer_config.kv_connector_extra_config or {}))
        # Tensor parallel: each worker moves its own rank's shard, under its own layouts; the
        # scheduler (one process) keys a prompt for every rank and counts a block cached only
        # when every rank's shard of it is (docs/ENGINES.md, "Tensor parallel").
        # Pipeline parallel: each stage's workers move its layers' shards, and agree on each
        # load with the stages before them (`_agree`; docs/ENGINES.md, "Pipeline parallel").
        self._tp = vllm_config.parallel_config.tensor_parallel_size
        self._pp = vllm_config.parallel_config.pipeline_parallel_size
        self._rank = self._stage = 0
        if role == KVConnectorRole.WORKER and self._tp > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._rank = get_tensor_model_parallel_rank()
        if role == KVConnectorRole.WORKER and self._pp > 1:
            from vllm.distributed.parallel_state import get_pp_group

            self._stage = get_pp_group().rank_in_group
        self._worker = ", ".join([f"PP stage {self._stage} of {self._pp}"] * (self._pp > 1)
                                 + [f"TP rank {self._rank} of {self._tp}"] * (self._tp > 1))
        # Each group's `shards` name every worker's (the scheduler keys and looks up them all).
        self._groups = groups_for_vllm(vllm_config, kv_cache_config, self._cfg, self._rank,
                                       self._stage)
        self._layout = self._groups[0].layout
        # Hybrid models (several KV-cache groups, vLLM's hybrid manager): each group's blocks
        # under its own keys; loads asynchronous (vLLM takes a failed load per request only,
        # `failed_recving`, when block ids are per group) and saves synchronous (vLLM frees a
        # sliding-window group's blocks behind the window while the request runs).
        self._hybrid = len(self._groups) > 1
        # Loads vLLM sees as asynchronous (the request waits, unscheduled, until the worker
        # reports it loaded): hybrid models' (carried out in the step), and with `async_load`
        # every model's (carried out in a background thread while the engine runs others).
        self._async_load = self._hybrid or self._cfg.async_load
        # The tokens of one of vLLM's request hashes (`request.block_hashes`), which KV events
        # carry: a one-group model's block size; with several groups vLLM hashes at the GCD of
        # theirs (`resolve_kv_cache_block_sizes`, set on the config before the scheduler).
        self._hash_block_size = (getattr(kv_cache_config, "hash_block_size", None)
                                 or vllm_config.cache_config.block_size)
        self._clients: dict[tuple[str, str, int, int, str], KVClient] = {}
        # one client per (salt, LoRA) namespace, KV-cache group and shard; salts are few
        self._max_clients = _MAX_CLIENTS * sum(len(g.all_shards) for g in self._groups)
        self._clients_lock = threading.Lock()  # the saver thread makes clients too
        # scheduler side
        self._matched: dict[str, tuple[int, int]] = {}  # req_id -> (local tokens, hit end)
        self._requests: dict[str, _Request] = {}
        # (req_id, group) -> its prompt's keys so far, one chain per shard, from its first
        # lookup to request_finished
        self._chains: dict[tuple[str, int], tuple[tuple[str, str], list[KeyChain]]] = {}
        self._async_loads: list[str] = []  # asynchronous: requests whose load goes out next
        # Last turns (`END_SESSION`) whose saves are still running: req_id -> (namespace, keys,
        # shared tokens); their hint goes out, from one background thread, when the save is done.
        self._ending: dict[str, tuple[tuple[str, str], list[list[PrefixKeys]], int]] = {}
        self._hinter: ThreadPoolExecutor | None = None
        self._load_failed: set[str] = set()  # asynchronous: loads that failed: recompute
        # Disaggregated prefill (docs/ENGINES.md): a producer saves before the step returns
        # (its answer must not reach the proxy before its blocks are committed) and tells
        # the consumer what it published; a consumer loads, waits for those blocks within
        # `consumer_wait_s`, and saves nothing. kv_both: neither change.
        kv_role = self._kv_transfer_config.kv_role
        self._producer, self._consumer = kv_role == "kv_producer", kv_role == "kv_consumer"
        self._saves = not self._consumer
        self._async_save = self._cfg.async_save and not self._producer and not self._hybrid
        # consumer: the requests waiting for their producer's blocks
        self._waiting: dict[str, _Wait] = {}
        # consumer: the producers' daemons it may load from, req_id -> the one a lookup found
        # a request's blocks on, and the unlisted ones requests named (warned about once)
        self._peers = self._cfg.peer_set()
        self._from_peer: dict[str, str] = {}
        self._unlisted_peers: set[str] = set()
        # worker side
        self._cache: PagedCache | None = None
        self._caches: list[PagedCache] = []  # per KV-cache group
        self._shard_caches: dict[tuple[int, int], PagedCache] = {}  # (group, shard): its heads
        self._recving: set[str] = set()  # asynchronous: loads done since the last report
        self._recv_failed: set[str] = set()  # of those, the ones that failed
        self._recv_lock = threading.Lock()  # the loader thread adds to both
        self._loader: ThreadPoolExecutor | None = None  # `async_load`: one thread, in order
        # `layerwise_load`: the thread that fetches a step's loads while its forward runs,
        # the step's loads in flight, the layers whose attention waited for them, and the
        # kvstore layer of each of vLLM's attention layers
        self._layerwise: ThreadPoolExecutor | None = None
        self._layerwise_step: tuple[list[tuple[LoadSpec, LayerwiseLoad]],
                                    Future[list[tuple[int, float]]]] | None = None
        self._layers_waited: set[int] = set()
        self._layer_of: dict[str, int] = {}
        self.pieces_helped = 0  # load pieces the forward's threads copied while they waited
        self._load_errors: set[int] = set()
        self._failed_reqs: set[str] = set()
        self._saver: _Saver | None = None  # started with the cache, in the worker
        self._save_reqs: set[str] = set()  # requests whose free the scheduler delayed for us
        self._finishing: set[str] = set()  # of those, finished ones with saves still pending
        self.loaded_tokens = 0
        self.saved_tokens = 0
        # What recomputing costs here, learnt from the worker's own full prefills: a load goes
        # on while finishing it can still beat recomputing what it carries.
        self._prefill = PrefillModel()
        self._pp_sends: list[Any] = []  # PP: this stage's load results in flight to the next
        self._step_began: float | None = None
        self._side_cpus: set[int] | None = None  # CPUs off vLLM's compute threads: saves
        # Synchronous loads stall the forward: they copy on its CPUs and the side ones.
        self._load_cpus: set[int] | None = None
        # Saves not queued (the queue was full); the client counts the ones it drops.
        self._drops = LogThrottle(_DROP_LOG_S)
        if role == KVConnectorRole.SCHEDULER:
            # A cache miss is never an error: a block that fails to load is recomputed. vLLM's
            # default policy ("fail") would fail the request instead. The scheduler reads the
            # policy right after building its connector, from this same config object.
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        layouts = [s.layout for g in self._groups for s in g.all_shards
                   if role == KVConnectorRole.SCHEDULER
                   or s in g.shards_of(self._rank, self._stage)]
        log.info("kvstore connector (%s%s) on %s, layout%s %s", role.name,
                 f", {self._worker}" if role == KVConnectorRole.WORKER and self._worker
                 else "", self._cfg.target, "s" if len(layouts) > 1 else "",
                 layouts if len(layouts) > 1 else self._layout)

    @property
    def requires_kv_delivery(self) -> bool:
        """A dropped save is a future miss, not a lost hand-off: never hold requests for it."""
        return False

    def _client(self, salt: str, lora: str, group: int = 0, shard: int | None = None,
                peer: str | None = None) -> KVClient:
        """The client of one namespace, KV-cache group and shard (default: the group's first
        this rank holds), created on first use in this process (workers are spawned: a client
        made before would not survive); of the daemon `peer` (a producer's) if given, else of
        this engine's."""
        g = self._groups[group]
        index = g.shards_of(self._rank, self._stage)[0].index if shard is None else shard
        key = (salt, lora, group, index, peer or "")
        with self._clients_lock:
            client = self._clients.get(key)
            if client is None:
                if len(self._clients) >= self._max_clients:  # close the oldest
                    self._clients.pop(next(iter(self._clients))).close()
                token = self._cfg.token
                if peer is not None and self._cfg.peer_token is not None:
                    token = self._cfg.peer_token
                client = KVClient(peer or self._cfg.target, g.all_shards[index].layout,
                                  salt=salt,
                                  lora=lora,
                                  tenant=self._cfg.tenant, token=token,
                                  deadline_s=self._cfg.deadline_s,
                                  transfer=self._cfg.transfer if peer is None else "auto")
                self._clients[key] = client
            return client

    # ==== scheduler side
    def _prompt_keys(self, request: Request, ns: tuple[str, str], tokens: list[int],
                     ) -> list[list[PrefixKeys]]:
        """The keys of the prompt's full blocks, `[KV-cache group][shard]`, hashing only
        blocks this request has not had hashed before (vLLM looks a waiting request up at
        every step it stays waiting)."""
        out: list[list[PrefixKeys]] = []
        for g in self._groups:
            held = self._chains.get((request.request_id, g.index))
            if held is None or held[0] != ns:
                chains = []
                for shard in g.all_shards:
                    client = self._client(*ns, g.index, shard.index)
                    # A new prompt is keyed by the client, whose cache knows prefixes other
                    # requests shared (a system prompt); the chain then follows this request.
                    chains.append(KeyChain(client.namespace.digest(),
                                           shard.layout.block_tokens, client.keys))
                held = self._chains[(request.request_id, g.index)] = (ns, chains)
            out.append([chain.keys(tokens) for chain in held[1]])
        return out

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int,
                                   ) -> tuple[int | None, bool]:
        ns = _namespace_of(request)
        tokens = request.prompt_token_ids
        if ns is None or tokens is None or len(tokens) < 2 \
                or request.request_id in self._load_failed:
            # An asynchronous load that failed: vLLM looks the request up again; computing it
            # beats failing the same way again.
            return 0, False
        waiting = self._waiting.get(request.request_id)
        now = time.monotonic()
        if waiting is not None and now - waiting.last < _WAIT_LOOKUP_S \
                and now - waiting.began < waiting.budget:
            return None, False  # a consumer waiting for its producer, looked up just now
        try:
            # A block missing in any group, or any shard of it (a TP rank's, a KV head's),
            # is a miss for every prefix reaching it: the hit is the shortest of the (group,
            # shard) cached prefixes (every shard of every group stores every block, so each
            # one's prefix ends where its first missing block is).
            keys = self._prompt_keys(request, ns, tokens)
            # A consumer's request the producer prefilled: its blocks come through the remote
            # tier now or soon; the daemon reads what has arrived into host meanwhile.
            want = _prefilled_tokens(request) if self._consumer else None
            hit = self._shortest_hit(ns, keys, prefetch=want is not None)
            # Short on this engine's daemon: the producer's own daemon holds the whole prompt
            # since its answer (its saves are synchronous); load from there at once.
            self._from_peer.pop(request.request_id, None)
            if want is not None and hit < want and (peer := self._peer(request)) is not None:
                on_peer = self._shortest_hit(ns, keys, peer=peer)
                if on_peer > hit:
                    hit = on_peer
                    self._from_peer[request.request_id] = peer
        except Exception:  # the client misses on daemon trouble; anything else: still a miss
            log.exception("kvstore lookup failed for request %s", request.request_id)
            self._waiting.pop(request.request_id, None)
            return 0, False
        if self._consumer and self._must_wait(request, max(hit, num_computed_tokens), now):
            return None, False  # vLLM leaves it waiting and asks again next step
        self._matched[request.request_id] = (num_computed_tokens, hit)
        # Never the last prompt token: vLLM must compute at least one token for its logits.
        n = max(0, min(hit, len(tokens) - 1) - num_computed_tokens)
        return n, self._async_load and n > 0

    def _peer(self, request: Request) -> str | None:
        """The producer's daemon a consumer's request names (`kvstore_peer`) if `kvstore.peers`
        lists it; None otherwise (an unlisted one is warned about once)."""
        params = request.kv_transfer_params
        peer = params.get(PEER) if isinstance(params, dict) else None
        if not isinstance(peer, str) or not peer:
            return None
        if peer in self._peers:
            return peer
        if peer not in self._unlisted_peers and len(self._unlisted_peers) < 64:
            self._unlisted_peers.add(peer)
            log.warning("kvstore: ignoring kvstore_peer %r of request %s: not in kvstore.peers "
                        "(%s); waiting for the remote tier instead", peer,
                        request.request_id, ", ".join(sorted(self._peers)) or "empty")
        return None

    def _shortest_hit(self, ns: tuple[str, str], keys: list[list[PrefixKeys]],
                      prefetch: bool = False, peer: str | None = None) -> int:
        """The tokens every (group, shard) holds of the prompt: each shard is looked up only
        as far as the shorter hits before it reach, and not at all after a miss (a prompt
        nothing holds costs one lookup, not one per KV head with `shared_model`). `prefetch`:
        the daemon starts reading the hit's remote (and disk) blocks into host
        (`KVClient.lookup`). `peer`: look up on that daemon (a producer's) instead."""
        hit: int | None = None
        for g in self._groups:
            for s in g.all_shards:
                chain = keys[g.index][s.index]
                if hit is not None:
                    chain = chain.prefix(hit // chain.block_tokens)
                hit = self._client(*ns, g.index, s.index, peer).lookup(chain,
                                                                       prefetch=prefetch)
                if hit == 0:
                    return 0
        return hit or 0

    def _must_wait(self, request: Request, found: int, now: float) -> bool:
        """Consumer: whether `request` stays unscheduled for blocks its producer published
        (`kvstore_prefilled_tokens` in its `kv_transfer_params`) that a lookup, `found`
        tokens, does not reach yet; from its first lookup for at most `_wait_budget`."""
        rid = request.request_id
        want = _prefilled_tokens(request)
        wait = self._waiting.get(rid)
        if want is None or found >= want:
            if wait is not None:
                log.info("kvstore: request %s waited %.1f ms for its producer's blocks",
                         rid, (now - wait.began) * 1e3)
                del self._waiting[rid]
            return False
        if wait is None:
            wait = self._waiting[rid] = _Wait(now, now, *self._wait_budget(request, want - found))
        if now - wait.began < wait.budget:
            wait.last = now
            return True
        del self._waiting[rid]
        log.warning("kvstore: request %s found %d of the %d tokens its producer published "
                    "after waiting %.3f s (%s); vLLM computes the rest",
                    rid, found, want, now - wait.began, wait.why)
        return False

    def _wait_budget(self, request: Request, missing: int) -> tuple[float, str]:
        """The most a consumer request waits for `missing` tokens of its producer's, and why:
        `consumer_wait_s`, and no longer than recomputing them at the producer's rate (a wait
        past that costs more than the blocks could save); unset: that time up to
        `_WAIT_MAX_S`, `_WAIT_NO_RATE_S` without a rate."""
        cap, rate = self._cfg.consumer_wait_s, _prefill_rate(request)
        if rate is None:
            if cap is None:
                return _WAIT_NO_RATE_S, "the default wait: the producer sent no prefill rate"
            return cap, "kvstore.consumer_wait_s"
        recompute = missing / rate
        limit = _WAIT_MAX_S if cap is None else cap
        if recompute <= limit:
            return recompute, (f"recomputing {missing} tokens at the producer's {rate:.0f} "
                               f"tokens/s would take that long")
        return limit, ("kvstore.consumer_wait_s" if cap is not None
                       else f"the most a producer's rate gives, {_WAIT_MAX_S:.0f} s")

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        local, hit = self._matched.pop(request.request_id, (0, 0))
        prev = self._requests.get(request.request_id)
        if self._async_load and prev is not None and num_external_tokens == 0:
            # Scheduled after its asynchronous load: vLLM allocates again without a lookup;
            # what kvstore held then still holds for saving. (Not after a preemption
            # of a synchronous load: its new lookup is the fresher figure.)
            hit = max(hit, prev.hit_end)
        ns = _namespace_of(request)
        if ns is None or request.prompt_token_ids is None:
            return
        keys = self._prompt_keys(request, ns, request.prompt_token_ids)
        save_end = keys[0][0].num_tokens
        state = _Request(shard_keys=keys, num_tokens=len(request.prompt_token_ids), salt=ns[0],
                         lora=ns[1], save_end=save_end, hit_end=hit,
                         block_ids=[list(ids) for ids in blocks.get_block_ids()],
                         saved_to=min(hit, save_end),
                         peer=self._from_peer.get(request.request_id))
        if prev is not None:  # allocated again (after an asynchronous load, a preemption)
            state.scheduled_at, state.reused = prev.scheduled_at, prev.reused
        else:
            state.scheduled_at = time.monotonic()
            state.reused = local + num_external_tokens
        if num_external_tokens > 0:
            # vLLM counts external tokens from the block-aligned local hit it passed us.
            state.load = (local, local + num_external_tokens)
            if self._async_load:  # the request is not scheduled meanwhile
                self._async_loads.append(request.request_id)
        self._requests[request.request_id] = state
        # KV events: vLLM's hashes; a hybrid model's blocks per group, named as vLLM's own
        # events name that group's. A block stored as several shards (TP/PP ranks, KV heads)
        # is described by its first shard's keys only, which stage 0's TP rank 0 saves: one
        # event per block, not per shard; a router takes the first shard for the block
        # (docs/ENGINES.md, "KV events").
        if self._saves and state.save_end > state.hit_end:
            for g, group_keys in zip(self._groups, state.keys, strict=True):
                describe_request(self._client(*ns, g.index, 0), request, group_keys,
                                 self._hash_block_size, _event_group(g) if self._hybrid else None)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._waiting and not scheduler_output.total_num_scheduled_tokens:
            self._idle_while_waiting()
        meta = KVStoreConnectorMetadata(
            preempted=sorted(scheduler_output.preempted_req_ids or ()))
        scheduled = scheduler_output.num_scheduled_tokens
        meta.prefill = self._prefill_span(scheduler_output)
        for req_id in self._async_loads:
            state = self._requests.get(req_id)
            if state is not None and state.load is not None:
                self._plan_load(req_id, state, meta)
        self._async_loads.clear()
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = [list(ids) for ids in new.block_ids]
                self._plan(new.req_id, state, new.num_computed_tokens, scheduled[new.req_id],
                           meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # after preemption: the full list, anew
                state.block_ids = [list(ids) for ids in new_ids] if new_ids else []
                state.saved_to = min(state.saved_to, state.hit_end)
            elif new_ids:
                if not state.block_ids:
                    state.block_ids = [[] for _ in new_ids]
                for mine, more in zip(state.block_ids, new_ids, strict=True):
                    mine.extend(more)
            self._plan(req_id, state, cached.num_computed_tokens[i], scheduled[req_id], meta)
        return meta

    def _idle_while_waiting(self) -> None:
        """A step that computes nothing while consumer requests wait for their producer's
        blocks: vLLM's engine loop runs steps back to back while it has requests, so it would
        spin through empty ones, taking a core from the daemons and the remote tier that are
        moving those very blocks (on two cores that doubled the wait). Sleep until the next
        lookup is due instead: at most `_WAIT_LOOKUP_S`, and only when nothing is computed
        (a request arriving meanwhile is admitted that much later)."""
        due = min(w.last for w in self._waiting.values()) + _WAIT_LOOKUP_S
        pause = due - time.monotonic()
        if pause > 0:
            time.sleep(min(pause, _WAIT_LOOKUP_S))

    def _prefill_span(self, out: SchedulerOutput) -> tuple[int, int] | None:
        """`(start, end)` of the prompt tokens this step computes, when it computes only those
        of a single request (no decode, no other request)."""
        scheduled = out.num_scheduled_tokens
        if len(scheduled) != 1:
            return None
        (req_id, n), = scheduled.items()
        new = out.scheduled_new_reqs
        if new:
            start, prompt = new[0].num_computed_tokens, len(new[0].prompt_token_ids or ())
        else:
            cached = out.scheduled_cached_reqs
            state = self._requests.get(req_id)
            if state is None or req_id not in cached.req_ids:
                return None
            start = cached.num_computed_tokens[cached.req_ids.index(req_id)]
            prompt = state.num_tokens
        return (start, start + n) if n > 0 and start + n <= prompt else None

    def _plan(self, req_id: str, state: _Request, computed: int, num_scheduled: int,
              meta: KVStoreConnectorMetadata) -> None:
        if state.load is not None:
            self._plan_load(req_id, state, meta)
        if not self._saves or state.save_end <= state.hit_end:
            return
        if self._hybrid:
            # Every step that completes prompt blocks saves them, all groups, while vLLM still
            # holds them: a sliding-window group's blocks behind the window are freed (null)
            # in later steps, so the end of a chunked prefill could not save them any more.
            bt = self._layout.block_tokens
            end = min(state.save_end, (computed + num_scheduled) // bt * bt)
            if end > state.saved_to:
                for g in self._groups:
                    for shard, keys in enumerate(state.shard_keys[g.index]):
                        meta.saves.append(SaveSpec(req_id, keys.prefix(end // bt),
                                                   state.salt, state.lora,
                                                   list(state.block_ids[g.index]), g.index,
                                                   shard))
                state.saved_to = end
                state.save_issued = True
            return
        # Save in the step that completes the prompt's full blocks (chunked prefill spreads a
        # prompt over steps; a request recomputed after a failed load completes them again).
        if computed < state.save_end <= computed + num_scheduled:
            for shard, keys in enumerate(state.shard_keys[0]):  # its first rank saves each
                meta.saves.append(SaveSpec(req_id, keys, state.salt, state.lora,
                                           list(state.block_ids[0]), shard=shard))
            state.save_issued = True

    def _plan_load(self, req_id: str, state: _Request, meta: KVStoreConnectorMetadata,
                   ) -> None:
        """The LoadSpec(s) of `state.load`: one per KV-cache group. A sliding-window group
        loads only the blocks vLLM gave it: those behind the window of the resumed length
        are vLLM's null block (never read), so they are not fetched either."""
        if state.load is None:
            return
        start, end = state.load
        state.load = None
        bt = self._layout.block_tokens
        for g in self._groups:
            ids = state.block_ids[g.index]
            first = start
            if g.sliding_window is not None:
                live = next((i for i, b in enumerate(ids) if b != _NULL_BLOCK), len(ids))
                first = max(start, live * g.block_size)
            for shard, keys in enumerate(state.shard_keys[g.index]):  # its ranks load each
                meta.loads.append(LoadSpec(req_id, keys.prefix(-(-end // bt)),
                                           state.salt, state.lora, list(ids), first,
                                           max(first, end), g.index, shard, state.peer))

    def request_finished(self, request: Request, block_ids: list[int],
                         ) -> tuple[bool, dict[str, Any] | None]:
        """With background saves, a request a save was issued for keeps its blocks until the
        worker reports the save done (`get_finished`). A producer's requests return the
        tokens it published (`kvstore_prefilled_tokens`: its saves are synchronous, so they
        are committed by now) for the proxy to hand to the consumer."""
        ending = self._ends_session(request)
        state = self._requests.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        for g in self._groups:
            self._chains.pop((request.request_id, g.index), None)
        self._waiting.pop(request.request_id, None)
        self._from_peer.pop(request.request_id, None)
        self._load_failed.discard(request.request_id)
        params: dict[str, Any] | None = None
        if self._producer and state is not None:
            # The proxy hands these to the consumer's request (vLLM's P/D flow), which then
            # waits for these tokens' blocks. Not "do_remote_prefill": vLLM would then report
            # the producer's cache hits as the consumer's.
            params = {PREFILLED_TOKENS: state.save_end}
            if (rate := self._prefill_rate(state)) is not None:
                params[PREFILL_RATE] = rate
            if self._cfg.peer_target:
                params[PEER] = self._cfg.peer_target
        saving = bool(self._async_save and state is not None and state.save_issued)
        if ending is not None:
            if saving:  # its blocks are not all in the store yet: hint once they are
                self._ending[request.request_id] = ending
            else:
                self._end_session(*ending)
        return saving, params

    @staticmethod
    def _prefill_rate(state: _Request) -> float | None:
        """Producer: the tokens it computed for a finished request per second from its first
        scheduling to now (its answer: the prefill, any queueing behind others' chunks, the
        synchronous save), what recomputing them costs a consumer like it; None when it
        computed less than a block (a rate over a few tokens says little)."""
        computed = state.num_tokens - state.reused
        seconds = time.monotonic() - state.scheduled_at
        block = state.keys[0].block_tokens if state.keys else 1
        if computed < block or seconds <= 0:
            return None
        return round(computed / seconds, 1)

    def _ends_session(self, request: Request,
                      ) -> tuple[tuple[str, str], list[list[PrefixKeys]], int] | None:
        """`(namespace, keys, shared tokens)` of a request whose `kv_transfer_params` end its
        conversation (`END_SESSION`), else None (a malformed `SHARED_TOKENS` is logged and
        the hint not sent: a hint that marked shared blocks would cost other users)."""
        params = getattr(request, "kv_transfer_params", None)  # vLLM's own Request has it
        if not isinstance(params, dict) or params.get(END_SESSION) is not True:
            return None
        ns, tokens = _namespace_of(request), request.prompt_token_ids
        if ns is None or not tokens:
            return None
        shared = params.get(SHARED_TOKENS, 0)
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
            log.warning("kvstore: request %s: %s must be an int >= 0, got %r; its end of "
                        "session is not sent", request.request_id, SHARED_TOKENS, shared)
            return None
        return ns, self._prompt_keys(request, ns, tokens), min(shared, len(tokens))

    def _end_session(self, ns: tuple[str, str], keys: list[list[PrefixKeys]],
                     shared: int) -> None:
        """Send `EndSession` for each (group, shard) chain of a prompt, off the scheduler's
        thread (a daemon that is down costs the client's deadline, not a scheduler step)."""
        def send() -> None:
            for g in self._groups:
                for s in g.all_shards:
                    chain = keys[g.index][s.index]
                    self._client(*ns, g.index, s.index).end_session(
                        chain, min(shared, chain.num_tokens))

        if self._hinter is None:
            self._hinter = ThreadPoolExecutor(1, thread_name_prefix="kvstore-hint")
        self._hinter.submit(send)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Scheduler side: note asynchronous loads that failed (see
        `get_num_new_matched_tokens`), and send the hints of last turns whose saves are done
        (`END_SESSION`)."""
        self._load_failed |= set(connector_output.failed_recving or ())
        for rid in connector_output.finished_sending or ():
            ending = self._ending.pop(rid, None)
            if ending is not None:  # a last turn's save is done: its hint goes out now
                self._end_session(*ending)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...],
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid-manager twin of `request_finished` (`SupportsHMA`): the same, with
        the block ids of every KV-cache group (saves hold no blocks of their own here: the
        hybrid path saves synchronously)."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    # ==== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take vLLM's cache tensors; raises `ConnectorConfigError` (at engine start) when they
        are not what the layout says or not in a layout this connector decodes."""
        caches = []
        for g in self._groups:
            # Order layers by their index in the model, which is kvstore's layer axis. One
            # group: every cache vLLM registered (as before hybrid support); several: each
            # group's own layers (vLLM may back layers of two groups with one tensor: a
            # group's block ids index its own layers' views of it).
            names = sorted(kv_caches if not self._hybrid else g.layer_names, key=_layer_index)
            caches.append(self._group_cache(g, names, [kv_caches[n] for n in names]))
        if any(c.engine is None for c in caches):
            native_copy()  # build (or load) the C copy routine now, not in the first request
        self._side_cpus = side_cpus()
        self._load_cpus = load_cpus()
        log.info("kvstore: background saves copy on CPUs %s, loads on %s",
                 sorted(self._side_cpus or ()) or "any (vLLM's compute threads are not bound)",
                 sorted(self._load_cpus or ()) or "the worker's CPUs")
        self._caches = caches
        self._cache = caches[0]
        # The heads of each shard this rank holds: a slice of the group's cache where shards
        # are one KV head each (`kvstore.shared_model`), else the whole cache.
        self._shard_caches = {
            (g.index, s.index): caches[g.index].head_slice(s.first_head - g.first_head,
                                                           s.layout.num_kv_heads)
            for g in self._groups for s in g.shards_of(self._rank, self._stage)}
        # Map the daemon's arena at engine start: its pages are touched in the background
        # before the first save copies into them (kvstore.client.aio.PREFAULT_ENV). A cache
        # on a GPU has it pinned too: the kernels then read loads across the bus themselves.
        on_gpu = any(c.engine is not None and c.engine.device.type == "cuda" for c in caches)
        self._client("", "").prepare(pin=on_gpu)
        if self._peers:  # a consumer's loads from its producers' daemons stream over TCP
            for layout in {s.layout for g in self._groups
                           for s in g.shards_of(self._rank, self._stage)}:
                warm_stream_buffers(layout)
        if self._async_save and self._saves and self._saver is None:
            self._saver = _Saver(self._save, self._cfg.save_queue)
        if self._cfg.async_load and self._loader is None:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvstore-load")
        # Layer by layer: one KV-cache group on the CPU, loads in the step (not async_load),
        # one pipeline stage (a stage's loads are agreed on with the next before its forward).
        if (self._cfg.layerwise_load and not self._async_load and self._pp == 1
                and caches[0].engine is None and self._layerwise is None):
            self._layer_of = {name: i for i, name in enumerate(
                sorted(kv_caches, key=_layer_index))}
            self._layerwise = ThreadPoolExecutor(1, thread_name_prefix="kvstore-layerwise")

    def _group_cache(self, group: KVGroup, names: list[str], tensors: list[torch.Tensor],
                     ) -> PagedCache:
        """The paged cache of one KV-cache group's layers, checked against its layout."""
        lay = group.layout
        if lay.dtype_name in FP8_CACHE_DTYPES.values() and tensors[0].dtype == torch.uint8:
            # vLLM allocates fp8 caches as bytes: the same memory, read as what it holds.
            tensors = [t.view(lay.torch_dtype) for t in tensors]
        first = tensors[0]
        layers = self._vllm_config.compilation_config.static_forward_context
        if lay.kv_kind == "mla":
            cache = self._kernels_cache(names, tensors, layers)
        elif first.device.type == "cpu":
            isas = {getattr(layers.get(name), "isa", None) for name in names}
            if len(isas) != 1:
                raise ConnectorConfigError(f"attention layers disagree on their ISA: {isas}")
            isa = str(isas.pop())
            try:
                cache = PagedCache.vllm_cpu(tensors, isa)
            except ValueError as e:
                raise ConnectorConfigError(str(e)) from e
            log.info("kvstore: vLLM's CPU cache, ISA %s, %s", isa, first.dtype)
        elif first.dim() == 5 and first.shape[0] == 2:
            # vLLM's CUDA layouts: an NHD-shaped view even when HND is allocated underneath.
            cache = PagedCache.kernels(EngineKV.paged(EngineLayout.VLLM_NHD, tensors))
        else:
            raise ConnectorConfigError(f"unknown KV-cache layout {tuple(first.shape)}")
        got = (cache.num_layers, cache.heads, cache.head_dim, cache.dtype)
        want = (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype)
        if got != want:
            raise ConnectorConfigError(f"KV cache (layers, heads, head_dim, dtype) {got} does "
                                       f"not match the layout {want}")
        if group.block_size % cache.page_size:
            raise ConnectorConfigError(f"cache page size {cache.page_size} does not divide "
                                       f"vLLM's block size {group.block_size} of KV-cache "
                                       f"group {group.index}")
        return cache

    def _kernels_cache(self, names: list[str], tensors: list[torch.Tensor],
                       layers: dict[str, Any]) -> PagedCache:
        """A cache the copy kernels move, its layout read from vLLM's own for this version
        and attention backend (`kernels.vllm_engine_kv`): anything else is refused here."""
        import vllm

        backends = {layers[n].attn_backend.get_name() if n in layers else None for n in names}
        if len(backends) != 1 or None in backends:
            raise ConnectorConfigError(f"attention layers disagree on their backend: {backends}")
        lay = self._layout
        try:
            engine = vllm_engine_kv(str(backends.pop()), vllm.__version__, tensors,
                                    num_kv_heads=lay.num_kv_heads, head_size=lay.head_dim)
        except KernelArgumentError as e:
            raise ConnectorConfigError(str(e)) from e
        return PagedCache.kernels(engine)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Called before every step's forward: the step's start, to time full prefills."""
        super().bind_connector_metadata(connector_metadata)
        self._step_began = time.perf_counter()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._settle_layerwise()  # a step that never reached its end (nothing should remain)
        self._failed_reqs.clear()
        # Each rank loads the shards its cache holds (the scheduler sends one spec per shard).
        loads = [spec for spec in self._metadata().loads if self._holds(spec)]
        if self._loader is not None:
            # In the background, while this step's forward runs the other requests (the loading
            # ones are not scheduled): reported done or failed by a later step's get_finished.
            if loads:
                self._loader.submit(self._load_in_background, loads)
            return
        if self._hybrid:
            # A group short on any rank fails the request's load on that rank; vLLM takes a
            # request as loaded only when every rank reports it (KVOutputAggregator) and
            # fails it when any rank does: all ranks then recompute it from its first token.
            self._load_groups(loads)
            return
        if loads and self._layerwise is not None and sum(
                spec.end - spec.start for spec in loads) >= self._cfg.layerwise_min_tokens:
            # Copied beside this step's forward: each attention layer waits for its own K/V
            # (`wait_for_layer_load`); settled after the forward (`_settle_layerwise`).
            step = [(spec, LayerwiseLoad(self._layout.num_layers)) for spec in loads]
            self._layerwise_step = (step, self._layerwise.submit(self._load_layerwise, step))
            self._layers_waited.clear()
            return
        self._settle([(spec, *self._timed_load(spec, self._load_cpus)) for spec in loads])

    def _timed_load(self, spec: LoadSpec, cpus: set[int] | None,
                    layerwise: LayerwiseLoad | None = None) -> tuple[int, float]:
        """`_load`, never raising (a cache must never take the engine down: recompute
        instead): the end of the tokens it loaded, and its milliseconds."""
        began = time.perf_counter()
        try:
            loaded = self._load(spec, cpus, layerwise)
        except Exception:
            log.exception("kvstore load failed for request %s", spec.req_id)
            loaded = spec.start
        finally:
            if layerwise is not None:
                layerwise.finish()
        self.loaded_tokens += max(0, loaded - spec.start)
        return loaded, (time.perf_counter() - began) * 1e3

    def _load_layerwise(self, step: list[tuple[LoadSpec, LayerwiseLoad]],
                        ) -> list[tuple[int, float]]:
        """One step's loads, one after another, in the layer-by-layer loader thread (off
        vLLM's compute CPUs, which help while they wait)."""
        run_on(self._side_cpus)
        return [self._timed_load(spec, self._side_cpus, layerwise) for spec, layerwise in step]

    def _settle_layerwise(self) -> None:
        """After the forward (from `wait_for_save`, or whichever of the step's closing calls
        comes first): wait for the step's layer-by-layer loads and report them as a
        synchronous load's are. A layer whose attention never waited for its load
        (`wait_for_layer_load`: a backend that does not call it) may have been read while
        being written: every load of the step then fails (vLLM recomputes them) and later
        loads copy whole before the forward."""
        if self._layerwise_step is None:
            return
        step, future = self._layerwise_step
        self._layerwise_step = None
        try:
            timed = future.result()
        except BaseException:  # `_timed_load` raises nothing; a dead thread fails them all
            log.exception("kvstore: layer-by-layer loads failed")
            timed = [(spec.start, 0.0) for spec, _ in step]
        missed = set(range(self._layout.num_layers)) - self._layers_waited
        if missed:
            log.warning("kvstore: attention layers %s did not wait for their layer-by-layer "
                        "load: this step's loads are recomputed, and loads copy whole before "
                        "the forward from now on", sorted(missed))
            timed = [(spec.start, ms) for (spec, _), (_, ms) in zip(step, timed, strict=True)]
            self._layerwise.shutdown(wait=False)  # type: ignore[union-attr]
            self._layerwise = None
        helped = sum(layerwise.helped for _, layerwise in step)
        self.pieces_helped += helped
        log.info("kvstore: %d load(s) layer by layer beside the forward; %d of %d pieces "
                 "copied by the forward while it waited", len(step), helped,
                 sum(layerwise.pieces for _, layerwise in step))
        self._settle([(spec, loaded, ms)
                      for (spec, _), (loaded, ms) in zip(step, timed, strict=True)])

    def _settle(self, timed: list[tuple[LoadSpec, int, float]]) -> None:
        """Report one step's synchronous loads (`(spec, end of the tokens it loaded, ms)`, in
        the scheduler's order): per request, what every rank's shards loaded; the blocks past
        it go to vLLM as load errors (recomputed) and its saves of this step are skipped."""
        # Per request, in the scheduler's order (the same on every rank): the tokens all of
        # this rank's shards loaded.
        results: dict[str, tuple[LoadSpec, int, float]] = {}
        for spec, loaded, ms in timed:
            if spec.req_id in results:
                _, before, before_ms = results[spec.req_id]
                loaded, ms = min(loaded, before), ms + before_ms
            results[spec.req_id] = (spec, loaded, ms)
        agreed = self._agree([loaded for _, loaded, _ in results.values()])
        for (spec, mine, ms), agreed_end in zip(results.values(), agreed, strict=True):
            loaded = max(spec.start, agreed_end)
            if loaded < mine:
                log.warning("kvstore: request %s loaded tokens [%d, %d) on %s, another "
                            "rank only [%d, %d): all ranks recompute from %d", spec.req_id,
                            spec.start, mine, self._worker, spec.start, loaded, loaded)
            if loaded < spec.end:
                self._failed_reqs.add(spec.req_id)
                # Only the blocks from the first token not loaded: vLLM keeps the prefix that
                # arrived and recomputes from there.
                size = self._groups[spec.group].block_size
                first, last = loaded // size, -(-spec.end // size)
                self._load_errors.update(spec.block_ids[first:last])
                log.warning("kvstore: request %s loaded %d of %d claimed tokens in %.1f ms "
                            "(tokens [%d, %d)); vLLM recomputes the rest", spec.req_id,
                            max(0, loaded - spec.start), spec.end - spec.start, ms,
                            spec.start, loaded)
            else:
                log.info("kvstore: request %s loaded tokens [%d, %d) in %.1f ms", spec.req_id,
                         spec.start, spec.end, ms)

    def _shard(self, spec: LoadSpec | SaveSpec) -> KVShard:
        return self._groups[spec.group].all_shards[spec.shard]

    def _holds(self, spec: LoadSpec | SaveSpec) -> bool:
        """Whether this worker's cache holds the spec's shard."""
        shard = self._shard(spec)
        return shard.stage == self._stage and self._rank in shard.ranks

    def _agree(self, loaded: list[int]) -> list[int]:
        """The tokens every worker loaded, per request (every worker holds a shard of each,
        and has them in the scheduler's order): the minimum over the TP ranks, so that every
        rank reports the same blocks failed to vLLM (which recomputes from the first one) and
        none publishes a block this step computed over a prefix another rank failed to load;
        at PP > 1 also over the stages before this one (`_agree_stages`)."""
        if not loaded or (self._tp == 1 and self._pp == 1):
            return loaded
        mins = torch.tensor(loaded, dtype=torch.int64)
        if self._tp > 1:
            try:
                import torch.distributed as dist
                from vllm.distributed.parallel_state import get_tp_group

                dist.all_reduce(mins, op=dist.ReduceOp.MIN, group=get_tp_group().cpu_group)
            except Exception:  # ranks that cannot agree: nothing loaded counts (recompute all)
                log.exception("kvstore: TP ranks could not agree on their loads; recomputing")
                mins.fill_(-1)
        if self._pp > 1:
            mins = self._agree_stages(mins)
        return [int(n) for n in mins.tolist()]

    def _agree_stages(self, mins: torch.Tensor) -> torch.Tensor:
        """PP > 1: the minimum of this stage's loads and every earlier stage's. A stage's
        K/V of the tokens this step computes depend on every earlier stage's layers, so a
        load short on stage 0 makes stage 1's new blocks wrong even where stage 1 loaded
        all: stage 1 must not publish them. Each stage receives the figure of the stage
        before it (sent from that stage's `start_load_kv`, which never waits for a later
        stage: no deadlock) and sends on the minimum, tagged apart from vLLM's own
        point-to-point traffic. A later stage's short load leaves earlier stages' new blocks
        right (they never read its layers); vLLM recomputes from the first failed block that
        any worker reports (KVOutputAggregator takes the union)."""
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_pp_group

        group = get_pp_group()
        self._pp_sends = [work for work in self._pp_sends if not work.is_completed()]
        try:
            if not group.is_first_rank:
                before = torch.empty_like(mins)
                dist.recv(before, src=group.prev_rank, group=group.cpu_group, tag=_PP_LOAD_TAG)
                mins = torch.minimum(mins, before)
            if not group.is_last_rank:
                self._pp_sends.append(dist.isend(mins.clone(), dst=group.next_rank,
                                                 group=group.cpu_group, tag=_PP_LOAD_TAG))
        except Exception:  # stages that cannot agree: nothing loaded counts (recompute all)
            log.exception("kvstore: PP stages could not agree on their loads; recomputing")
            return torch.full_like(mins, -1)
        return mins

    def _load_in_background(self, loads: list[LoadSpec]) -> None:
        """`async_load`: one step's loads, in the loader thread, off vLLM's compute CPUs."""
        run_on(self._side_cpus)
        try:
            self._load_groups(loads, background=True)
        except BaseException:  # never leave a request waiting for a report
            log.exception("kvstore: background load failed")
            with self._recv_lock:
                ids = {spec.req_id for spec in loads}
                self._recving |= ids
                self._recv_failed |= ids

    def _load_groups(self, loads: list[LoadSpec], background: bool = False) -> None:
        """Asynchronous loads: each request's loads, one per KV-cache group (and shard),
        reported to vLLM as done (`finished_recving`) or, when any came short, failed
        (`failed_recving`): vLLM then recomputes the request from its first token (it cannot
        take a failed block of one group: block ids are per group), never from a prefix
        missing a group. In the loader thread when `background`."""
        by_req: dict[str, list[LoadSpec]] = {}
        for spec in loads:
            by_req.setdefault(spec.req_id, []).append(spec)
        for req_id, specs in by_req.items():
            began = time.perf_counter()
            ok = True
            for spec in specs:
                if spec.start >= spec.end:
                    continue  # this group needs nothing vLLM does not hold already
                try:
                    loaded = self._load(spec, self._side_cpus if background
                                        else self._load_cpus)
                except Exception:  # a cache must never take the engine down: recompute
                    log.exception("kvstore load failed for request %s", req_id)
                    loaded = spec.start
                self.loaded_tokens += max(0, loaded - spec.start)
                if loaded < spec.end:
                    ok = False
                    log.warning("kvstore: request %s group %d loaded tokens [%d, %d) of [%d, "
                                "%d); vLLM recomputes the request", req_id, spec.group,
                                spec.start, loaded, spec.start, spec.end)
                    break
            with self._recv_lock:
                self._recving.add(req_id)
                if not ok:
                    self._recv_failed.add(req_id)
            if not ok and not background:
                self._failed_reqs.add(req_id)
            if ok:
                log.info("kvstore: request %s loaded %s in %.1f ms", req_id,
                         ", ".join(f"group {s.group} tokens [{s.start}, {s.end})"
                                   for s in specs), (time.perf_counter() - began) * 1e3)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        self._settle_layerwise()  # before `wait_for_save` when vLLM defers it
        results = super().get_transfer_results(finished_req_ids)
        with self._recv_lock:
            if self._recving:  # asynchronous loads: done (and failed) since the last report
                results.finished_recving |= self._recving
                results.failed_recving |= self._recv_failed
                self._recving, self._recv_failed = set(), set()
        return results

    def _recompute_s(self, start: int, end: int) -> float | None:
        """Seconds this engine would take to compute tokens `[start, end)` of a prompt (the
        attention over the first `start` included), from its own full prefills; None before
        it has timed one."""
        t_end, t_start = self._prefill.seconds(end), self._prefill.seconds(start)
        if t_end is None or t_start is None or t_end <= t_start:
            return None
        return t_end - t_start

    def _metadata(self) -> KVStoreConnectorMetadata:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if meta is None:
            return KVStoreConnectorMetadata()
        if not isinstance(meta, KVStoreConnectorMetadata):
            raise TypeError(f"expected KVStoreConnectorMetadata, got {type(meta).__name__}")
        return meta

    def _load(self, spec: LoadSpec, cpus: set[int] | None = None,
              layerwise: LayerwiseLoad | None = None) -> int:
        """Copy blocks from the daemon's memory into vLLM's pages, on `cpus` (None: where the
        client's thread runs), a layer at a time when `layerwise` (the forward's threads wait
        for each layer, and help); returns the end of the tokens now in vLLM's cache."""
        if not self._caches:
            return spec.start
        cache = self._shard_caches[spec.group, spec.shard]
        lay = self._shard(spec).layout
        bt, ps = lay.block_tokens, cache.page_size
        vllm_block = self._groups[spec.group].block_size  # the tokens of one block id
        bytes_per_page = lay.bytes_per_token * ps
        guard = _CopyGuard()
        every = list(range(spec.start // bt, -(-spec.end // bt)))  # the blocks to load

        def consume(blocks: list[int], views: list[torch.Tensor], stop: threading.Event,
                    ) -> int:
            run_on(cpus)
            items: list[View] = []
            owners: list[int] = []  # the position in `blocks` of each item
            for i, (b, view) in enumerate(zip(blocks, views, strict=True)):
                # Only tokens vLLM asked for: the ones before `start` it computed itself, and
                # those pages may be prefix-cache pages other requests are reading; `end` may
                # fall inside a page (the prompt's last token is vLLM's to compute).
                lo, hi = max(b * bt, spec.start), min((b + 1) * bt, spec.end)
                if lo < hi:
                    pages = token_pages(spec.block_ids, vllm_block, ps, lo,
                                        -(-hi // ps) * ps)
                    items.append((view, lo - b * bt, pages, hi - lo))
                    owners.append(i)
            if layerwise is not None:
                # Layer-major, each layer in pieces of about _LAYER_PIECE_BYTES (a forward
                # that helps goes back to its layers soon): a block is whole only once every
                # layer is, so a copy stopped part-way keeps none of this call's blocks.
                size = sum(len(item[2]) for item in items) * bytes_per_page // lay.num_layers
                parts = max(1, min(len(items), -(-size // _LAYER_PIECE_BYTES)))
                shares = [items[len(items) * p // parts : len(items) * (p + 1) // parts]
                          for p in range(parts)]

                def copy_part(layer: int, part: int) -> bool:
                    return guard.run(stop, functools.partial(cache.scatter_views, shares[part],
                                                             (layer, layer + 1)))

                whole = layerwise.copy_all(copy_part, signal=list(blocks) == every, parts=parts)
                return len(blocks) if whole else 0
            copied = 0
            for piece in _pieces(items, bytes_per_page):
                if not guard.run(stop, functools.partial(cache.scatter_views, piece)):
                    return owners[copied]  # the blocks before the first item not copied
                copied += len(piece)
            return len(blocks)

        began = time.perf_counter()
        try:
            client = self._client(spec.salt, spec.lora, spec.group, spec.shard, spec.peer)
            # `whole_loads`: a layer is ready for the forward only once a call brought every
            # block (`signal`), so in windows the forward waits for a whole disk load. Over
            # TCP (a peer) blocks arrive one after another, all layers each: no layer is
            # complete before the last block, so they are copied in groups as they arrive
            # rather than all at the end through a buffer of the whole prefix.
            n = client.fetch_with(
                spec.keys, consume, skip_blocks=spec.start // bt,
                budget_s=self._recompute_s(spec.start, spec.end),
                whole=layerwise is not None and self._cfg.whole_loads and not client.streams)
        finally:
            guard.close()  # no copy into vLLM's pages after this
        # A shorter prefix than the lookup promised (evicted since, or the daemon went away):
        # keep what arrived, whole vLLM blocks only, and report the rest.
        end = spec.end if n >= spec.end else n // vllm_block * vllm_block
        log.debug("kvstore: request %s fetched tokens [%d, %d) in %.1f ms", spec.req_id,
                  spec.start, max(end, spec.start), (time.perf_counter() - began) * 1e3)
        return max(end, spec.start)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """A layer-by-layer load (`kvstore.layerwise_load`): wait until this layer's K/V of
        every load of the step are in place, copying unclaimed layers meanwhile. Otherwise
        loads are done in `start_load_kv`, or in the loader thread for requests vLLM does not
        schedule until they are done: nothing to wait for."""
        if self._layerwise_step is None:
            return
        layer = self._layer_of.get(layer_name)
        for _, layerwise in self._layerwise_step[0]:
            layerwise.wait(layer)  # None (not a layer of ours): the whole load
        if layer is not None:
            self._layers_waited.add(layer)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """Blocks are saved whole, all layers at once, after the forward (`wait_for_save`)."""

    def wait_for_save(self) -> None:
        self._settle_layerwise()
        meta = self._metadata()
        if meta.prefill is not None and self._step_began is not None and not meta.loads:
            self._prefill.observe_span(*meta.prefill, time.perf_counter() - self._step_began)
        for spec in meta.saves:
            if self._async_save:
                # The scheduler holds its blocks until every rank reports the request done
                # (`get_finished`), the ranks whose spec this is not included.
                self._save_reqs.add(spec.req_id)
            if not self._holds(spec) or self._shard(spec).ranks[0] != self._rank:
                continue  # a shard another worker holds, or saves
            if not self._caches or spec.req_id in self._failed_reqs:
                # This step's KV attended to blocks that failed to load: never publish it.
                continue
            if self._saver is None:
                try:
                    self._save(spec, time.perf_counter())
                except Exception:
                    log.exception("kvstore save failed for request %s", spec.req_id)
            elif not self._saver.submit(spec):
                self._dropped(spec.req_id)

    def _save(self, spec: SaveSpec, queued: float) -> None:
        """Copy the prompt's full blocks from vLLM's pages into blocks reserved in the
        daemon's memory, and commit them (in the saver thread, or in `wait_for_save`)."""
        if not self._caches:
            return
        cache = self._shard_caches[spec.group, spec.shard]
        lay = self._shard(spec).layout
        began = time.perf_counter()
        copying = [0.0]
        # A sliding-window group's blocks behind the window are vLLM's null block by now:
        # those are never copied (a block the daemon lacks there makes the save stop short,
        # committing nothing of that round: a later miss, never wrong bytes).
        live = [b != _NULL_BLOCK for b in spec.block_ids]
        size = self._groups[spec.group].block_size
        pages = token_pages(spec.block_ids, size, cache.page_size, 0, spec.keys.num_tokens)
        per_block = lay.block_tokens // cache.page_size
        vllm_per_block = lay.block_tokens // size
        bytes_per_page = lay.bytes_per_token * cache.page_size
        guard = _CopyGuard()

        def produce(blocks: list[int], views: list[torch.Tensor], stop: threading.Event,
                    ) -> int:
            run_on(self._side_cpus)  # off vLLM's compute threads, which decode meanwhile
            items: list[View] = []
            for b, view in zip(blocks, views, strict=True):
                if not all(live[b * vllm_per_block : (b + 1) * vllm_per_block]):
                    break  # dropped by vLLM and not in the store: save the blocks before it
                items.append((view, 0, pages[b * per_block : (b + 1) * per_block]))
            t0 = time.perf_counter()
            copied = 0
            for piece in _pieces(items, bytes_per_page):
                if not guard.run(stop, functools.partial(cache.gather_views, piece)):
                    break
                copied += len(piece)
            copying[0] += time.perf_counter() - t0
            return copied

        try:
            stored = self._client(spec.salt, spec.lora, spec.group,
                                  spec.shard).publish_with(spec.keys, produce)
        finally:
            guard.close()  # no reads of vLLM's pages after this: they may be freed next
        self.saved_tokens += stored
        log.info("kvstore: request %s saved %d tokens (group %d) in %.1f ms (copy %.1f ms, "
                 "queued %.1f ms); %d prompt tokens cached", spec.req_id, spec.keys.num_tokens,
                 spec.group,
                 (time.perf_counter() - began) * 1e3, copying[0] * 1e3, (began - queued) * 1e3,
                 stored)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before this step's forward can write into a preempted request's freed pages: wait
        for its pending saves, which read them."""
        if self._saver is None or not isinstance(kv_connector_metadata,
                                                  KVStoreConnectorMetadata):
            return
        if kv_connector_metadata.preempted:
            self._saver.wait(kv_connector_metadata.preempted)

    def get_finished(self, finished_req_ids: set[str],
                     ) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests whose saves are done: vLLM may free their blocks now."""
        if not self._async_save:
            return None, None
        self._finishing |= finished_req_ids & self._save_reqs
        saver = self._saver  # None: never started (no cache) or shut down: nothing pending
        done = {r for r in self._finishing if saver is None or not saver.pending(r)}
        self._finishing -= done
        self._save_reqs -= done
        return done or None, None

    @property
    def dropped_saves(self) -> int:
        """Saves not queued (the queue was full)."""
        return self._drops.total

    def _dropped(self, req_id: str) -> None:
        """A save the full queue turned away: counted, logged once, then summarised."""
        if self._drops.count():
            covered, _ = self._drops.logged()
            log.warning("kvstore: save queue full (%d): %d save(s) dropped since the last such "
                        "line (%d in all; latest: request %s); a dropped save is a future miss",
                        self._cfg.save_queue, covered, self.dropped_saves, req_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._settle_layerwise()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._hinter is not None:  # hints end by their client's deadline
            self._hinter.shutdown(wait=True)
            self._hinter = None
        self._settle_layerwise()
        if self._layerwise is not None:
            self._layerwise.shutdown(wait=True)
            self._layerwise = None
        if self._loader is not None:  # loads end by their deadlines: wait for them
            self._loader.shutdown(wait=True, cancel_futures=True)
            self._loader = None
        if self._saver is not None and not self._saver.close(_SHUTDOWN_SAVE_S):
            log.warning("kvstore: saves still running at shutdown were abandoned")
        self._saver = None
        with self._clients_lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()


__all__ = ["ConnectorConfig", "KVGroup", "KVStoreConnector", "KVStoreConnectorMetadata",
           "LoadSpec", "SaveSpec", "groups_for_vllm", "layout_for_vllm"]
