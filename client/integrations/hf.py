"""Reuse cached prefixes in Hugging Face transformers.

`CachedPrefill.prefill(input_ids)` looks the prompt up in kvstore, fetches the longest cached
prefix into a `DynamicCache`, runs the model over the suffix only, and publishes the prompt's new
full blocks. The last-token logits equal those of a full prefill: the cached K/V are the exact
bytes an earlier forward pass produced for the same tokens under the same layout and weights.
At least one token is always computed (the logits come from it).

With `prefill_tokens_per_s` (a number, or `"online"`: fitted from this engine's own full
recomputes), `prefill` first asks the client's load-or-recompute planner how much of the cached
prefix is worth loading, loads only that and computes the rest: a slow tier or a short prompt
never costs more than recomputing.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import logging
import math
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from kvstore.client.aio import prefault_paused
from kvstore.client.backoff import LogThrottle
from kvstore.client.integrations.hf_layers import (
    ATTENTION_LAYER_KINDS,
    MLP_LAYER_KINDS,
    LayerMap,
    LayerShape,
    cache_elements,
    carve,
    copy_from_block,
    copy_to_block,
    kv_shapes,
    layer_map,
    layer_shapes,
    layout_for_model,
    text_config,
    unsupported_reason,
)
from kvstore.client.integrations.paged import adjacent_runs
from kvstore.client.sync import KVClient
from kvstore.engine_blocks import spans_for, vllm_block_hashes
from kvstore.errors import InvalidArgumentError
from kvstore.layout import KVLayout
from kvstore.planner import Plan, PrefillModel

log = logging.getLogger("kvstore.hf")

# A load path broken for good (a device fault) fails every request: the first failure is a
# warning, later ones a summary at most this often.
LOAD_FAILURE_LOG_S = 60.0

__all__ = [  # with what hf_layers holds (a model's cache against blocks), importable from here
    "ATTENTION_LAYER_KINDS", "CUDA_LOAD", "MLP_LAYER_KINDS", "CachedPrefill", "KVBuffers",
    "LayerShape", "Loading", "PrefillResult", "block_runs", "cache_mismatch", "cache_to_kv",
    "describe_for_events", "fetch_cache", "kv_shapes", "kv_to_cache", "layer_shapes",
    "layout_for_model", "own_windows", "publish_cache", "roomy_cache", "run_model",
    "start_fetch_cache", "text_config", "unsupported_reason", "with_own_windows", "with_readers",
]


def run_model(model: Any, input_ids: torch.Tensor, cache: Any = None, *,
              last_logits_only: bool = False, **kwargs: Any) -> tuple[Any, Any]:
    """`model(input_ids, **kwargs)` over `cache` (None: a new one), with `use_cache`: (its
    output, the cache it returns). transformers takes and returns the cache as `cache` since
    5.x and as `past_key_values` before; the old name warns now and goes in 5.40.
    `last_logits_only`: the logits of the last token only (`logits_to_keep=1`, as
    transformers' own `generate` prefills), where the model takes it: the others would cost
    a `[tokens, vocab]` product and tensor (4 GiB for 16k tokens of a 128k vocabulary)."""
    forward = _forward_arguments(model)
    if cache is not None:
        kwargs["cache" if "cache" in forward else "past_key_values"] = cache
    if last_logits_only and "logits_to_keep" in forward:
        kwargs["logits_to_keep"] = 1
    out = model(input_ids=input_ids, use_cache=True, **kwargs)
    if "cache" in out:  # read by its old name, the cache warns
        return out, out["cache"]
    return out, out.past_key_values


_FORWARD_ARGUMENTS: dict[type, frozenset[str]] = {}  # by model class: its forward's arguments


def _forward_arguments(model: Any) -> frozenset[str]:
    kind = type(model)
    if kind not in _FORWARD_ARGUMENTS:
        _FORWARD_ARGUMENTS[kind] = frozenset(inspect.signature(kind.forward).parameters)
    return _FORWARD_ARGUMENTS[kind]


def kv_to_cache(kv: torch.Tensor) -> Any:
    """`[layers, 2, n, heads, head_dim]` -> a `DynamicCache` (batch 1, `[1, heads, n, dim]`)."""
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=[
        (kv[i, 0].transpose(0, 1).unsqueeze(0).contiguous(),
         kv[i, 1].transpose(0, 1).unsqueeze(0).contiguous()) for i in range(kv.shape[0])])


def _storage_uses(t: torch.Tensor) -> int | None:
    """How many tensors share `t`'s memory (its storage's use count), None where this torch
    build does not say."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else int(count(t.untyped_storage()._cdata))


