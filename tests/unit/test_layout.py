"""KVLayout: sizes, shapes, digest identity, validation messages, serialisation, check_kv."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvstore.errors import InvalidArgumentError, LayoutMismatchError
from kvstore.layout import DTYPES, MAX_BLOCK_BYTES, KVLayout, dtype_name

LLAMA3_8B = dict(model="meta-llama/Meta-Llama-3-8B", num_layers=32, num_kv_heads=8,
                 head_dim=128, dtype=torch.bfloat16)


def test_llama3_8b_bf16_sizes() -> None:
    layout = KVLayout(**LLAMA3_8B)
    assert layout.bytes_per_token == 131072  # 2 * 32 * 8 * 128 * 2 = 128 KiB
    assert layout.block_tokens == 256
    assert layout.block_bytes == 32 * 2**20
    assert layout.block_shape == (32, 2, 256, 8, 128)
    assert layout.kv_shape(7) == (32, 2, 7, 8, 128)


def test_mla_layout_has_one_latent() -> None:
    layout = KVLayout(model="deepseek", num_layers=4, num_kv_heads=1, head_dim=576,
                      dtype="bfloat16", kv_kind="mla", block_tokens=64)
    assert layout.kv_count == 1
    assert layout.block_shape == (4, 1, 64, 1, 576)
    assert layout.bytes_per_token == 4 * 576 * 2


@pytest.mark.parametrize(("dtype", "size"), [("float32", 4), ("float16", 2), ("bfloat16", 2),
                                              ("float8_e4m3fn", 1), ("int8", 1), ("uint8", 1)])
def test_bytes_per_token_follows_dtype(dtype: str, size: int) -> None:
    layout = KVLayout(model="m", num_layers=3, num_kv_heads=5, head_dim=7, dtype=dtype,
                      block_tokens=4)
    assert layout.dtype_bytes == size
    assert layout.bytes_per_token == 2 * 3 * 5 * 7 * size
    assert layout.block_bytes == layout.bytes_per_token * 4


@pytest.mark.parametrize("given", ["bfloat16", "torch.bfloat16", torch.bfloat16])
def test_dtype_as_str_or_torch_dtype(given: object) -> None:
    layout = KVLayout(model="m", num_layers=1, num_kv_heads=1, head_dim=8, dtype=given)
    assert layout.torch_dtype is torch.bfloat16
    assert layout.dtype_name == "bfloat16"
    assert layout.dtype == given  # kept as given; equality and digest use the name
    assert hash(layout) == hash(KVLayout(model="m", num_layers=1, num_kv_heads=1, head_dim=8))
    assert layout == KVLayout(model="m", num_layers=1, num_kv_heads=1, head_dim=8)
    assert layout.digest() == KVLayout(model="m", num_layers=1, num_kv_heads=1,
                                       head_dim=8).digest()


def test_dtype_name_canonicalises() -> None:
    for name, size in DTYPES.items():
        dt = getattr(torch, name)
        assert dtype_name(dt) == name
        assert torch.empty((), dtype=dt).element_size() == size  # the size table is right
        assert dtype_name(name) == name
        assert dtype_name(f"torch.{name}") == name


def test_digest_equal_for_equal_layouts() -> None:
    a, b = KVLayout(**LLAMA3_8B), KVLayout(**LLAMA3_8B)
    assert a.digest() == b.digest()
    assert len(a.digest()) == 32
    assert hash(a) == hash(b)


# One changed value per field: the digest must change whatever the field.
CHANGES = {
    "model": "other-model",
    "num_layers": 16,
    "num_kv_heads": 4,
    "head_dim": 64,
    "dtype": torch.float16,
    "block_tokens": 128,
    "model_revision": "rev2",
    "tp_rank": 1,
    "tp_size": 4,
    "pp_rank": 1,
    "pp_size": 3,
}


def test_every_field_is_covered_by_the_digest_test() -> None:
    fields = {f.name for f in dataclasses.fields(KVLayout)}
    assert fields == set(CHANGES) | {"kv_kind"}  # kv_kind: see test_digest_differs_for_mla


@pytest.mark.parametrize("field", sorted(CHANGES))
def test_digest_differs_when_any_field_differs(field: str) -> None:
    base = dict(LLAMA3_8B, tp_size=2, pp_size=2)
    changed = dict(base, **{field: CHANGES[field]})
    if field in ("tp_rank", "pp_rank"):
        changed[field.replace("rank", "size")] = 2
    a, b = KVLayout(**base), KVLayout(**changed)
    assert a != b
    assert a.digest() != b.digest()


def test_digest_differs_for_mla() -> None:
    kv = KVLayout(model="m", num_layers=2, num_kv_heads=1, head_dim=64)
    mla = KVLayout(model="m", num_layers=2, num_kv_heads=1, head_dim=64, kv_kind="mla")
    assert kv.digest() != mla.digest()


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(num_layers=0), "num_layers"),
    (dict(num_layers=-1), "num_layers"),
    (dict(num_kv_heads=0), "num_kv_heads"),
    (dict(head_dim=0), "head_dim"),
    (dict(block_tokens=0), "block_tokens"),
    (dict(num_layers=2.0), "num_layers"),
    (dict(num_layers=True), "num_layers"),
    (dict(tp_size=0), "tp_size"),
    (dict(tp_rank=2, tp_size=2), "tp_rank"),
    (dict(pp_rank=-1), "pp_rank"),
    (dict(kv_kind="kvv"), "kv_kind"),
    (dict(model=""), "model"),
])
def test_validation_errors_name_the_field(kwargs: dict, field: str) -> None:
    args = dict(model="m", num_layers=2, num_kv_heads=2, head_dim=16)
    args.update(kwargs)
    with pytest.raises(InvalidArgumentError, match=field):
        KVLayout(**args)


def test_mla_with_two_heads_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="num_kv_heads == 1"):
        KVLayout(model="m", num_layers=2, num_kv_heads=2, head_dim=16, kv_kind="mla")


@pytest.mark.parametrize("dtype", ["float64", "int32", torch.float64, torch.int64, "bf16"])
def test_unsupported_dtype_rejected(dtype: object) -> None:
    with pytest.raises(InvalidArgumentError, match="unsupported dtype"):
        KVLayout(model="m", num_layers=2, num_kv_heads=2, head_dim=16, dtype=dtype)


def test_absurd_block_size_rejected() -> None:
    with pytest.raises(InvalidArgumentError, match="block_tokens"):
        KVLayout(model="m", num_layers=1000, num_kv_heads=128, head_dim=256, block_tokens=4096)
    # Exactly at the limit is accepted.
    at_limit = KVLayout(model="m", num_layers=1, num_kv_heads=1, head_dim=MAX_BLOCK_BYTES // 2,
                        dtype=torch.uint8, block_tokens=1)
    assert at_limit.block_bytes == MAX_BLOCK_BYTES


def test_layout_is_frozen() -> None:
    layout = KVLayout(**LLAMA3_8B)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.num_layers = 1  # type: ignore[misc]


def test_to_dict_from_dict_round_trip() -> None:
    layout = KVLayout(model="m", num_layers=3, num_kv_heads=1, head_dim=32, dtype=torch.float16,
                      block_tokens=64, model_revision="abc", kv_kind="mla", tp_rank=1,
                      tp_size=2, pp_rank=2, pp_size=3)
    d = layout.to_dict()
    assert d["dtype"] == "float16"
    assert all(isinstance(v, str | int) for v in d.values())  # JSON-able
    back = KVLayout.from_dict(d)
    assert back == layout
    assert back.digest() == layout.digest()


def test_from_dict_rejects_unknown_fields() -> None:
    d = KVLayout(**LLAMA3_8B).to_dict()
    d["num_heads"] = 8
    with pytest.raises(InvalidArgumentError, match="num_heads"):
        KVLayout.from_dict(d)


def test_check_kv_accepts_matching_tensor() -> None:
    layout = KVLayout(model="m", num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float16,
                      block_tokens=8)
    layout.check_kv(torch.zeros(layout.kv_shape(5), dtype=torch.float16), 5)


def test_check_kv_wrong_dtype_message() -> None:
    layout = KVLayout(model="m", num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float16)
    kv = torch.zeros(layout.kv_shape(5), dtype=torch.float32)
    with pytest.raises(LayoutMismatchError, match=r"dtype is torch.float32.*torch.float16"):
        layout.check_kv(kv, 5)


def test_check_kv_wrong_shape_message() -> None:
    layout = KVLayout(model="m", num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float16)
    kv = torch.zeros((2, 2, 5, 4, 2), dtype=torch.float16)  # heads and head_dim swapped
    with pytest.raises(LayoutMismatchError) as info:
        layout.check_kv(kv, 5)
    msg = str(info.value)
    assert "(2, 2, 5, 4, 2)" in msg
    assert "(2, 2, 5, 2, 4)" in msg
    with pytest.raises(LayoutMismatchError, match="expected"):
        layout.check_kv(torch.zeros(layout.kv_shape(6), dtype=torch.float16), 5)


def test_check_kv_rejects_non_tensor() -> None:
    layout = KVLayout(model="m", num_layers=1, num_kv_heads=1, head_dim=4)
    with pytest.raises(LayoutMismatchError, match=r"torch\.Tensor"):
        layout.check_kv([[0.0]], 1)  # type: ignore[arg-type]
