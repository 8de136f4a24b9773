"""`hf.block_runs`: the blocks of a fetch grouped into runs lying back to back in the daemon's
arena, one kernel launch each on a GPU. Checked on the CPU through the kernels' torch twin:
the runs scatter exactly what the per-block copies write."""

from __future__ import annotations

import torch

from kvstore import kernels
from kvstore.client.integrations import hf
from kvstore.client.integrations.hf import _copy_in, block_runs
from kvstore.client.integrations.hf_layers import layer_map
from kvstore.kernels import EngineKV
from kvstore.layout import KVLayout

LAYERS, BT, HEADS, DIM = 3, 8, 2, 4
BLOCK = (LAYERS, 2, BT, HEADS, DIM)


def arena_views(slots: list[int]) -> list[torch.Tensor]:
    """Views of blocks at arena slots `slots` of one storage, as the client hands them out."""
    arena = torch.randn(8 * LAYERS * 2 * BT * HEADS * DIM, generator=torch.Generator()
                        .manual_seed(1)).to(torch.bfloat16)
    per = LAYERS * 2 * BT * HEADS * DIM
    return [arena[s * per : (s + 1) * per].view(BLOCK) for s in slots]


def test_adjacent_blocks_form_one_run_and_gaps_or_reversals_split_them():
    views = arena_views([0, 1, 2, 4, 5, 3])
    runs = block_runs([0, 1, 2, 3, 4, 5], views)
    assert [blocks for _, blocks in runs] == [[0, 1, 2], [3, 4], [5]]
    for staging, blocks in runs:
        assert staging.shape == (len(blocks), *BLOCK)
        for k, b in enumerate(blocks):  # the same bytes, not a copy
            assert staging[k].data_ptr() == views[b].data_ptr()
            assert torch.equal(staging[k], views[b])
    assert block_runs([], []) == []


def test_runs_scatter_what_the_per_block_copies_write():
    views = arena_views([2, 3, 4, 0, 6, 7])
    indices = [0, 1, 2, 3, 4, 5]
    shape = (1, HEADS, 6 * BT + 1, DIM)

    def cache() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return ([torch.full(shape, float("nan"), dtype=torch.bfloat16) for _ in range(LAYERS)],
                [torch.full(shape, float("nan"), dtype=torch.bfloat16) for _ in range(LAYERS)])

    keys, values = cache()
    engine = EngineKV.transformers(keys, values)
    for staging, blocks in block_runs(indices, views):
        kernels.scatter(staging, engine, [[b] for b in blocks])
    want_k, want_v = cache()
    for i, view in zip(indices, views, strict=True):
        for layer in range(LAYERS):
            _copy_in(want_k, want_v, layer, slice(i * BT, (i + 1) * BT), view,
                     layer_map(KVLayout("m", LAYERS, HEADS, DIM, block_tokens=BT)))
    for got, want in zip(keys + values, want_k + want_v, strict=True):
        assert torch.equal(got[..., : 6 * BT, :], want[..., : 6 * BT, :])
        assert got[..., 6 * BT :, :].isnan().all()  # past the blocks: untouched


def test_blocks_of_two_memories_lying_back_to_back_are_two_runs():
    """The arena and the gpu slab are separate mappings that may lie back to back in the
    address space: a run must not stride from one into the other's storage."""
    import numpy as np

    per = LAYERS * 2 * BT * HEADS * DIM
    flat = np.zeros(4 * per, dtype=np.float32)
    arena, slab = torch.from_numpy(flat[: 2 * per]), torch.from_numpy(flat[2 * per :])
    views = [arena[per:].view(BLOCK), slab[:per].view(BLOCK), slab[per:].view(BLOCK)]
    assert views[1].data_ptr() == views[0].data_ptr() + views[0].nbytes  # adjacent bytes
    assert [blocks for _, blocks in block_runs([0, 1, 2], views)] == [[0], [1, 2]]


def test_only_loads_past_the_threshold_go_in_groups(monkeypatch) -> None:
    # The shipped defaults: 8 groups from 512 MiB (docs/GPU.md: below it one launch was as
    # fast or faster on an H100); one group turns grouping off at every size.
    assert hf.CUDA_LOAD_GROUPS == 8 and hf.CUDA_LOAD_GROUPED_BYTES == 512 << 20
    assert not hf._grouped_load(hf.CUDA_LOAD_GROUPED_BYTES - 1)
    assert hf._grouped_load(hf.CUDA_LOAD_GROUPED_BYTES)
    monkeypatch.setattr(hf, "CUDA_LOAD_GROUPS", 1)
    assert not hf._grouped_load(1 << 40)