class KVBuffers:
    """K/V memory for caches loaded from kvstore, allocated and touched once, up front, as an
    engine reserves its KV cache when it starts (vLLM allocates its pages at start-up).

    A prefix loaded into fresh tensors pays the kernel's first-touch page faults inside the
    TTFT: on this repository's VM ~0.3 s per 512 MiB, about four times the copy itself
    (`python -m benchmarks.copy_costs`). A `KVBuffers` pays them here, once. Its memory is
    handed out again only when nothing references it any more (its storage's use count is
    back to its own), so a cache the caller still holds, or any view of one, is never
    overwritten: while it is taken, a load allocates fresh tensors as before."""

    def __init__(self, layout: KVLayout, tokens: int, device: str | torch.device = "cpu",
                 shapes: tuple[LayerShape, ...] | None = None) -> None:
        """`shapes`: each layer's keys and values, where they are not the layout's slot (an
        MLA latent, layers of different shapes: `layer_shapes(config)`)."""
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
            raise InvalidArgumentError(f"KVBuffers needs a positive number of tokens, got "
                                       f"{tokens!r}")
        self.shapes = layer_map(layout, shapes).shapes  # validated
        self.layout, self.tokens, self.device = layout, tokens, torch.device(device)
        self._memory = torch.zeros(cache_elements(self.shapes, tokens),  # zeros: touched now
                                   dtype=layout.torch_dtype, device=self.device)
        self._idle = _storage_uses(self._memory)
        self._lock = threading.Lock()  # two threads never both find it idle

    @property
    def nbytes(self) -> int:
        return self._memory.numel() * self._memory.element_size()

    def take(self, tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """Each layer's `[1, heads, self.tokens, dims]` keys and values (`LayerShape`), if
        the buffers hold `tokens` and nothing uses them; else None."""
        with self._lock:  # the views made here are what makes it busy for the next caller
            if tokens > self.tokens or self._idle is None \
                    or _storage_uses(self._memory) != self._idle:
                return None
            return carve(self._memory, self.shapes, self.tokens)


def fetch_cache(client: KVClient, tokens: torch.Tensor,
                max_blocks: int | None = None, room: int = 1,
                buffers: KVBuffers | None = None,
                device: str | torch.device = "cpu",
                shapes: tuple[LayerShape, ...] | None = None) -> tuple[int, Any]:
    """Fetch the cached prefix of `tokens` straight into a `DynamicCache`'s own
    `[1, heads, n, head_dim]` tensors: one copy out of the daemon's memory, no intermediate
    `[layers, 2, n, heads, head_dim]` tensor to allocate, fill and transpose again, and none
    after: each layer's tensors have room for `room` more tokens past `tokens` (the prompt's
    last token, and any decoded after it), which the forward writes in place
    (`roomy_cache`) where a plain `DynamicCache` would concatenate, copying the whole prefix
    once when the cache is built and again at every forward. With `buffers` (idle and large
    enough), the tensors are theirs: memory already touched (`KVBuffers`). On a CUDA
    `device` each block crosses to the device in one copy and is transposed there.
    `shapes`: each layer's keys and values where they are not the layout's slot (an MLA
    latent, layers of different shapes: `layer_shapes(config)`).

    Returns (cached tokens, cache), or (0, None) on a miss."""
    layout = client.layout
    bt = layout.block_tokens
    blocks = len(tokens) // bt if max_blocks is None else min(len(tokens) // bt, max_blocks)
    if blocks <= 0:
        return 0, None
    lmap = layer_map(layout, shapes)
    keys, values = _cache_tensors(layout, max(blocks * bt, len(tokens) + room), buffers,
                                  device, lmap.shapes)
    on = keys[0].device
    inference = torch.is_inference_mode_enabled()  # the worker thread must match the caller

    def consume(indices: list[int], views: list[torch.Tensor], stop: threading.Event) -> int:
        with torch.inference_mode(inference), _copies_done_on_return(on):
            queued = _kernel_scatter(keys, values, indices, views, stop, lmap.uniform)
            if queued is not None:
                return queued
            for done, (i, view) in enumerate(zip(indices, views, strict=True)):
                if stop.is_set():  # [layers, 2, bt, heads, dim] each
                    return done  # the blocks copied in full: the prefix kept
                view = _to(view, on)  # a CUDA cache: the whole block crosses in one copy
                for layer in range(len(keys)):
                    _copy_in(keys, values, layer, slice(i * bt, (i + 1) * bt), view, lmap)
        return len(indices)

    end = client.fetch_with(tokens, consume, max_blocks=blocks)
    if end <= 0:
        return 0, None
    return end, roomy_cache(keys, values, end)


class Gate(threading.Event):
    """Set once a layer's loaded K/V are in place, or queued on a CUDA stream: then `after`
    is the CUDA event the forward's stream must wait for before it reads them (`pass_gate`)."""

    def __init__(self) -> None:
        super().__init__()
        self.after: Any = None  # a torch.cuda.Event, recorded after the layer's copy


def pass_gate(gate: Gate | threading.Event, device: torch.device) -> None:
    """Wait for a layer's K/V: the thread until the copy is queued or done, and, for a copy
    queued on a side stream, the forward's stream until it is done (on the device, no sync)."""
    gate.wait()
    after = getattr(gate, "after", None)
    if after is not None:
        torch.cuda.current_stream(device).wait_event(after)


class Loading:
    """A fetch copying a cached prefix into a cache's tensors in the background, layer by
    layer (`start_fetch_cache`): `ready[l]` is set once layer l's K/V are in place (or the
    fetch is over, whatever it brought), `done` once the fetch returned; `end` is then the
    tokens it brought intact, and `error` what it raised."""

    def __init__(self, layers: int) -> None:
        self.ready = [Gate() for _ in range(layers)]
        self.done = threading.Event()
        self.end = 0
        self.error: BaseException | None = None

    def finish(self) -> int:
        """Wait for the fetch; the tokens it brought intact (0 if it failed)."""
        self.done.wait()
        return self.end if self.error is None else 0


def start_fetch_cache(client: KVClient, tokens: torch.Tensor, blocks: int, room: int = 1,
                      buffers: KVBuffers | None = None, device: str | torch.device = "cpu",
                      windows: list[int | None] | None = None,
                      shapes: tuple[LayerShape, ...] | None = None) -> tuple[Any, Loading]:
    """`fetch_cache`'s copy, started in the background for the `blocks` blocks a lookup
    found, layer by layer: the returned cache's layer l waits (in its first `update`, i.e.
    in the forward, at layer l's attention) only for layer l's K/V, so the forward of the
    first layers runs while the later ones are still copied. The caller must check
    `Loading.finish() == blocks * block_tokens` after its forward: a fetch that brought less
    (a block evicted since the lookup, a deadline) leaves layers partly stale, and that
    forward must be thrown away. `windows` (`own_windows`): a layer with a window reads only
    the blocks holding the prefix's last `window - 1` tokens, all the suffix attends to, and
    holds them as transformers' own sliding-window layer does (`_LoadedWindow`). `shapes`:
    as for `fetch_cache`."""
    layout = client.layout
    bt = layout.block_tokens
    lmap = layer_map(layout, shapes)
    keys, values = _cache_tensors(layout, max(blocks * bt, len(tokens) + room), buffers,
                                  device, lmap.shapes)
    on = keys[0].device
    layers = len(keys)  # the cache's (a layer may span several of the layout's: `LayerMap`)
    loading = Loading(layers)
    windows = windows if windows and len(windows) == layers else None
    first = [max(0, blocks * bt - (w - 1)) // bt if w else 0  # each layer's first block
             for w in windows or [None] * layers]
    inference = torch.is_inference_mode_enabled()

    def consume(indices: list[int], views: list[torch.Tensor], stop: threading.Event) -> int:
        # Layer by layer over the blocks of this call: when it covers the whole prefix (a
        # host hit is one call), each layer is released as soon as it is complete.
        whole = list(indices) == list(range(blocks))
        with torch.inference_mode(inference), _copies_done_on_return(on):
            # Grouped: a large load from host memory, bound by the bus. One from the daemon's
            # gpu slab is a device copy of a few ms (3 ms for 4 GiB), measured in one launch.
            if whole and not any(v.is_cuda for v in views) and _grouped_load(
                    sum(v.nbytes for v in views)):
                grouped = _kernel_scatter_grouped(keys, values, indices, views, stop,
                                                  lmap.uniform, loading.ready, CUDA_LOAD_GROUPS)
                if grouped is not None:
                    return grouped
            # The copy kernel moves every layer of a run of blocks in one launch: the layers
            # are released all at once, once queued (the forward's kernels wait for it).
            queued = _kernel_scatter(keys, values, indices, views, stop, lmap.uniform)
            if queued is not None:
                if whole and queued == len(indices):
                    release(loading.ready, on)
                return queued  # stopped between runs: `run` releases the layers
            for layer in range(layers):
                slots = lmap.slots(layer)
                for i, view in zip(indices, views, strict=True):  # [layers, 2, bt, heads, dim]
                    if stop.is_set():
                        return 0  # stopped between layers: no block is whole in all of them
                    if i < first[layer]:
                        continue  # before the layer's window
                    # A CUDA cache: this layer of the block crosses in one copy (its
                    # `[slots, 2, bt, heads, dim]` is contiguous in the block).
                    _copy_in(keys, values, layer, slice(i * bt, (i + 1) * bt),
                             _to(view[slots], on), lmap, first_slot=slots.start)
                if whole:
                    release(loading.ready[layer : layer + 1], on)
        return len(indices)

    def run() -> None:
        try:
            loading.end = client.fetch_with(tokens, consume, max_blocks=blocks)
        except BaseException as e:  # handed to the caller through `finish`
            loading.error = e
        finally:
            for event in loading.ready:  # whatever came: the forward must not wait forever
                event.set()
            loading.done.set()

    threading.Thread(target=run, name="kvstore-load", daemon=True).start()
    return roomy_cache(keys, values, blocks * bt, loading.ready, windows), loading


def release(gates: Sequence[Gate], device: torch.device) -> None:
    """Open `gates` for copies just queued on this thread's stream: on a GPU each carries an
    event recorded after them (`Gate.after`), which the forward's stream waits for, whatever
    stream that is (`_forward_stream`'s, a caller's own)."""
    after = None
    if device.type == "cuda":
        after = torch.cuda.Event()  # type: ignore[no-untyped-call]
        after.record(torch.cuda.current_stream(device))
    for gate in gates:
        gate.after = after
        gate.set()


def _copy_in(keys: list[torch.Tensor], values: list[torch.Tensor], layer: int, span: slice,
             view: torch.Tensor, lmap: LayerMap, first_slot: int = 0) -> None:
    """Cache layer `layer` of one stored block (`view`: `[layers, 2, bt, heads, dim]`, the
    layout's layers from `first_slot` on) into the cache's `[1, heads, tokens, dims]` K and V
    at `span` (where the block holds it: `LayerMap`)."""
    copy_from_block(view, lmap, layer, keys[layer], values[layer], span, first_slot)


def _to(view: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`view` (daemon memory) on `device`: itself on the CPU. To a GPU it crosses whole, in
    one copy, and is transposed there: one transposing copy per layer across the bus would
    be two small copies each. From a pinned arena (`KVClient.prepare(pin=True)`) the copy is
    queued only; `_copies_done_on_return` waits for it before the daemon may reuse the
    block's memory."""
    return view if view.device == device else view.to(device, non_blocking=True)


CUDA_LOAD: Literal["kernel", "torch"] = "kernel"
"""How a load into a CUDA cache copies out of a pinned arena: `kernel`, kvstore's copy kernel
reads each block across the bus and writes all its layers into K and V in one launch; `torch`,
each block (or layer of one) crosses by DMA and is transposed on the device, two launches per
layer and block. benchmarks/gpu_ttft.py measures both (docs/GPU.md). From memory that is not
pinned both fall back to `torch`."""


def _kernel_applies(keys: list[torch.Tensor], views: list[torch.Tensor], uniform: bool) -> bool:
    """Whether the copy kernel can load `views` into this cache: a CUDA cache whose layers are
    the layout's slot (`LayerMap.uniform`), memory pinned or on the cache's device, and
    `CUDA_LOAD` says kernel."""
    return bool(keys[0].is_cuda and CUDA_LOAD == "kernel" and uniform and views and all(
        v.is_pinned() or v.device == keys[0].device for v in views))


def _kernel_scatter(keys: list[torch.Tensor], values: list[torch.Tensor], indices: list[int],
                    views: list[torch.Tensor], stop: threading.Event,
                    uniform: bool) -> int | None:
    """Blocks `indices` of a CUDA cache from `views` (pinned daemon memory, or the daemon's
    gpu slab on the cache's device) by the copy kernel, queued on the current stream: one
    launch per run of blocks lying back to back in the arena or the slab (`block_runs`), all
    layers at once. Returns the leading blocks queued (fewer when `stop` is set between
    runs), or None where it does not apply: a CPU cache, memory neither pinned nor on the
    cache's device, layers that are not the layout's slot (an MLA latent split in two,
    layers of different shapes: `LayerMap.uniform`), or `CUDA_LOAD` says torch."""
    if not _kernel_applies(keys, views, uniform):
        return None
    from kvstore import kernels
    from kvstore.kernels import EngineKV

    engine = EngineKV.transformers(keys, values)
    queued = 0
    for staging, blocks in block_runs(indices, views):
        if stop.is_set():
            return queued
        kernels.scatter(staging, engine, [[b] for b in blocks])  # an HF page is one block
        queued += len(blocks)
    return queued


CUDA_LOAD_GROUPS = 8
"""Into how many groups of layers a load into a CUDA cache by the copy kernel is split. 1: one
launch per run of blocks, all layers, on the loading thread's stream; the forward's kernels
wait for all of it. More: each group is launched on a side stream and the forward's stream
waits, at each layer's attention, only for that layer's group, so the copy of later layers
crosses the bus while the first layers compute (`_kernel_scatter_grouped`), with the forward
on a high-priority stream (`CUDA_LOAD_PRIORITY`) and each group's grid capped
(`CUDA_LOAD_CTAS`). Only loads of `CUDA_LOAD_GROUPED_BYTES` or more are split.
benchmarks/gpu_ttft.py measures 4 and 8 groups against 1; on an H100, 8 groups took a 32k
prefix's warm TTFT from 0.150 to 0.104 s (docs/GPU.md)."""

CUDA_LOAD_GROUPED_BYTES = 512 << 20
"""The smallest load split into groups: below it the forward's own launch time dominates and
one launch was as fast or faster (an H100, 256 MiB: 0.045 s in one launch, 0.054 in 8 groups;
1 GiB: 0.063 against 0.046)."""


def _grouped_load(nbytes: int) -> bool:
    """Whether a load of `nbytes` goes in groups of layers beside the forward (and that
    forward on the high-priority stream: `_forward_stream`)."""
    return CUDA_LOAD_GROUPS > 1 and nbytes >= CUDA_LOAD_GROUPED_BYTES


def _kernel_scatter_grouped(keys: list[torch.Tensor], values: list[torch.Tensor],
                            indices: list[int], views: list[torch.Tensor],
                            stop: threading.Event, uniform: bool, gates: list[Gate],
                            groups: int) -> int | None:
    """`_kernel_scatter` in `groups` groups of consecutive layers, each queued on a side
    stream and followed by a CUDA event its layers' gates carry (`Gate.after`), so the
    forward's stream waits for each group alone. Waits for the copies before returning (the
    fetch's lease then ends). Returns the blocks copied, 0 when stopped between groups (no
    block is whole in every layer), None where `_kernel_scatter` does not apply."""
    if not _kernel_applies(keys, views, uniform):
        return None
    from kvstore import kernels
    from kvstore.kernels import EngineKV

    device = keys[0].device
    side = _side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))  # the cache tensors exist first
    runs = block_runs(indices, views)  # [n, layers, 2, bt, heads, dim] each
    layers = len(keys)
    bounds = [layers * g // groups for g in range(groups + 1)]
    try:
        for a, b in itertools.pairwise(bounds):
            if a == b:
                continue
            if stop.is_set():
                return 0
            engine = EngineKV.transformers(keys[a:b], values[a:b])
            for staging, blocks in runs:  # a slot's layers a..b are contiguous in it
                kernels.scatter(staging[:, a:b], engine, [[x] for x in blocks], stream=side,
                                max_ctas=CUDA_LOAD_CTAS or None)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(side)
            for layer in range(a, b):
                gates[layer].after = done
                gates[layer].set()
    finally:
        side.synchronize()
    return len(indices)


@functools.cache
def _side_stream(device: torch.device) -> Any:
    """One side stream per device for grouped loads (a load runs at a time per engine)."""
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]


