"""Chained prefix keys: prefix sharing, namespaces, token validation, determinism, golden values."""

from __future__ import annotations

import hashlib
import io
import subprocess
import tokenize
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.errors import InvalidArgumentError
from kvstore.keys import KEY_BYTES, KEY_VERSION, KeyCache, Namespace, chain_keys, tokens_to_array
from kvstore.layout import KVLayout

ROOT = Path(__file__).resolve().parents[2]
BT = 16  # block tokens of LAYOUT


def layout(**kw: object) -> KVLayout:
    args: dict = dict(model="tiny", num_layers=2, num_kv_heads=2, head_dim=16,
                      dtype=torch.float32, block_tokens=BT)
    args.update(kw)
    return KVLayout(**args)


LAYOUT = layout()
NS = Namespace(LAYOUT)


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_one_key_per_full_block_partial_block_has_none() -> None:
    assert chain_keys(NS, []) == []
    assert chain_keys(NS, toks(BT - 1)) == []
    assert len(chain_keys(NS, toks(BT))) == 1
    assert len(chain_keys(NS, toks(3 * BT + BT - 1))) == 3
    keys = chain_keys(NS, toks(4 * BT))
    assert len(keys) == 4
    assert all(len(k) == KEY_BYTES for k in keys)
    assert len(set(keys)) == 4
    # A trailing partial block changes nothing about the full blocks' keys.
    assert chain_keys(NS, toks(3 * BT + 5)) == keys[:3]


def test_equal_prefixes_give_equal_keys() -> None:
    a = chain_keys(NS, toks(3 * BT))
    b = chain_keys(NS, toks(5 * BT))
    assert b[:3] == a


@pytest.mark.parametrize("k", [0, 1, 3])
def test_divergence_at_block_k(k: int) -> None:
    t1 = toks(5 * BT)
    t2 = list(t1)
    t2[k * BT + 7] += 1  # one token inside block k
    a, b = chain_keys(NS, t1), chain_keys(NS, t2)
    assert a[:k] == b[:k]
    for i in range(k, 5):  # every later key commits to the changed token
        assert a[i] != b[i]


def test_key_matches_documented_formula() -> None:
    """key_0 = H(VERSION || ns || tokens_0), key_i = H(key_{i-1} || tokens_i), int32 LE."""
    tokens = toks(2 * BT, start=1000)
    ns = NS.digest()
    k0 = hashlib.sha256(KEY_VERSION + ns + np.asarray(tokens[:BT], "<i4").tobytes()).digest()
    k1 = hashlib.sha256(k0 + np.asarray(tokens[BT:], "<i4").tobytes()).digest()
    assert chain_keys(NS, tokens) == [k0, k1]
    assert chain_keys(ns, tokens, block_tokens=BT) == [k0, k1]


# Golden values, computed once and hard-coded on purpose: they guard the key format (version
# tag, namespace digest, token encoding, chaining). If this test fails, every key ever stored
# (on disk, in a remote cache, in other machines' daemons) changes meaning. Change the values
# only together with a deliberate bump of KEY_VERSION.
GOLDEN_LAYOUT = dict(model="golden", num_layers=2, num_kv_heads=2, head_dim=16,
                     dtype=torch.float32, block_tokens=16)
GOLDEN_LAYOUT_DIGEST = "7577e9acd2e4e81b5e52ec7ad1388fb62dac747602e243c646cc9c1e7d9360f7"
GOLDEN_NS_DIGEST = "6a5d5f58ee3a289210c9950010a32f6c497c96b6719e6ac7e8f3b49d65e77197"
GOLDEN_KEYS = [
    "2044d37800bc4a22f864ebe72487e22e54951e8d95b683b4529e9376f193094c",
    "c1f877dbd416f96f957169595fc16ba12aa2e91c94881eb435fc502a8430fac3",
    "add3d3e230e1b590f64caf7ffe0ba8fbc673f1388257c3d6189f1e2dfe238fce",
]


def test_golden_keys() -> None:
    gl = KVLayout(**GOLDEN_LAYOUT)
    assert gl.digest().hex() == GOLDEN_LAYOUT_DIGEST
    assert Namespace(gl).digest().hex() == GOLDEN_NS_DIGEST
    keys = chain_keys(Namespace(gl), list(range(100, 148)))
    assert [k.hex() for k in keys] == GOLDEN_KEYS


@pytest.mark.parametrize("change", [
    dict(layout=layout(model="other")),
    dict(layout=layout(dtype=torch.float16)),
    dict(layout=layout(tp_rank=1, tp_size=2)),
    dict(lora="adapter-a"),
    dict(tenant="tenant-a"),
    dict(salt="s3cret"),
])
def test_namespace_changes_every_key(change: dict) -> None:
    tokens = toks(4 * BT)
    base = chain_keys(NS, tokens)
    other_ns = Namespace(**{"layout": LAYOUT, **change})
    assert other_ns.digest() != NS.digest()
    other = chain_keys(other_ns, tokens)
    assert len(other) == len(base)
    assert not set(base) & set(other)


