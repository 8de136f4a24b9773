"""Framed payloads: a fixed header that binds a payload to its key and layout, with a checksum.

Header (little-endian, `HEADER_BYTES` long):
    magic "KVSB" | format u16 | codec u16 | key 32 B | layout digest 32 B | payload length u64 |
    xxh3-128 of the payload 16 B | xxh3-64 of everything before it 8 B
Every read from a tier that can rot or be swapped (disk, remote) goes through `verify_*`: a
failure raises `IntegrityError`, which the store turns into a miss and a deletion.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass

import xxhash

from kvstore.errors import IntegrityError

MAGIC = b"KVSB"
FORMAT_VERSION = 1
CODEC_NONE = 0
_HEAD = struct.Struct("<4sHH32s32sQ16s")
_SELF = struct.Struct("<Q")
HEADER_BYTES = _HEAD.size + _SELF.size  # 104


@dataclass(frozen=True)
class FrameHeader:
    key: bytes
    layout_digest: bytes
    length: int
    checksum: bytes
    codec: int = CODEC_NONE


def checksum(chunks: Iterable[bytes | memoryview]) -> bytes:
    """xxh3-128 over the concatenation of `chunks`, without concatenating them."""
    h = xxhash.xxh3_128()
    for c in chunks:
        h.update(c)
    return h.digest()


def encode_header(key: bytes, layout_digest: bytes, payload_checksum: bytes, length: int) -> bytes:
    head = _HEAD.pack(MAGIC, FORMAT_VERSION, CODEC_NONE, key, layout_digest, length,
                      payload_checksum)
    return head + _SELF.pack(xxhash.xxh3_64_intdigest(head))


def frame_header(key: bytes, layout_digest: bytes, payload: bytes | memoryview) -> bytes:
    return encode_header(key, layout_digest, checksum([payload]), len(memoryview(payload)))


def decode_header(raw: bytes | bytearray | memoryview) -> FrameHeader:
    """Parse and self-check a header; raises `IntegrityError` on any damage."""
    raw = bytes(raw[:HEADER_BYTES])
    if len(raw) < HEADER_BYTES:
        raise IntegrityError(f"truncated header: {len(raw)} of {HEADER_BYTES} bytes")
    head, (self_sum,) = raw[: _HEAD.size], _SELF.unpack(raw[_HEAD.size :])
    if xxhash.xxh3_64_intdigest(head) != self_sum:
        raise IntegrityError("header checksum mismatch")
    magic, version, codec, key, layout, length, csum = _HEAD.unpack(head)
    if magic != MAGIC:
        raise IntegrityError(f"bad magic {magic!r}")
    if version != FORMAT_VERSION or codec != CODEC_NONE:
        raise IntegrityError(f"unsupported format {version} / codec {codec}")
    return FrameHeader(key=key, layout_digest=layout, length=length, checksum=csum, codec=codec)


def verify(
    header: FrameHeader,
    payload: bytes | memoryview,
    key: bytes,
    layout_digest: bytes,
) -> None:
    """Check a decoded header and its payload against the key and layout they are read under."""
    verify_binding(header, len(memoryview(payload)), key, layout_digest)
    if checksum([payload]) != header.checksum:
        raise IntegrityError("payload checksum mismatch")


def verify_binding(header: FrameHeader, length: int, key: bytes, layout_digest: bytes) -> None:
    """The header's key, layout and length against what the reader expects (not the payload:
    a reader that hashes while it reads compares the checksum itself)."""
    if header.key != key:
        raise IntegrityError("payload belongs to another key")
    if header.layout_digest != layout_digest:
        raise IntegrityError("payload was written under another layout")
    if header.length != length:
        raise IntegrityError(f"payload length {length} != framed length {header.length}")