CUDA_LOAD_CTAS = 32
"""With grouped loads, the most CTAs each group's copy kernel runs on (its grid loops over the
(block, plane) units: `kernels.plan.launch_shape`); 0: no cap, a CTA per unit. A load from
host memory is bound by the bus, which a few SMs' loads keep full; uncapped, the copy's
thousands of CTAs hold every SM, and a kernel of the forward beside it (flash attention at
0.7 ms alone) took 33 ms on an H100 (docs/GPU.md). benchmarks/gpu_ttft.py sweeps it
(`--ctas-sweep`)."""


CUDA_LOAD_PRIORITY = True
"""With grouped loads (`CUDA_LOAD_GROUPS` > 1), the forward beside them runs on a stream of the
highest priority (`_forward_stream`): the GPU's block scheduler then starts the forward's
kernels ahead of the copy's CTAs still waiting for an SM. Without it the copy kernel's grid
(a CTA per block and plane, more than the SMs hold) keeps every SM busy and each of the
forward's kernels waits behind it. benchmarks/gpu_ttft.py measures both (`warm_groups4_s`
against `warm_groups4_flat_s`)."""


@contextlib.contextmanager
def _forward_stream(device: str | torch.device, grouped: bool) -> Iterator[None]:
    """Around the forward of a prefill whose load runs beside it: on a GPU with a load large
    enough to be grouped (`grouped`: `_grouped_load`) and `CUDA_LOAD_PRIORITY`, on a
    high-priority stream ordered after the caller's, which then waits for it; elsewhere, the
    caller's stream as it is. (Whichever path the load takes, its gates carry events that
    order the forward after its copies: `release`.)"""
    device = torch.device(device)
    if device.type != "cuda" or not grouped or not CUDA_LOAD_PRIORITY:
        yield
        return
    caller = torch.cuda.current_stream(device)
    fast = _priority_stream(device)
    fast.wait_stream(caller)  # the cache's tensors, made on the caller's stream, exist first
    try:
        with torch.cuda.stream(fast):
            yield
    finally:
        caller.wait_stream(fast)  # the caller's next work sees the forward's outputs