def test_namespace_fields_do_not_alias() -> None:
    # Moving a string between identity fields must not give the same namespace.
    a = Namespace(LAYOUT, lora="x", tenant="")
    b = Namespace(LAYOUT, lora="", tenant="x")
    c = Namespace(LAYOUT, tenant="", salt="x")
    assert len({a.digest(), b.digest(), c.digest()}) == 3


def test_extras_bind_per_block_identity() -> None:
    tokens = toks(2 * BT)
    plain = chain_keys(NS, tokens)
    img_a = chain_keys(NS, tokens, extras=[b"", b"image-a"])
    img_b = chain_keys(NS, tokens, extras=[b"", b"image-b"])
    assert img_a[0] == plain[0] == img_b[0]
    assert len({plain[1], img_a[1], img_b[1]}) == 3
    with pytest.raises(InvalidArgumentError, match="extras"):
        chain_keys(NS, tokens, extras=[b""])


def test_list_tensor_and_numpy_give_identical_keys() -> None:
    tokens = [5, 2**31 - 1, 0, 128000] * (2 * BT // 4)
    want = chain_keys(NS, tokens)
    for t in (torch.tensor(tokens, dtype=torch.int64), torch.tensor(tokens, dtype=torch.int32),
              np.array(tokens, dtype=np.int64), np.array(tokens, dtype=np.int32),
              np.array(tokens, dtype=np.uint32), tuple(tokens),
              [np.int64(x) for x in tokens]):
        assert chain_keys(NS, t) == want, type(t)


def test_tokens_to_array_is_little_endian_int32() -> None:
    arr = tokens_to_array(torch.tensor([1, 2, 3]))
    assert arr.dtype == np.dtype("<i4")
    assert arr.tobytes() == b"\x01\x00\x00\x00\x02\x00\x00\x00\x03\x00\x00\x00"
    big_endian = np.array([1, 2], dtype=">i4")
    assert tokens_to_array(big_endian).tobytes() == tokens_to_array([1, 2]).tobytes()


@pytest.mark.parametrize(("tokens", "match"), [
    ([1, 2.0, 3], r"tokens\[1\] is 2.0 \(float\)"),
    ([1, True], r"tokens\[1\] is True \(bool\)"),
    ([1, -1], r"\[0, 2\*\*31 - 1\]"),
    ([2**31], r"\[0, 2\*\*31 - 1\]"),
    (np.array([[1, 2], [3, 4]]), "one-dimensional"),
    (torch.tensor([[1, 2]]), "one-dimensional"),
    (torch.tensor([1.0, 2.0]), "integers, got a torch.float32 tensor"),
    (torch.tensor([True, False]), "integers, got a torch.bool tensor"),
    (np.array([1.0, 2.0]), "integers, got dtype float64"),
    (np.array([True]), "integers, got dtype bool"),
    (np.array([-5], dtype=np.int64), r"\[0, 2\*\*31 - 1\]"),
    (np.array([2**40], dtype=np.uint64), r"\[0, 2\*\*31 - 1\]"),
    ("abcd", r"tokens\[0\] is 'a' \(str\)"),
    (["1", "2"], r"\(str\), not an int"),
    (42, "got int"),
    (None, "got NoneType"),
])
def test_invalid_tokens_rejected_with_helpful_message(tokens: object, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        chain_keys(NS, tokens)  # type: ignore[arg-type]


def test_raw_namespace_needs_valid_block_tokens_and_digest() -> None:
    with pytest.raises(InvalidArgumentError, match="block_tokens is required"):
        chain_keys(NS.digest(), toks(BT))
    for bad in (0, -1, True):
        with pytest.raises(InvalidArgumentError, match="block_tokens"):
            chain_keys(NS.digest(), toks(BT), block_tokens=bad)
    with pytest.raises(InvalidArgumentError, match="32 bytes"):
        chain_keys(b"short", toks(BT), block_tokens=BT)


def test_keys_identical_across_processes_with_different_hash_seeds(
        hash_seed_children: list[subprocess.Popen[str]]) -> None:
    """Three interpreters with different PYTHONHASHSEEDs (see conftest.CHILD_SCRIPT) and this
    one compute the same keys."""
    outputs = []
    for proc in hash_seed_children:
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, err
        outputs.append(out.strip())
    ns = Namespace(LAYOUT, lora="l", tenant="t", salt="s")
    here = ",".join(k.hex() for k in chain_keys(ns, list(range(7, 7 + 64))))
    assert len(here.split(",")) == 4
    assert len(outputs) == 3
    assert outputs == [here] * 3


def test_keys_module_never_uses_builtin_hash() -> None:
    """Python's hash() is salted per process; keys must not depend on it."""
    source = (ROOT / "kvstore" / "keys.py").read_text()
    names = [tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.NAME]  # comments and strings are not NAME tokens
    assert "hashlib" in names  # the scan sees the code
    assert "hash" not in names


@pytest.mark.parametrize("tokens", [[2**63], [2**70], [np.uint64(2**63)],
                                    [1, np.uint64(2**64 - 1)]])
def test_huge_list_tokens_rejected_as_out_of_range(tokens: list) -> None:
    with pytest.raises(InvalidArgumentError, match=r"\[0, 2\*\*31 - 1\]"):
        chain_keys(NS, tokens)


def test_int_subclasses_and_mixed_numpy_scalars_are_ints() -> None:
    class TokenId(int):
        pass

    tokens = toks(2 * BT)
    mixed = [TokenId(t) if i % 3 == 0 else np.int32(t) if i % 3 == 1 else t
             for i, t in enumerate(tokens)]
    assert chain_keys(NS, mixed) == chain_keys(NS, tokens)


def test_key_cache_matches_chain_keys_for_repeats_prefixes_extensions_and_forks() -> None:
    cache = KeyCache(NS.digest(), BT, max_entries=4)
    rng = np.random.default_rng(7)
    base = rng.integers(0, 50_000, 12 * BT).tolist()
    prompts = [base, base, base[: 5 * BT], base[: 5 * BT + 3], base + toks(3 * BT),
               base[:7 * BT] + toks(2 * BT), base[: BT - 1], [], torch.tensor(base),
               np.asarray(base[: 9 * BT], dtype=np.int32)]
    for _ in range(40):  # forks and extensions of what was seen, in random order
        src = prompts[int(rng.integers(len(prompts)))]
        cut = int(rng.integers(0, len(src) + 1))
        head = np.asarray(src, dtype=np.int64)[:cut].tolist()
        prompts.append(head + rng.integers(0, 50_000, int(rng.integers(0, 3 * BT))).tolist())
    for p in prompts:
        assert cache.keys(p) == chain_keys(NS, p)
    assert cache.hits > 0
    assert len(cache._entries) <= 4


def test_key_cache_reuses_keys_and_hashes_only_new_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvstore.keys as keys_mod

    hashed: list[int] = []
    real = keys_mod._chain

    def counting(prev: bytes, raw: bytes, step: int, n_blocks: int, *a: object, **kw: object):
        keys = real(prev, raw, step, n_blocks, *a, **kw)  # type: ignore[arg-type]
        hashed.append(len(keys))
        return keys

    monkeypatch.setattr(keys_mod, "_chain", counting)
    cache = KeyCache(NS.digest(), BT)
    cache.keys(toks(4 * BT))
    cache.keys(toks(4 * BT))        # the same prompt: nothing hashed
    cache.keys(toks(2 * BT + 5))    # a prefix of it: nothing hashed
    cache.keys(toks(6 * BT))        # an extension: the 2 new blocks only
    assert hashed == [4, 2]
    assert (cache.hits, cache.misses) == (2, 2)


def test_key_cache_is_exact_and_bounded() -> None:
    cache = KeyCache(NS.digest(), BT, max_entries=3, max_bytes=8 * BT * 4)
    t = torch.arange(4 * BT)
    first = cache.keys(t)
    first.append(b"caller's own list")  # what the caller does with its list stays there
    t[BT + 3] += 1  # the same tensor, changed in place: a different prompt from block 1 on
    assert cache.keys(t) == chain_keys(NS, t)
    assert cache.keys(torch.arange(4 * BT)) == chain_keys(NS, torch.arange(4 * BT))
    for i in range(5):  # distinct prompts push the oldest out
        cache.keys(toks(2 * BT, start=1000 * (i + 1)))
    assert len(cache._entries) <= 3
    assert sum(len(raw) for raw, _ in cache._entries) <= 8 * BT * 4
    big = toks(9 * BT)  # more token bytes than the cache may hold: computed, not kept
    assert cache.keys(big) == chain_keys(NS, big)
    assert all(len(raw) < 9 * BT * 4 for raw, _ in cache._entries)


def test_key_cache_other_namespace_or_block_size_never_shares() -> None:
    tokens = toks(4 * BT)
    a = KeyCache(NS.digest(), BT).keys(tokens)
    b = KeyCache(Namespace(LAYOUT, salt="x").digest(), BT).keys(tokens)
    c = KeyCache(NS.digest(), 2 * BT).keys(tokens)
    assert a == chain_keys(NS, tokens)
    assert not set(a) & set(b)
    assert c == chain_keys(NS.digest(), tokens, block_tokens=2 * BT)
    with pytest.raises(InvalidArgumentError, match="block_tokens"):
        KeyCache(NS.digest(), 0)
    with pytest.raises(InvalidArgumentError, match="32 bytes"):
        KeyCache(b"short", BT)
