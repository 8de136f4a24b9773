"""Power loss: the disk tier reopens after losing every write that was not made durable.

A power cut keeps what was synced and may drop, tear or keep anything else. The test cannot cut
power, so it builds the images a cut can leave from snapshots of a daemon's data directory
(each taken after a SIGKILL, so the files are as the kernel had them), and starts a daemon on
each:
- A, `disk_sync=always`: every page the synced index does not point at is gone (zeroed, the
  file truncated after the last indexed record). Pass: every indexed block is served
  byte-identical, no integrity failure.
- B, the index lost its unsynced tail (an older index over newer data: its entries point at
  extents that were freed and rewritten since). Pass: every indexed block is byte-identical or a
  counted miss, at least one stale entry is caught, the bad entries are deleted.
- C, `disk_sync=never` at its worst: the data file truncated mid-record, records torn (half
  their payload zeroed), a header garbled, the index's write-ahead log cut in half. Pass: the
  store reopens, serves only byte-identical blocks, counts the rest, and takes new writes.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from kvstore.client import KVClient
from kvstore.proto import kvstore_pb2 as pb
from kvstore.tiers.base import PAGE
from kvstore.tiers.disk import DiskTier
from tests.conftest import random_kv, same_bytes, small_layout
from tests.reliability import CapacityWatch, layout_pb, soak_record, stats, stub, tier

pytestmark = [pytest.mark.fault, pytest.mark.integration]
DISK = 1 << 20  # ~85 records of one 8 KiB block (a header page + 2 pages each)
ARGS = ("--host-bytes", "64KiB", "--disk-bytes", str(DISK), "--disk-sync", "always")
LAYOUT = small_layout()


def _prompt(p: int) -> list[int]:
    return [p * 1000 + t for t in range(64)]  # 4 blocks


def _publish(daemon, prompts, expected: dict[bytes, bytes], salt: str = "") -> None:
    with KVClient(daemon.target, LAYOUT, deadline_s=5, salt=salt) as c:
        for p in prompts:
            tokens, kv = _prompt(p), random_kv(LAYOUT, 64, seed=p)
            assert c.publish(tokens, kv) == 64
            for i, key in enumerate(c.keys(tokens)):
                block = kv[:, :, i * 16 : (i + 1) * 16].contiguous()
                expected[key] = bytes(block.view(-1).view(torch.uint8).numpy())


def _snapshot(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("kv.sock", "LOCK"))
    return dst


def _index(data_dir: Path) -> dict[bytes, tuple[int, int]]:
    """key -> (offset, record bytes) as a daemon starting on `data_dir` will load it."""
    disk = DiskTier(data_dir / "disk", DISK)
    try:
        return {k: (e.offset, PAGE + e.length) for k, e in disk.entries.items()}
    finally:
        disk.close()


def _fetch_block(target: str, namespace: bytes, key: bytes) -> bytes | None:
    channel, s = stub(target)
    with channel:
        req = pb.FetchRequest(namespace=namespace, layout=layout_pb(LAYOUT), keys=[key],
                              transfer=pb.TRANSFER_STREAM)
        chunks = list(s.Fetch(req, timeout=5))
    if chunks[0].hits == 0:
        return None
    return b"".join(c.data for c in chunks[1:])


def _serve_all(daemon, index, expected, namespace) -> tuple[int, int]:
    """Fetch every indexed block alone; returns (served, missed). A served block that is not
    byte-identical fails the test."""
    served = missed = 0
    for key in index:
        got = _fetch_block(daemon.target, namespace, key)
        if got is None:
            missed += 1
            continue
        assert got == expected[key], "a corrupt block was served"
        served += 1
    return served, missed


def test_power_loss_images_reopen_without_serving_corruption(daemon_factory, tmp_path):
    expected: dict[bytes, bytes] = {}
    d = daemon_factory(*ARGS, name="live").start()
    with KVClient(d.target, LAYOUT) as c:
        namespace = c.namespace.digest()
    _publish(d, range(15), expected)  # 60 blocks: ~52 demoted to disk
    d.kill()
    s1 = _snapshot(d.data_dir, tmp_path / "s1")
    d.start()
    _publish(d, range(15, 31), expected)  # 64 more: the disk overflows, old extents reused
    _publish(d, range(100, 103), {}, salt="cleared")  # written to disk, then removed:
    _publish(d, range(31, 35), expected)  # free extents holding unindexed bytes at the kill
    with KVClient(d.target, LAYOUT, salt="cleared") as c:
        assert c.clear() > 0
    d.kill()
    s2 = _snapshot(d.data_dir, tmp_path / "s2")
    rng = random.Random(6)
    counts = {"faults": 0, "served": 0, "missed": 0, "wrong": 0}

    # A: disk_sync=always, everything unsynced lost
    img = _snapshot(s2, tmp_path / "imgA")
    index = _index(img)
    assert len(index) > 40
    data = img / "disk" / "blocks.dat"
    raw = bytearray(data.read_bytes())
    keep = bytearray(len(raw))
    for i in range(0, len(raw), PAGE):  # unsynced: never written, or torn into garbage
        keep[i : i + PAGE] = rng.choice((bytes(PAGE), rng.randbytes(PAGE)))
    for off, n in index.values():
        keep[off : off + n] = raw[off : off + n]
    end = max(off + n for off, n in index.values())
    lost_pages = sum(keep[i : i + PAGE] != raw[i : i + PAGE] for i in range(0, len(raw), PAGE))
    assert lost_pages > 0, "the image lost nothing"
    counts["faults"] += lost_pages
    data.write_bytes(bytes(keep[:end]))
    a = daemon_factory(*ARGS, name="imgA").start()
    served, missed = _serve_all(a, index, expected, namespace)
    assert (served, missed) == (len(index), 0), "a synced block was lost"
    assert stats(a.target).integrity_failures == 0
    CapacityWatch(a).check()
    a.kill()
    counts["served"] += served

    # B: the index lost its unsynced tail: S1's index over S2's data
    img = _snapshot(s2, tmp_path / "imgB")
    shutil.rmtree(img / "disk" / "index")
    shutil.copytree(s1 / "disk" / "index", img / "disk" / "index")
    index = _index(img)
    b = daemon_factory(*ARGS, name="imgB").start()
    served, missed = _serve_all(b, index, expected, namespace)
    after = stats(b.target)
    assert served + missed == len(index)
    assert missed >= 1, "no stale index entry was exercised"
    assert after.integrity_failures == missed, "every stale entry is a counted miss"
    assert _serve_all(b, index, expected, namespace) == (served, missed)
    assert stats(b.target).integrity_failures == missed, "bad copies were deleted, not re-read"
    CapacityWatch(b).check()
    b.kill()
    counts["faults"] += missed
    counts["served"] += served
    counts["missed"] += missed
    counts["stale"] = missed

    # C: disk_sync=never at its worst: truncated, torn, garbled, index WAL cut
    img = _snapshot(s2, tmp_path / "imgC")
    index = _index(img)
    records = sorted(index.values())
    data = img / "disk" / "blocks.dat"
    raw = bytearray(data.read_bytes())
    for off, n in rng.sample(records, 3):  # torn: the second half of the payload never landed
        raw[off + PAGE + (n - PAGE) // 2 : off + n] = bytes(n - PAGE - (n - PAGE) // 2)
    off, _ = rng.choice(records)
    raw[off + 8 : off + 40] = rng.randbytes(32)  # a garbled header
    cut_off, cut_n = records[len(records) * 3 // 4]
    data.write_bytes(bytes(raw[: cut_off + cut_n // 2]))  # the tail of the file is gone
    for wal in (img / "disk" / "index").glob("*.log"):
        with open(wal, "r+b") as f:
            f.truncate(wal.stat().st_size // 2)
    counts["faults"] += 5
    index = _index(img)  # what survives the cut WAL
    c_ = daemon_factory(*ARGS, name="imgC").start()
    served, missed = _serve_all(c_, index, expected, namespace)
    assert served + missed == len(index)
    assert missed >= 4, "the torn, garbled and truncated records were not all caught"
    assert stats(c_.target).integrity_failures == missed
    with KVClient(c_.target, LAYOUT, deadline_s=5) as c:  # it still takes writes
        tokens, kv = _prompt(500), random_kv(LAYOUT, 64, seed=500)
        assert c.publish(tokens, kv) == 64
        n, got = c.fetch(tokens)
        assert n == 64 and same_bytes(got, kv)
    reply = stats(c_.target)
    assert tier(reply, "disk").used_bytes <= DISK
    CapacityWatch(c_).check()
    counts["served"] += served
    counts["missed"] += missed
    soak_record("power_loss", operations=counts["served"] + counts["missed"], kills=2,
                faults=counts["faults"], lost_pages_a=lost_pages, stale_b=counts["stale"],
                damaged_c=missed, wrong=counts["wrong"])
