"""vLLM's block-hash chain re-implemented (`kvstore.engine_blocks`): pinned to values vLLM 0.32's
own `hash_block_tokens` gave (tests/vllm/test_vllm_kv_events.py checks it against vLLM live)."""

from __future__ import annotations

import importlib.util

import pytest

from kvstore.engine_blocks import spans_for, vllm_block_hashes
from kvstore.errors import InvalidArgumentError

TOKENS = list(range(100, 100 + 16 * 3 + 5))
# `hash_block_tokens` over TOKENS' third 16-token block, PYTHONHASHSEED unset, vLLM 0.32.
GOLDEN = {
    "sha256": "dc5a0111b9f2919d4789af4cfceb558c50750d1cc0f56692144e9e182eba6c69",
    "sha256_cbor": "2441f618186a645f56c3898f753a836f1e3dab0ae51494ac7ffdff5408e1a2ee",
}


@pytest.mark.parametrize("algo", sorted(GOLDEN))
def test_matches_vllm(algo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if algo == "sha256_cbor" and importlib.util.find_spec("cbor2") is None:
        pytest.skip("cbor2 (vLLM's dependency) is not installed")
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    hashes = vllm_block_hashes(TOKENS, 16, algo)
    assert len(hashes) == 3  # the partial block has none
    assert hashes[-1].hex() == GOLDEN[algo]
    # PYTHONHASHSEED seeds the chain, as in vLLM: another seed, other hashes.
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert vllm_block_hashes(TOKENS, 16, algo)[-1].hex() != GOLDEN[algo]


def test_spans_cover_whole_engine_blocks() -> None:
    tokens = list(range(64 * 2 + 10))
    hashes = vllm_block_hashes(tokens, 16)
    spans = spans_for(tokens, hashes, 16, 64, lora_name="a")
    assert [s.block_hashes for s in spans] == [tuple(hashes[:4]), tuple(hashes[4:8])]
    assert spans[0].parent_block_hash is None and spans[1].parent_block_hash == hashes[3]
    assert spans[1].token_ids == tuple(tokens[64:128])
    assert spans[0].lora_name == "a" and spans[0].block_size == 16
    assert len(spans_for(tokens, hashes[:6], 16, 64)) == 1  # stops where hashes run out
    with pytest.raises(InvalidArgumentError):
        spans_for(tokens, hashes, 24, 64)  # a kvstore block must hold whole engine blocks
    with pytest.raises(InvalidArgumentError):
        vllm_block_hashes(tokens, 16, "xxhash")  # per-process random seed: not reproducible
