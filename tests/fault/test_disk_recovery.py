"""A degraded disk tier takes writes again once the disk does (`DiskTier.try_recover`), on a
real tmpfs that fills up and is then freed; and what it dropped while degraded (evictions,
Clear) is made durable first, so a restart does not bring it back.

Tier-level, so the drop racing the check can be placed exactly; the daemon-level tests are in
`test_storage_disk.py`. Root needed to mount the tmpfs (skipped otherwise).
"""

from __future__ import annotations

import errno
import itertools
import os
import shutil
import subprocess
from collections.abc import Callable
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


def test_an_index_rebuilt_at_start_recovers_after_a_failed_reopen(tmp_path: Path) -> None:
    """A check whose reopen of the index fails (its directory refuses new files for a
    moment) leaves the next check free to reopen it: an index rebuilt and written at start is
    not one held in memory only."""
    with ext4(tmp_path / "fs", tmp_path / "fs.img", 32, reserved_pct=0) as fs:
        d = fs / "disk"
        tier = DiskTier(d, CAP, sync="always")
        for i in range(5):
            _write(tier, i)
        tier.close()
        shutil.rmtree(d / "index")
        tier = DiskTier(d, CAP, sync="always")
        try:
            assert tier.index_rebuilds == 1
            fill(fs)
            _fill_until_degraded(tier, first=100)
            (fs / "filler").unlink()
            if subprocess.run(["chattr", "+i", str(d / "index")], check=False).returncode:
                pytest.skip("chattr +i is not supported here")
            try:
                with pytest.raises(OSError, match="cannot be opened for writing"):
                    tier.try_recover()
            finally:
                subprocess.run(["chattr", "-i", str(d / "index")], check=True)
            assert tier.resume(tier.try_recover()) is True
            _write(tier, 300)
        finally:
            tier.close()
        again = DiskTier(d, CAP, sync="always")
        try:
            assert again.index_rebuilds == 0
            for i in [*range(5), 300]:
                assert _read(again, i) == _payload(i)
        finally:
            again.close()


def test_kv_events_descriptions_store_heals_with_the_disk(tmp_path: Path) -> None:
    """The KV events' store of disk block descriptions (RocksDB beside the index) fails its
    log write on the full disk as the index does. That must never raise out of the tier (a
    block committed but left pinned, its publish failing); descriptions saved before still
    announce their blocks' removal meanwhile (the failed handle still reads); a tracker
    started on the full disk starts read-only; and once the disk has room the store works
    again."""
    from kvstore.server.kv_events import (
        BlockRemoved,
        EngineBlocks,
        EventTracker,
        KVEventBatch,
        _MetaDB,
    )

    class _Publisher:  # the events' sockets are not what this tests: the batches are
        def __init__(self) -> None:
            self.removed: list[bytes] = []

        def publish(self, batch: KVEventBatch) -> bool:
            self.removed += [h for e in batch.events if isinstance(e, BlockRemoved)
                             for h in e.block_hashes]
            return True

    def describe(events: EventTracker, i: int, tokens: int = 16) -> None:
        events.describe(_key(i), EngineBlocks(block_hashes=[_key(i)], parent_block_hash=None,
                                              token_ids=list(range(tokens)),
                                              block_size=tokens))

    def tracker(tier: DiskTier, pub: _Publisher) -> EventTracker:
        events = EventTracker(pub, [tier], fs / "disk" / "kv_events.meta")  # type: ignore[arg-type]
        assert isinstance(events.db, _MetaDB)
        return events

    with tmpfs(tmp_path / "fs", "12m") as fs:
        tier = DiskTier(fs / "disk", CAP, sync="always")
        events = tracker(tier, _Publisher())
        for i in range(20):
            describe(events, i)
            _write(tier, i)
        events.close()
        tier.close()
        # A restart: descriptions now come from the store alone.
        tier = DiskTier(fs / "disk", CAP, sync="always")
        pub = _Publisher()
        events = tracker(tier, pub)
        assert events.db is not None
        try:
            for i in range(10):  # extents allocated in the file: writes there need no room
                assert tier.remove(_key(i))
            fill(fs)
            for i in range(100, 200):  # into the allocated extents, then degraded
                describe(events, i)
                try:
                    _write(tier, i)
                except DiskDegradedError:
                    break
            assert tier.degraded
            for n in range(3, 3000):  # descriptions of disk blocks saved: the store fails
                describe(events, 15, tokens=n % 64 + 1)
            assert events.db.failed
            del pub.removed[:]
            for i in range(10, 14):  # removals while degraded: nothing raises, and announced
                assert tier.remove(_key(i))
            assert pub.removed == [_key(i) for i in range(10, 14)], "removals unannounced"
            # A daemon started on the full disk: the store opens read-only, still reading.
            events.db.close()
            events.db = _MetaDB(fs / "disk" / "kv_events.meta")
            assert events.db.failed and events.db.get(_key(16)) is not None
            assert tier.remove(_key(16)) and pub.removed[-1] == _key(16)
            (fs / "filler").unlink()
            assert tier.resume(tier.try_recover()) is True
            for i in range(300, 305):
                describe(events, i)
                entry = _write(tier, i)
                assert not tier.policy.is_pinned(entry.key), "a committed block left pinned"
            assert not events.db.failed
            assert events.db.get(_key(304)) is not None, "the descriptions store did not heal"
        finally:
            events.close()
            tier.close()


def test_a_tier_that_keeps_degrading_is_rechecked_less_often(tmp_path: Path) -> None:
    """A disk failing now and then (which no test here can cause for real: the failure is
    injected by degrading the tier by hand after each recovery) is rechecked at doubling
    intervals, so it does not flap every period; a tier that holds its recovery is rechecked
    at the period again."""
    import asyncio
    import time

    from kvstore.server.store import TieredStore
    from kvstore.tiers.host import HostTier

    period = 0.05
    checks: list[float] = []

    async def _until(done: Callable[[], bool], within_s: float = 10.0) -> None:
        for _ in range(int(within_s / 0.01)):
            if done():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"not within {within_s} s")

    async def main() -> None:
        disk = DiskTier(tmp_path / "disk", CAP)
        store = TieredStore(HostTier(16 * PAGE, shm_dir=tmp_path), disk, io_threads=1)
        real = disk.try_recover

        def counted() -> int:
            checks.append(time.monotonic())
            return real()

        disk.try_recover = counted  # type: ignore[method-assign]
        watch = asyncio.create_task(store.disk_watch(period))
        try:
            for _ in range(4):  # degraded again right after each recovery: it flaps
                disk._degrade("injected: I/O error")
                n = len(checks)
                await _until(lambda n=n: len(checks) > n and not disk.degraded)
            assert disk.recoveries == 4
            gaps = [(b - a) / period for a, b in itertools.pairwise(checks)]
            # Measured: 2.2, 4.2, 8.2 periods (each gap a tick more than the hold).
            assert gaps[0] >= 1.8 and gaps[1] >= 1.8 * gaps[0] * 0.9, gaps
            assert gaps[2] >= 1.8 * gaps[1] * 0.9, gaps
            await asyncio.sleep(11 * period)  # its last recovery held: back to the period
            disk._degrade("injected: I/O error")
            began, n = time.monotonic(), len(checks)
            await _until(lambda: len(checks) > n)
            assert (checks[-1] - began) / period < 3, "the hold outlived a recovery that held"
        finally:
            watch.cancel()
            store.close()

    asyncio.run(main())
