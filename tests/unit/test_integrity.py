"""Framed payloads: header round trip and detection of every kind of damage."""

from __future__ import annotations

import random
import struct

import pytest
import xxhash

from kvstore.errors import IntegrityError
from kvstore.integrity import (
    FORMAT_VERSION,
    HEADER_BYTES,
    MAGIC,
    checksum,
    decode_header,
    encode_header,
    frame_header,
    verify,
)

KEY = bytes(range(32))
LAYOUT = bytes(range(100, 132))
PAYLOAD = random.Random(7).randbytes(3000)


def frame(payload: bytes = PAYLOAD) -> bytes:
    return frame_header(KEY, LAYOUT, payload) + payload


def check(record: bytes | bytearray, key: bytes = KEY, layout: bytes = LAYOUT) -> None:
    header = decode_header(record[:HEADER_BYTES])
    verify(header, memoryview(record)[HEADER_BYTES:], key, layout)


def test_header_round_trip() -> None:
    raw = frame_header(KEY, LAYOUT, PAYLOAD)
    assert len(raw) == HEADER_BYTES == 104
    assert raw[:4] == MAGIC
    h = decode_header(raw)
    assert h.key == KEY
    assert h.layout_digest == LAYOUT
    assert h.length == len(PAYLOAD)
    assert h.checksum == checksum([PAYLOAD])
    assert len(h.checksum) == 16
    assert int.from_bytes(raw[4:6], "little") == FORMAT_VERSION
    check(frame())


def test_encode_header_matches_frame_header() -> None:
    assert encode_header(KEY, LAYOUT, checksum([PAYLOAD]), len(PAYLOAD)) == frame_header(
        KEY, LAYOUT, PAYLOAD)


def test_checksum_streams_over_chunks() -> None:
    chunks = [PAYLOAD[:1], PAYLOAD[1:1000], memoryview(PAYLOAD)[1000:]]
    assert checksum(chunks) == checksum([PAYLOAD])
    assert checksum([PAYLOAD[:-1]]) != checksum([PAYLOAD])


def test_decode_accepts_longer_buffer() -> None:
    # Tiers read a whole header page; only the first HEADER_BYTES count.
    raw = frame_header(KEY, LAYOUT, PAYLOAD) + b"\xff" * 100
    assert decode_header(raw).key == KEY
    assert decode_header(memoryview(raw)).length == len(PAYLOAD)


def test_empty_payload_round_trip() -> None:
    check(frame(b""))


def _positions(n: int, k: int, seed: int) -> list[int]:
    return sorted(set(random.Random(seed).sample(range(n), min(n, k))) | {0, n - 1})


@pytest.mark.parametrize("pos", range(HEADER_BYTES))
def test_every_header_byte_flip_detected(pos: int) -> None:
    record = bytearray(frame())
    record[pos] ^= 0x01
    with pytest.raises(IntegrityError):
        check(record)


def test_sampled_payload_byte_flips_detected() -> None:
    good = frame()
    for pos in _positions(len(PAYLOAD), 200, seed=1):
        for bit in (0x01, 0x80, 0xFF):
            record = bytearray(good)
            record[HEADER_BYTES + pos] ^= bit
            with pytest.raises(IntegrityError, match="checksum"):
                check(record)


def test_self_check_catches_header_damage_before_anything_else() -> None:
    record = bytearray(frame())
    record[0] ^= 0x20  # magic
    with pytest.raises(IntegrityError, match="header checksum"):
        decode_header(record)


@pytest.mark.parametrize("cut", [0, 1, HEADER_BYTES - 1])
def test_truncated_header_detected(cut: int) -> None:
    with pytest.raises(IntegrityError, match="truncated header"):
        decode_header(frame()[:cut])


@pytest.mark.parametrize("cut", [1, 100, len(PAYLOAD)])
def test_truncated_payload_detected(cut: int) -> None:
    with pytest.raises(IntegrityError, match="length"):
        check(frame()[:-cut])


def test_extended_payload_detected() -> None:
    with pytest.raises(IntegrityError, match="length"):
        check(frame() + b"\x00")


def test_wrong_key_detected() -> None:
    other = bytes(31) + b"\x01"
    with pytest.raises(IntegrityError, match="another key"):
        check(frame(), key=other)


def test_wrong_layout_digest_detected() -> None:
    with pytest.raises(IntegrityError, match="another layout"):
        check(frame(), layout=bytes(32))


def test_bad_magic_and_version_detected_even_with_valid_self_checksum() -> None:
    head = struct.Struct("<4sHH32s32sQ16s")
    for magic, version, codec, match in ((b"XXXX", FORMAT_VERSION, 0, "bad magic"),
                                         (MAGIC, FORMAT_VERSION + 1, 0, "unsupported format"),
                                         (MAGIC, FORMAT_VERSION, 1, "codec")):
        h = head.pack(magic, version, codec, KEY, LAYOUT, len(PAYLOAD), checksum([PAYLOAD]))
        raw = h + struct.pack("<Q", xxhash.xxh3_64_intdigest(h))
        with pytest.raises(IntegrityError, match=match):
            decode_header(raw)


def test_swapped_payload_of_same_length_detected() -> None:
    other = bytes(len(PAYLOAD))
    record = frame_header(KEY, LAYOUT, PAYLOAD) + other
    with pytest.raises(IntegrityError, match="checksum"):
        check(record)