@functools.cache
def _priority_stream(device: torch.device) -> Any:
    """One stream of the highest priority per device, for forwards beside grouped loads."""
    # A number below CUDA's range maps to its highest priority (torch.cuda.Stream).
    return torch.cuda.Stream(device, priority=-100)  # type: ignore[no-untyped-call]


def block_runs(indices: list[int], views: list[torch.Tensor],
               ) -> list[tuple[torch.Tensor, list[int]]]:
    """`views` (blocks `[layers, 2, bt, heads, dim]` of one storage, the daemon's arena) grouped
    into runs lying back to back in memory, each as one `[n, layers, 2, bt, heads, dim]`
    tensor over the same bytes, with the prompt blocks it holds (`paged.adjacent_runs`). A
    prompt published at once usually lies in one run."""
    return [(run, indices[span]) for run, span in adjacent_runs(views)]


@contextlib.contextmanager
def _copies_done_on_return(device: torch.device) -> Iterator[None]:
    """Around a `fetch_with` copy into a cache on `device`: on a GPU, wait for the queued
    copies before returning (the fetch's lease then ends and the daemon may reuse the
    memory they read)."""
    try:
        yield
    finally:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()


def _cache_tensors(layout: KVLayout, capacity: int, buffers: KVBuffers | None,
                   device: str | torch.device, shapes: tuple[LayerShape, ...] | None = None,
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each layer's `[1, heads, capacity, dims]` K and V on `device` (`LayerShape`; None:
    the layout's slot): the reserved buffers when they are there, idle and large enough, else
    new ones (untouched pages cost nothing until filled)."""
    shapes = layer_map(layout, shapes).shapes
    device = torch.device(device)
    taken = None if buffers is None or buffers.device != device \
        or buffers.shapes != shapes else buffers.take(capacity)
    if taken is not None:
        return taken
    return carve(torch.empty(cache_elements(shapes, capacity), dtype=layout.torch_dtype,
                             device=device), shapes, capacity)


def roomy_cache(keys: list[torch.Tensor], values: list[torch.Tensor], length: int,
                ready: Sequence[threading.Event] | None = None,
                windows: list[int | None] | None = None) -> Any:
    """A `DynamicCache` holding the first `length` tokens of each layer's `[1, heads, capacity,
    head_dim]` `keys` and `values` without copying them, whose forwards write the tokens they
    add into the room past `length` (`_RoomyLayer`). With `ready`, layer l's first `update`
    waits for `ready[l]` (its K/V still being copied in: `start_fetch_cache`). A layer with a
    window (`windows[l]`) holds its last `window - 1` tokens instead (`_LoadedWindow`)."""
    from transformers import DynamicCache

    cache = DynamicCache()  # no layers yet: the forward would add plain DynamicLayers
    gates = ready if ready is not None else [None] * len(keys)
    for k, v, g, w in zip(keys, values, gates, windows or [None] * len(keys), strict=True):
        cache.layers.append(_loaded_window()(k, v, length, w, g) if w
                            else _roomy_layer()(k, v, length, g))
    return cache


@functools.cache
def _loaded_window() -> type:
    """`_LoadedWindow`, made on first use (transformers is imported only by its users)."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    class _LoadedWindow(DynamicSlidingWindowLayer):  # type: ignore[no-untyped-call]
        """transformers' sliding-window layer over a loaded prefix of `length` tokens: it holds
        their last `window - 1` (views of `keys` and `values`, `[1, heads, capacity, dim]`
        buffers whose earlier blocks a load may leave unread), and also writes the tokens each
        forward adds into the buffers, so that a prompt's new blocks can be published
        (`stored`)."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int,
                     window: int, ready: threading.Event | None = None) -> None:
            super().__init__(sliding_window=window)
            self._ready = ready  # set once the loaded K/V are in place (None: they are)
            self._buffers: tuple[torch.Tensor, torch.Tensor] | None = (keys, values)
            start = max(0, length - (window - 1))
            self.dtype, self.device = keys.dtype, keys.device
            self.keys, self.values = keys[:, :, start:length], values[:, :, start:length]
            self.cumulative_length = length
            self.is_initialized = True
            sw = getattr(self, "_sliding_window_tensor", None)  # set by lazy initialization
            if isinstance(sw, torch.Tensor):
                self._sliding_window_tensor = sw.to(self.device)

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if self._ready is not None:  # the loaded prefix is still being copied in
                pass_gate(self._ready, self.device)
                self._ready = None
            start = self.cumulative_length
            end = start + key_states.shape[-2]
            if self._buffers is not None and key_states.shape[0] == 1 \
                    and end <= self._buffers[0].shape[-2]:
                self._buffers[0][:, :, start:end].copy_(key_states)
                self._buffers[1][:, :, start:end].copy_(value_states)
            else:
                self._buffers = None  # past its room: nothing more to publish from
            return super().update(key_states, value_states, *args, **kwargs)

        def stored(self) -> tuple[torch.Tensor, torch.Tensor] | None:
            """The buffers up to the last token seen (before the window: as loaded, or not),
            None once they were outgrown."""
            if self._buffers is None:
                return None
            n = self.cumulative_length
            return self._buffers[0][:, :, :n], self._buffers[1][:, :, :n]

    return _LoadedWindow


@functools.cache
def _roomy_layer() -> type:
    """`_RoomyLayer`, made on first use (transformers is imported only by its users)."""
    from transformers.cache_utils import DynamicLayer

    class _RoomyLayer(DynamicLayer):
        """A `DynamicLayer` whose keys and values are the first tokens of larger buffers:
        `update` copies the new tokens into the room after them (a plain `DynamicLayer`
        concatenates: a copy of everything cached, per layer, per forward), and doubles the
        buffers when they are full. A layer whose tensors something else replaced (beam
        reordering, offloading) is a plain `DynamicLayer` from then on; a crop keeps its
        buffers (a shorter view of them)."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int,
                     ready: threading.Event | None = None) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self._ready = ready  # set once the loaded K/V are in place (None: they are)
            self._buffers: tuple[torch.Tensor, torch.Tensor] | None = (keys, values)
            self.dtype, self.device = keys.dtype, keys.device
            self.keys, self.values = keys[:, :, :length], values[:, :, :length]
            self.is_initialized = True

        def _cached(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                   ] | None:
            """(keys buffer, values buffer, keys, values) while `keys`/`values` still view the
            buffers' start (their length: the tokens cached), else None, for good."""
            k, v = self.keys, self.values
            if self._buffers is None or k is None or v is None:
                return None
            kb, vb = self._buffers
            if (k.data_ptr(), v.data_ptr()) != (kb.data_ptr(), vb.data_ptr()) \
                    or k.stride() != kb.stride() or v.stride() != vb.stride():
                self._buffers = None
                return None
            return kb, vb, k, v

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if self._ready is not None:  # the loaded prefix is still being copied in
                pass_gate(self._ready, self.device)
                self._ready = None
            cached = self._cached()
            if cached is None or key_states.shape[0] != 1:
                return super().update(key_states, value_states, *args, **kwargs)
            kb, vb, k, v = cached
            length = k.shape[-2]
            end = length + key_states.shape[-2]
            if end > kb.shape[-2]:  # full: double, keeping what is cached
                grow = (*kb.shape[:2], max(end, 2 * kb.shape[-2]), kb.shape[-1])
                kb, vb = kb.new_empty(grow), vb.new_empty(grow)
                kb[:, :, :length].copy_(k)
                vb[:, :, :length].copy_(v)
                self._buffers = (kb, vb)
            kb[:, :, length:end].copy_(key_states)
            vb[:, :, length:end].copy_(value_states)
            self.keys, self.values = kb[:, :, :end], vb[:, :, :end]
            return kb[:, :, :end], vb[:, :, :end]

    return _RoomyLayer


def cache_to_kv(cache: Any, num_tokens: int) -> torch.Tensor:
    """A batch-1 `DynamicCache` -> `[layers, 2, num_tokens, heads, head_dim]` (a copy)."""
    layers = [torch.stack((layer.keys[0, :, :num_tokens], layer.values[0, :, :num_tokens]))
              for layer in cache.layers]
    return torch.stack(layers).transpose(2, 3)


def own_windows(model: Any) -> list[int | None] | None:
    """Per layer, the tokens the model's own cache keeps of a sliding-window or chunked layer
    (transformers' `DynamicSlidingWindowLayer`), None for a layer that keeps every token;
    None where this transformers does not say (an older one)."""
    from transformers import DynamicCache

    try:
        from transformers.cache_utils import DynamicSlidingWindowLayer

        layers = DynamicCache(config=model.config).layers
    except Exception:  # an older transformers, a config it cannot build a cache from
        return None
    windows = [layer.sliding_window if type(layer) is DynamicSlidingWindowLayer
               and isinstance(layer.sliding_window, int) and layer.sliding_window > 1 else None
               for layer in layers]  # (a window of 1 keeps nothing: kept whole, correct)
    return windows if any(windows) else None


def with_own_windows(cache: Any, windows: list[int | None] | None) -> Any:
    """`cache` with each layer that has a window (`own_windows`) replaced by transformers' own
    sliding-window layer over its last tokens, as the model's own cache would hold them:
    decoding then attends to, and keeps, the window only. Other layers stay as they are."""
    if not windows:
        return cache
    from transformers.cache_utils import DynamicSlidingWindowLayer

    for i, (mine, window) in enumerate(zip(cache.layers, windows, strict=False)):
        if not window or getattr(mine, "keys", None) is None:
            continue
        theirs = DynamicSlidingWindowLayer(sliding_window=window)
        n, keep = mine.get_seq_length(), window - 1  # the tokens seen; the window keeps these
        theirs.update(mine.keys[:, :, -keep:], mine.values[:, :, -keep:])  # a copy: small
        theirs.cumulative_length = n  # as if it had seen them all
        cache.layers[i] = theirs
    return cache


def with_readers(cache: Any, readers: int) -> Any:
    """`cache` followed by `readers` layers that hold nothing (transformers' `DummyLayer`), as
    the model's own cache has for its last layers when they read earlier layers' K/V (a
    cache that has them already, or a transformers without them, is left as it is)."""
    try:
        from transformers.cache_utils import DummyLayer
    except ImportError:  # an older transformers: its caches have no such layers
        return cache
    if readers and all(getattr(layer, "keys", None) is not None for layer in cache.layers):
        cache.layers.extend(DummyLayer() for _ in range(readers))  # type: ignore[no-untyped-call]
    return cache


def _stored(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache layer's keys and values from the prompt's first token on: a loaded window's
    buffers (`_LoadedWindow.stored`), else its own."""
    stored = getattr(layer, "stored", None)
    got = stored() if callable(stored) else None
    return got if got is not None else (layer.keys, layer.values)


def cache_mismatch(cache: Any, layout: KVLayout, tokens: int,
                   shapes: tuple[LayerShape, ...] | None = None) -> str | None:
    """How a batch-1 `DynamicCache` differs from `layout` for its first `tokens` tokens, or
    None: each cached layer's K and V `[1, heads, >= tokens, dims]` (`shapes`, default the
    layout's slot) of the layout's dtype; any layers after them cache nothing (a model's
    layers that read earlier layers' K/V)."""
    shapes = layer_map(layout, shapes).shapes
    layers = getattr(cache, "layers", None)
    if layers is None or len(layers) < len(shapes):
        return f"the cache has {len(layers) if layers is not None else 'no'} layers, the " \
               f"layout {len(shapes)}"
    for i, layer in enumerate(layers[len(shapes) :], len(shapes)):
        if getattr(layer, "keys", None) is not None:
            return f"layer {i} caches K/V, past the layout's {len(shapes)} layers"
    for i, (layer, shape) in enumerate(zip(layers, shapes, strict=False)):
        for name, t, dim in zip(("keys", "values"), _stored(layer),
                                (shape.key_dim, shape.value_dim), strict=True):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[0] != 1 \
                    or t.shape[1] != shape.heads or t.shape[2] < tokens or t.shape[3] != dim \
                    or t.dtype != layout.torch_dtype:
                got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else repr(t)
                return f"layer {i}'s {name} are {got}, the layout wants (1, {shape.heads}, " \
                       f">= {tokens}, {dim}) {layout.torch_dtype}"
    return None


def publish_cache(client: KVClient, tokens: torch.Tensor, cache: Any,
                  shapes: tuple[LayerShape, ...] | None = None) -> int:
    """Publish the full blocks of `tokens` straight from a batch-1 `DynamicCache` into the
    daemon's memory (one copy; no `[layers, 2, n, heads, head_dim]` tensor in between).
    `shapes`: its layers' keys and values where they are not the layout's slot (an MLA
    latent, layers of different shapes: `layer_shapes(config)`); a cache unlike them is
    `InvalidArgumentError`. Returns the prompt tokens now cached."""
    layout = client.layout
    bt = layout.block_tokens
    lmap = layer_map(layout, shapes)
    problem = cache_mismatch(cache, layout, len(tokens) // bt * bt, lmap.shapes)
    if problem:
        hint = "" if shapes is not None else "; a model whose layers are not the layout's " \
            "slot (an MLA latent, layers of other shapes) needs shapes=layer_shapes(config)"
        raise InvalidArgumentError(f"the cache is not this layout's: {problem}{hint}")
    inference = torch.is_inference_mode_enabled()
    kv = [_stored(layer) for layer in cache.layers[: len(lmap.shapes)]]
    on = kv[0][0].device

    def produce(indices: list[int], views: list[torch.Tensor], stop: threading.Event) -> int:
        with torch.inference_mode(inference):
            for done, (i, view) in enumerate(zip(indices, views, strict=True)):
                if stop.is_set():  # [layers, 2, bt, heads, dim] each
                    return done  # the blocks written in full: only they are committed
                span = slice(i * bt, (i + 1) * bt)
                if on.type != "cpu":
                    # Laid out on the device, then one copy across for the whole block.
                    staged = torch.empty(view.shape, dtype=view.dtype, device=on)
                    _write_block(staged, kv, span, lmap)
                    view.copy_(staged)
                    continue
                _write_block(view, kv, span, lmap)
        return len(indices)

    return client.publish_with(tokens, produce)


def _write_block(block: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]], span: slice,
                 lmap: LayerMap) -> None:
    """Tokens `span` of each layer's cached keys and values (`[1, heads, tokens, dims]`) into
    `block` (`[layers, kv, bt, heads, dim]`), where it holds them (`LayerMap`)."""
    for layer, (k, v) in enumerate(kv):
        copy_to_block(block, lmap, layer, k, v, span)


def describe_for_events(client: KVClient, tokens: torch.Tensor, engine_block_size: int,
                        hash_algo: str = "sha256") -> int:
    """Describe the full kvstore blocks of `tokens` to a daemon publishing KV events by the
    block hashes vLLM would compute for them at `engine_block_size` (`vllm_block_hashes`), so
    a router built for vLLM finds this engine's blocks too. Hashes nothing when the daemon
    publishes no events (asked once a minute). Returns the blocks described."""
    if not client.kv_events():
        return 0
    ids = [int(t) for t in tokens.tolist()]
    hashes = vllm_block_hashes(ids, engine_block_size, hash_algo)
    spans = spans_for(ids, hashes, engine_block_size, client.layout.block_tokens)
    return client.describe_blocks(ids, spans) if spans else 0


@dataclass
class PrefillResult:
    logits: torch.Tensor  # last-token logits, [vocab]
    cache: Any  # DynamicCache holding the whole prompt, ready for decoding
    cached_tokens: int  # tokens loaded from kvstore
    computed_tokens: int  # tokens that went through the model
    ttft_s: float  # lookup + fetch + forward, up to the first token's logits
    published_tokens: int = 0
    plan: Plan | None = None  # the planner's decision (planner mode with a known speed)


class CachedPrefill:
    """Prefill a batch-1 prompt through kvstore, then decode as usual."""

    def __init__(self, model: Any, client: KVClient, *,
                 prefill_tokens_per_s: float | Literal["online"] | None = None,
                 event_block_size: int = 16, event_hash_algo: str = "sha256",
                 reserve_tokens: int = 0) -> None:
        """`prefill_tokens_per_s`: None (default) loads the whole cached prefix; a number
        (the engine's prefill speed) or `"online"` (fitted from this engine's own full
        recomputes, `prefill_model`; the whole prefix is loaded until one was seen) loads only
        what the planner says is worth loading. `event_block_size`, `event_hash_algo`: the
        block size and `prefix_caching_hash_algo` of the vLLM engines a router indexes, for
        the daemon's KV events (`describe_for_events`; unused when the daemon has none).
        `reserve_tokens`: allocate and touch K/V memory for loaded prefixes of up to this many
        tokens (prompt and decoded tokens) now, instead of inside each warm prefill's TTFT
        (`KVBuffers`; 0, the default, reserves nothing). It holds `reserve_tokens` x the
        layout's bytes per token for the engine's lifetime; one cache at a time uses it."""
        if prefill_tokens_per_s is not None and prefill_tokens_per_s != "online" and not (
                isinstance(prefill_tokens_per_s, int | float)
                and math.isfinite(prefill_tokens_per_s) and prefill_tokens_per_s > 0):
            raise InvalidArgumentError(f"prefill_tokens_per_s must be a positive number, "
                                       f"'online' or None, got {prefill_tokens_per_s!r}")
        self.model = model
        self.client = client
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.event_block_size, self.event_hash_algo = event_block_size, event_hash_algo
        # This engine's prefill time by prompt length, from its forward passes over whole
        # prompts of at least one block (always kept; the planner uses it in "online" mode).
        self.prefill_model = PrefillModel()
        # Loaded K/V go where the model runs: a CUDA model's cache is on its GPU.
        self.device = next(model.parameters()).device
        expected = layout_for_model(model, client.layout.block_tokens, client.layout.model,
                                    client.layout.model_revision)
        if expected != client.layout:
            raise InvalidArgumentError(f"client layout {client.layout} does not match the model's "
                             f"KV cache {expected}")
        # Each cached layer's keys and values (an MLA latent, Gemma 4's head dims per layer);
        # the layers after them read earlier layers' K/V (Gemma 3n, Gemma 4's num_kv_shared_layers).
        config = text_config(model.config)
        self.shapes = layer_shapes(config)
        self.reader_layers = config.num_hidden_layers - len(self.shapes)
        self.buffers = KVBuffers(client.layout, reserve_tokens, self.device, self.shapes) \
            if reserve_tokens else None
        # Map the daemon's arena now, as vLLM's connector does at engine start: its prefault
        # then runs between requests, not inside the first prefill after the first publish.
        # A model on a GPU has it pinned too: its loads are then DMA at the bus rate.
        client.prepare(pin=self.device.type == "cuda")
        self._mismatch_logged = False
        self._failures = LogThrottle(LOAD_FAILURE_LOG_S)  # loads whose copy path raised
        # The cached layers' windows (sliding-window and chunked layers).
        windows = (own_windows(model) or [])[: len(self.shapes)]
        self.windows = windows if any(windows) else None

    @property
    def load_failures(self) -> int:
        """Loads whose copy path raised (each recomputed)."""
        return self._failures.total

    def _load_failed(self, error: BaseException) -> None:
        if not self._failures.count():
            return
        first = self._failures.first
        covered, since = self._failures.logged()
        if first:
            log.warning("kvstore: a load failed (%r); recomputing (further failures are "
                        "counted and summarised at most every %.0f s)", error,
                        LOAD_FAILURE_LOG_S)
        else:
            log.warning("kvstore: %d loads failed in the last %.0f s (%d in all; last: %r); "
                        "recomputed", covered, since, self.load_failures, error)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, publish: bool = True,
                decode_tokens: int = 0) -> PrefillResult:
        """`decode_tokens`: tokens the caller will decode after it; a cache loaded from
        kvstore is allocated with room for them, so decoding appends in place. The arena's
        background prefault waits meanwhile (`prefault_paused`)."""
        with prefault_paused():
            return self._prefill(input_ids, publish, decode_tokens)

    def _prefill(self, input_ids: torch.Tensor, publish: bool,
                 decode_tokens: int) -> PrefillResult:
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise InvalidArgumentError(f"input_ids must be [1, n], got {tuple(input_ids.shape)}")
        tokens = input_ids[0].cpu()  # the keys are hashed on the CPU
        n = tokens.shape[0]
        start = time.perf_counter()
        plan = self.plan(tokens) if n > 1 else None
        limit = None if plan is None else plan.load_blocks  # None: the whole cached prefix
        bt = self.client.layout.block_tokens
        # The plan was made from a lookup already (its blocks to load); else look up now.
        blocks = 0 if n <= 1 else limit if limit is not None \
            else self.client.lookup(tokens[: n - 1]) // bt
        out, cached, cache = None, 0, None
        began = time.perf_counter()
        if blocks:
            # The copy runs beside the forward, layer by layer (`start_fetch_cache`).
            cached = blocks * bt
            cache, loading = start_fetch_cache(self.client, tokens[: n - 1], blocks,
                                               room=1 + decode_tokens, buffers=self.buffers,
                                               device=self.device, windows=self.windows,
                                               shapes=self.shapes)
            grouped = _grouped_load(blocks * self.client.layout.block_bytes)
            with _forward_stream(self.device, grouped):
                out, cache = run_model(self.model, input_ids[:, cached:], cache,
                                       last_logits_only=True)
            got = loading.finish()
            if loading.error is not None:  # not a miss: the load path itself failed
                self._load_failed(loading.error)
            if got != cached:
                # Less came than the lookup found (evicted since, a deadline, the daemon gone):
                # that forward saw stale K/V. Throw it away; load what is there now if part
                # came, else compute it all (the daemon just failed this load: no second wait).
                log.info("kvstore: a load brought %d of the %d tokens its lookup found; %s",
                         got, cached, "loading again" if got else "recomputing")
                out, cache, cached = None, None, 0
                if got:
                    cached, cache = fetch_cache(self.client, tokens[: n - 1], blocks,
                                                room=1 + decode_tokens, buffers=self.buffers,
                                                device=self.device, shapes=self.shapes)
        if out is None:
            if cache is None:
                from transformers import DynamicCache

                # Plain layers, not the model's own (`DynamicCache(config=...)`): a
                # sliding-window layer of those keeps only its window's tokens, and kvstore
                # stores every token's K/V. The masks, built from the config, keep each
                # layer's attention to its window either way.
                cache = DynamicCache()
            began = time.perf_counter()
            out, cache = run_model(self.model, input_ids[:, cached:], cache,
                                   last_logits_only=True)
        logits = out.logits[0, -1].float()
        if logits.is_cuda:  # the first token exists once the device has computed it
            torch.cuda.synchronize(logits.device)
        ttft = time.perf_counter() - start
        if cached == 0 and n >= self.client.layout.block_tokens:
            self.prefill_model.observe(n, time.perf_counter() - began)
        result = PrefillResult(logits, cache, cached, n - cached, ttft,
                               plan=plan)
        full = (n // self.client.layout.block_tokens) * self.client.layout.block_tokens
        if publish and full > cached and not self._unlike_layout(cache, full):
            result.published_tokens = publish_cache(self.client, tokens[:full], cache,
                                                    self.shapes)
            if result.published_tokens:
                describe_for_events(self.client, tokens[:full], self.event_block_size,
                                    self.event_hash_algo)
        # Published: windows will do, and the layers reading others' K/V hold none, as in
        # the model's own cache.
        result.cache = with_readers(with_own_windows(cache, self.windows), self.reader_layers)
        return result

    def _unlike_layout(self, cache: Any, tokens: int) -> bool:
        """Whether the forward's cache differs from the layout (a config that misdescribes its
        model): then nothing is published, and that is logged once. The result stands: its
        logits are the model's own."""
        problem = cache_mismatch(cache, self.client.layout, tokens, self.shapes)
        if problem and not self._mismatch_logged:
            self._mismatch_logged = True
            log.error("kvstore: not publishing this model's prompts: %s", problem)
        return problem is not None

    def end_session(self, input_ids: torch.Tensor, shared_tokens: int = 0) -> int:
        """The conversation whose last prompt was `input_ids` (`[1, n]`, as given to
        `prefill`) has ended: its own blocks, past its first `shared_tokens` (a system prompt
        or documents other conversations use too), are evicted first
        (`KVClient.end_session`). Returns the blocks marked; 0 when the daemon is down."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise InvalidArgumentError(f"input_ids must be [1, n], got {tuple(input_ids.shape)}")
        return self.client.end_session(input_ids[0], shared_tokens)

    def plan(self, tokens: torch.Tensor) -> Plan | None:
        """The planner's decision for a prompt (`[n]` token ids), or None when the planner is
        off or the engine's speed is not known yet (then the whole cached prefix is loaded)."""
        speed = self.speed(int(tokens.shape[0]))
        if speed is None:
            return None
        # The copy into the cache's tensors is the client's copy (`fetch_cache`), which the
        # client measures itself: no separate leg to add.
        return self.client.plan(tokens, speed)

    def speed(self, n: int) -> float | None:
        """Prefill tokens/s the planner assumes for an `n`-token prompt (None: no planner, or
        "online" before this engine has recomputed a prompt)."""
        if self.prefill_tokens_per_s == "online":
            return self.prefill_model.tokens_per_s(n)
        return self.prefill_tokens_per_s

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> tuple[list[int],
                                                                              PrefillResult]:
        """Greedy decoding after a cached prefill; returns the new tokens."""
        first = self.prefill(input_ids, decode_tokens=max_new_tokens)
        cache, logits = first.cache, first.logits
        out: list[int] = []
        for _ in range(max_new_tokens):
            nxt = int(torch.argmax(logits))
            out.append(nxt)
            step, cache = run_model(self.model, torch.tensor([[nxt]], device=self.device),
                                    cache)
            logits = step.logits[0, -1].float()
        return out, first
