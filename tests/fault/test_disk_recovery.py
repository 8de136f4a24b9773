"""A degraded disk tier takes writes again once the disk does (`DiskTier.try_recover`), on a
real tmpfs that fills up and is then freed; and what it dropped while degraded (evictions,
Clear) is made durable first, so a restart does not bring it back.

Tier-level, so the drop racing the check can be placed exactly; the daemon-level tests are in
`test_storage_disk.py`. Root needed to mount the tmpfs (skipped otherwise).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest

from kvstore.errors import CapacityError
from kvstore.tiers.base import PAGE, BlockEntry
from kvstore.tiers.disk import DiskDegradedError, DiskTier
from tests.fault.smallfs import ext4, fill, tmpfs

pytestmark = pytest.mark.fault
NS = b"n" * 32
LAYOUT = b"L" * 32
LENGTH = 60 * 1024  # a header page and 15 payload pages: 64 KiB on disk
CAP = 64 * (LENGTH + PAGE)  # 4 MiB: far less than RECOVER_FREE_BYTES, so the need is the rest


def _key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def _payload(i: int) -> bytes:
    return bytes([i % 251]) * LENGTH


def _write(tier: DiskTier, i: int) -> BlockEntry:
    entry = tier.prepare_store(_key(i), NS, LAYOUT, LENGTH)
    assert entry is not None
    try:
        tier.write(entry, memoryview(_payload(i)))
    except BaseException:
        tier.abort_store(entry)
        raise
    tier.complete_store(entry)
    return entry


def _read(tier: DiskTier, i: int) -> bytes:
    entry = tier.prepare_load(_key(i))
    try:
        dst = bytearray(LENGTH)
        tier.read_into(entry, memoryview(dst))
        return bytes(dst)
    finally:
        tier.complete_load(entry)


def _fill_until_degraded(tier: DiskTier, first: int = 0) -> list[int]:
    """Write blocks until the full filesystem degrades the tier; returns those written."""
    written = []
    for i in range(first, first + 1000):
        try:
            _write(tier, i)
        except DiskDegradedError:
            return written
        written.append(i)
    raise AssertionError("the filesystem never filled")


def test_a_freed_disk_takes_writes_again_and_drops_made_meanwhile_stay_dropped(
        tmp_path: Path) -> None:
    with tmpfs(tmp_path / "fs", "12m") as fs:
        (fs / "ballast").write_bytes(bytes(11 << 20))  # ~1 MiB left, the tier wants 4 MiB
        tier = DiskTier(fs / "disk", CAP, sync="always")
        try:
            written = _fill_until_degraded(tier)
            assert len(written) >= 4 and "No space left" in tier.degraded, tier.degraded
            with pytest.raises(CapacityError):
                tier.prepare_store(_key(999), NS, LAYOUT, LENGTH)
            # Dropped while degraded: nothing can be written for it now.
            assert tier.remove(_key(written[0]))
            with pytest.raises(OSError, match="MiB free, waiting for") as still_full:
                tier.try_recover()
            assert still_full.value.errno == errno.ENOSPC, still_full.value
            assert tier.degraded, "recovered with the disk still full"

            (fs / "ballast").unlink()  # the operator frees space
            handled = tier.try_recover()
            assert handled == 2  # the removed block and the write that failed (its record)
            # A drop while the check ran: not yet durable, so not yet taking writes.
            assert tier.remove(_key(written[1]))
            assert tier.resume(handled) is False
            assert tier.degraded
            assert tier.resume(tier.try_recover()) is True
            assert tier.degraded == "" and tier.recoveries == 1

            more = [_write(tier, i).key for i in range(500, 520)]  # takes writes again
            assert all(tier.contains(k) for k in more)
            for i in written[2:]:
                assert _read(tier, i) == _payload(i)
        finally:
            tier.close()
        again = DiskTier(fs / "disk", CAP, sync="always")
        try:
            assert again.index_rebuilds == 0 and again.dropped_at_open == 0
            assert not again.contains(_key(written[0])), "a block dropped while degraded came back"
            assert not again.contains(_key(written[1])), "a block dropped while degraded came back"
            for i in [*written[2:], *range(500, 520)]:
                assert _read(again, i) == _payload(i)
        finally:
            again.close()
        # Rebuilt from the data file alone: the records dropped while degraded were unmarked.
        shutil.rmtree(fs / "disk" / "index")
        rebuilt = DiskTier(fs / "disk", CAP, sync="always")
        try:
            assert rebuilt.index_rebuilds == 1
            assert not rebuilt.contains(_key(written[0])), "a dropped record was rebuilt"
            assert not rebuilt.contains(_key(written[1])), "a dropped record was rebuilt"
            for i in [*written[2:], *range(500, 520)]:
                assert _read(rebuilt, i) == _payload(i)
        finally:
            rebuilt.close()


def test_clear_while_degraded_is_durable_once_the_tier_recovers(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "fs", "12m") as fs:
        (fs / "ballast").write_bytes(bytes(11 << 20))
        tier = DiskTier(fs / "disk", CAP, sync="always")
        try:
            written = _fill_until_degraded(tier)
            for i in written:  # what the daemon's Clear does
                assert tier.remove(_key(i))
            (fs / "ballast").unlink()
            assert tier.resume(tier.try_recover()) is True
        finally:
            tier.close()
        again = DiskTier(fs / "disk", CAP, sync="always")
        try:
            assert again.committed_blocks == 0, "cleared blocks came back after the restart"
            assert again.index_rebuilds == 0
        finally:
            again.close()


def test_a_tier_degraded_forever_without_recovery_keeps_its_drops_pending(
        tmp_path: Path) -> None:
    """Positive control for the test above: without the recovery, a restart brings the
    cleared blocks back (verified, so still the right bytes): the gap it closes."""
    with tmpfs(tmp_path / "fs", "12m") as fs:
        (fs / "ballast").write_bytes(bytes(11 << 20))
        tier = DiskTier(fs / "disk", CAP, sync="always")
        try:
            written = _fill_until_degraded(tier)
            for i in written:
                assert tier.remove(_key(i))
        finally:
            tier.close()
        again = DiskTier(fs / "disk", CAP, sync="always")
        try:
            assert again.committed_blocks == len(written)
            for i in written:
                assert _read(again, i) == _payload(i)
        finally:
            again.close()


def test_an_index_that_failed_its_log_write_is_reopened(tmp_path: Path) -> None:
    """A data file already grown to its extents takes writes into them on a full disk, so the
    index's log append is what fails first; RocksDB then fails every later write on that
    handle, until it is reopened."""
    with tmpfs(tmp_path / "fs", "12m") as fs:
        tier = DiskTier(fs / "disk", CAP, sync="always")
        try:
            for i in range(20):
                _write(tier, i)
            for i in range(10):  # their extents stay allocated in the data file
                assert tier.remove(_key(i))
            fill(fs)  # the filesystem is full; the data file needs no new blocks
            assert len(_fill_until_degraded(tier, first=100)) < 10
            assert "No space left" in tier.degraded and ".log" in tier.degraded, tier.degraded
            (fs / "filler").unlink()
            assert tier.resume(tier.try_recover()) is True
            for i in range(200, 210):
                _write(tier, i)
        finally:
            tier.close()
        again = DiskTier(fs / "disk", CAP, sync="always")
        try:
            assert again.index_rebuilds == 0
            for i in [*range(10, 20), *range(200, 210)]:
                assert _read(again, i) == _payload(i)
        finally:
            again.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="root's view of free space (and mounting)")
def test_root_counts_the_blocks_reserved_for_root_as_free(tmp_path: Path) -> None:
    """The daemon runs as root in its image, and root's writes may use the blocks ext4 keeps
    for root: waiting for free space as other users see it would wait for the reserve too
    (a quarter of this filesystem, 5% of a real one by default)."""
    with ext4(tmp_path / "fs", tmp_path / "fs.img", 32, reserved_pct=25) as fs:
        tier = DiskTier(fs / "disk", CAP, sync="always")
        try:
            fill(fs)  # as root: into the reserve too
            _fill_until_degraded(tier)
            filler = fs / "filler"
            os.truncate(filler, filler.stat().st_size - (10 << 20))
            st = os.statvfs(fs)  # the tier waits for at most 8 MiB (4 + the index's 4)
            assert st.f_bavail * st.f_frsize < (4 << 20) and st.f_bfree * st.f_frsize > (8 << 20)
            assert tier.resume(tier.try_recover()) is True
        finally:
            tier.close()
