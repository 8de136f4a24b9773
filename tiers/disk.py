"""Disk tier: payloads in one preallocated-as-needed data file, RocksDB (`rocksdict`) as index.

Bulk bytes stay out of RocksDB (4 MiB blobs went in at ~0.3 GB/s there, against ~2 GB/s for
plain writes to the same disk). A record is a header page (the framed header, see
`kvstore.integrity`, then the write sequence and namespace, see `tiers.disk_index`) followed by
the payload, at a page-aligned offset handed out by an extent allocator whose units cover
exactly `capacity_bytes` — so the file never grows past the capacity.

Crash safety: the index entry is written only after the record's bytes are written (and, with
`sync="always"`, made durable), so a crash never leaves an entry pointing at unwritten bytes;
with `sync="never"` it may, and the read-side verification turns that into a miss. At start the
index is loaded, so a restarted daemon keeps its cache; a damaged index is moved aside and
rebuilt from the data file (`tiers.disk_index`).

Faults of the disk itself (full, read-only, I/O errors) degrade the tier instead of failing
calls: the first failed write or index update marks it `degraded` (logged once, counted), after
which it takes no writes (`prepare_store` raises `CapacityError`: demotions drop the block, as
for a block larger than the tier) and goes on serving, verified, what it holds. A tier that
cannot be written at start (read-only filesystem, full disk) opens read-only the same way.
A degraded tier takes writes again once the disk does (`try_recover`, asked every
`disk_recheck_s` by the daemon): first it makes durable what it dropped meanwhile, so that no
index entry outlives its block.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import xxhash

from kvstore.errors import CapacityError, IntegrityError, InvalidArgumentError
from kvstore.integrity import (
    HEADER_BYTES,
    checksum,
    decode_header,
    encode_header,
    verify_binding,
)
from kvstore.tiering import owner_of
from kvstore.tiers.base import PAGE, BlockEntry, Tier, TierStats
from kvstore.tiers.disk_index import (
    READ_PIECE,
    Index,
    IndexDamagedError,
    Row,
    encode_ext,
    one_line,
    scan_records,
)

log = logging.getLogger(__name__)
__all__ = ["READ_PIECE", "DiskDegradedError", "DiskTier"]


# A degraded tier takes writes again only when the filesystem has this much free, or room for
# the rest of its data file (and INDEX_ROOM for the index) if that is less: a disk freed by a
# few blocks would fill again at once, and the tier would flap between degraded and not.
RECOVER_FREE_BYTES = 256 << 20
INDEX_ROOM = 4 << 20  # RocksDB's log and flushes: what a full data file still needs


class DiskDegradedError(OSError):
    """The disk tier takes no writes (full, read-only, or failing)."""


def _pwrite_all(fd: int, bufs: list[bytes | memoryview], offset: int) -> None:
    """Write every byte or raise the OSError that stopped it: a short write to a regular file
    means the next one fails with the reason (ENOSPC), which is what an operator needs."""
    views = [memoryview(b).cast("B") for b in bufs]
    while views:
        n = os.pwritev(fd, views, offset)
        if n == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


class DiskTier(Tier):
    name = "disk"

    def __init__(self, directory: str | Path, capacity_bytes: int, sync: str = "always",
                 fault_read_delay_s: float = 0.0) -> None:
        if sync not in ("always", "never"):
            raise InvalidArgumentError(f"disk sync must be 'always' or 'never', got {sync!r}")
        super().__init__(capacity_bytes)
        self.directory = Path(directory)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.sync = sync == "always"
        # Testing only: a stalled disk, which no test can cause for real (deadline tests).
        self.fault_read_delay_s = fault_read_delay_s
        self.degraded = ""  # why the tier takes no writes; "" while it does
        self.write_failures = 0  # failed writes and index updates (each counts)
        self.index_rebuilds = 0  # damaged indexes rebuilt from the data file at open
        self.recovered_blocks = 0  # blocks those rebuilds brought back
        self.recoveries = 0  # times the tier took writes again after being degraded
        # Blocks dropped while degraded, whose index entries (and record magic, where the
        # offset is given) are still on disk: made durable before the tier takes writes again.
        self._unsynced_drops: list[tuple[bytes, int | None]] = []
        self._writes_lock = threading.Lock()
        self._writing = 0  # `write` calls in flight
        self.degraded_at = 0.0  # time.monotonic() when it last degraded
        self._seq = 0
        data = self.directory / "blocks.dat"
        try:
            self._fd = os.open(data, os.O_RDWR | os.O_CREAT, 0o600)
            data_writable = True
        except OSError as e:
            if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM) or not data.exists():
                raise
            self._fd = os.open(data, os.O_RDONLY)
            data_writable = False
            self._degrade(f"data file is not writable: {e.strerror}", count=False)
        self._data_writable = data_writable
        self._index = Index(self.directory / "index", self.sync)
        rows = self._open_index()
        # Rebuilt, but neither written anew nor openable where it lies (the damaged one could
        # not be moved aside, or the new one not written): only a restart can write it.
        self._index_in_memory = self._index.db is None
        if self._index.read_only_reason and not self.degraded:
            self._degrade(self._index.read_only_reason, count=False)
        self.dropped_at_open = self._index.malformed + self._load_rows(rows)
        if self.file_bytes > self.capacity_bytes and data_writable and not self.degraded:
            os.ftruncate(self._fd, self.capacity_bytes)  # every kept record lies below it
        if self.degraded:
            log.warning("disk tier read-only: %s; serving the %d blocks it holds, taking no "
                        "writes until the disk does", self.degraded, self.committed_blocks)
        elif hint := self._room_hint():
            log.warning("disk tier at %s%s", self.directory, hint)

    def units_for(self, length: int) -> int:
        return 1 + -(-length // PAGE)  # header page + payload

    # ---- opening: the index, or its rebuild from the data file
    def _open_index(self) -> list[Row]:
        existed = self._index.path.exists()
        try:
            self._index.open()
            return self._index.load(self.file_bytes)
        except IndexDamagedError as e:
            return self._rebuild(str(e), quarantine=existed)

    def _rebuild(self, why: str, quarantine: bool) -> list[Row]:
        """Move the damaged index aside and index every verified record of the data file."""
        if quarantine:
            moved = self._index.quarantine()
        else:  # the index was missing: drop the empty one opening it just created
            moved = None
            self._index.close(None)
            shutil.rmtree(self._index.path, ignore_errors=True)
        scan = scan_records(self._fd, self.file_bytes)
        if not self._index.path.exists():
            self._index.recreate(scan.rows)
        self.index_rebuilds += 1
        self.recovered_blocks += len(scan.rows)
        where = (f"quarantined as {moved}" if moved else
                 f"not moved aside ({self._index.read_only_reason})" if quarantine else
                 "it was missing")
        log.error("disk index %s damaged (%s); %s; rebuilt from the data file: %d blocks, "
                  "%d damaged records skipped%s, in %.2f s", self._index.path, why, where,
                  len(scan.rows), scan.damaged,
                  f", {scan.old_format} records of an older format (no namespace) not "
                  "recovered" if scan.old_format else "", scan.seconds)
        return scan.rows

    def _load_rows(self, rows: list[Row]) -> int:
        """Rebuild allocation and LRU order (oldest write first) from the index rows."""
        dropped = 0
        for row in sorted(rows, key=lambda r: r.seq):
            units = self.units_for(row.length)
            # Entries past a lowered capacity, or overlapping another, are dropped: a miss.
            if row.unit + units > self.alloc.total or not self.policy.fits(units * PAGE):
                self._forget_row(row.key)
                dropped += 1
                continue
            try:
                self.alloc.reserve(row.unit, units)
            except InvalidArgumentError:
                self._forget_row(row.key)
                dropped += 1
                continue
            entry = BlockEntry(row.key, row.namespace, row.layout_digest, row.length, row.unit,
                               units, committed=True, checksum=row.checksum)
            self.entries[row.key] = entry
            self._count(entry, 1)
            self.policy.add(row.key, units * PAGE, owner_of(row.namespace))
            self._seq = max(self._seq, row.seq)
        return dropped

    def _forget_row(self, key: bytes) -> None:
        if self.degraded:  # its record may hold another's bytes (overlap): no magic to clear
            self._unsynced_drops.append((key, None))
            return
        try:
            self._index.delete(key)
        except Exception as e:
            self._degrade(f"index update failed: {one_line(e)}")
            self._unsynced_drops.append((key, None))

    # ---- faults of the disk itself
    def _degrade(self, reason: str, count: bool = True) -> None:
        """Stop taking writes; logged once. Called from the loop or a worker thread (a plain
        attribute store: at worst one more write is tried, and fails the same way)."""
        self.write_failures += count
        if self.degraded:
            return
        self.degraded = reason = " ".join(reason.split())
        self.degraded_at = time.monotonic()
        if count:
            log.error("disk tier degraded: %s; it takes no more writes until the disk does "
                      "(checked every disk_recheck_s) and serves the blocks it holds; the host "
                      "tier goes on%s", reason,
                      self._room_hint() if "No space" in reason else "")

    def try_recover(self) -> int:
        """In a worker, while degraded: check that the disk takes writes again, then make
        durable the drops recorded meanwhile (index entries deleted, record magic cleared).
        Returns how many drops it made durable, for `resume`; raises `OSError` saying why the
        tier cannot take writes yet. Only free extents are written here (a degraded tier hands
        out none, so the records it clears, and its probe page, cannot be another block's)."""
        with self._writes_lock:
            if self._writing:  # its index put must not meet the reopen below
                raise OSError(errno.EBUSY, "a write begun before the tier degraded is still "
                              "in flight")
        if self._index_in_memory:
            raise OSError(errno.EIO, "the disk index was rebuilt in memory only; a restart "
                          "writes it")
        free = self._free_bytes()
        need = min(RECOVER_FREE_BYTES, self._file_room() + INDEX_ROOM)
        if free < need:
            raise OSError(errno.ENOSPC, f"{free / 2**20:.1f} MiB free, waiting for "
                          f"{need / 2**20:.1f} MiB")
        if not self._data_writable:
            self._reopen_data()
        # Always reopened: a RocksDB whose log write failed keeps failing every write.
        self._index.reopen_writable()
        n = len(self._unsynced_drops)
        drops = self._unsynced_drops[:n]
        for _key, offset in drops:
            if offset is not None:
                os.pwrite(self._fd, bytes(4), offset)
        if (unit := self.alloc.first_free()) is not None:  # the data file's write probe
            os.pwrite(self._fd, bytes(PAGE), unit * PAGE)
        os.fdatasync(self._fd)
        self._index.forget([key for key, _ in drops])
        return n

    def _reopen_data(self) -> None:
        """The data file, opened read-only at start, reopened for writing in place (the same
        descriptor number: readers' calls in flight keep the old description)."""
        fd = os.open(self.directory / "blocks.dat", os.O_RDWR)
        try:
            old, new = os.fstat(self._fd), os.fstat(fd)
            if (old.st_dev, old.st_ino) != (new.st_dev, new.st_ino):
                raise OSError(errno.ESTALE, "blocks.dat was replaced since the tier opened it")
            os.dup2(fd, self._fd, inheritable=False)
        finally:
            os.close(fd)
        self._data_writable = True

    def _free_bytes(self) -> int:
        st = os.statvfs(self.directory)
        # Root (the daemon in its image) may write into the blocks reserved for it, too.
        return (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize

    def _file_room(self) -> int:
        """Bytes the data file still needs to hold `capacity_bytes` (it is written sparse)."""
        return max(0, self.capacity_bytes - os.fstat(self._fd).st_blocks * 512)

    def _room_hint(self) -> str:
        """A clause for the log when the filesystem cannot hold the whole tier."""
        try:
            room = self._free_bytes() + self.capacity_bytes - self._file_room()
        except OSError:
            return ""
        if room >= self.capacity_bytes:
            return ""
        return (f"; disk_bytes ({self.capacity_bytes / 2**20:.0f} MiB) is more than this "
                f"filesystem has room for ({room / 2**20:.0f} MiB with the data file): lower "
                "it, or the tier will fill the disk again")

    def resume(self, handled: int) -> bool:
        """On the loop, after `try_recover` returned `handled`: take writes again, unless more
        blocks were dropped while it ran (False: run it again)."""
        del self._unsynced_drops[:handled]
        if self._unsynced_drops:
            return False
        if not self.degraded:
            return True
        log.warning("disk tier takes writes again after %.0f s degraded (%s)",
                    time.monotonic() - self.degraded_at, self.degraded)
        self.degraded = ""
        self.recoveries += 1
        return True

    def prepare_store(self, key: bytes, namespace: bytes, layout_digest: bytes,
                      length: int) -> BlockEntry | None:
        if self.degraded:
            raise CapacityError(f"disk tier takes no writes: {self.degraded}")
        return super().prepare_store(key, namespace, layout_digest, length)

    def stats(self) -> TierStats:
        s = super().stats()
        s.degraded = self.degraded
        return s

    # ---- byte movement: called from worker threads, on pinned / reserved entries only
    def reserve_seqs(self, n: int) -> int:
        """Claim `n` consecutive write sequence numbers (the LRU order a restart rebuilds);
        returns the first. Lets a caller write blocks in one order and rank them in another."""
        first = self._seq + 1
        self._seq += n
        return first

    def write(self, entry: BlockEntry, payload: memoryview, seq: int | None = None) -> None:
        """Write a reserved record and its index entry (in that order, durable per `sync`).

        `seq` ranks the block for the LRU order rebuilt at start (default: newest). A failure
        degrades the tier and raises `DiskDegradedError` (an OSError)."""
        if len(payload) != entry.length:
            raise InvalidArgumentError(f"payload is {len(payload)} bytes, reserved {entry.length}")
        with self._writes_lock:
            if self.degraded:
                raise DiskDegradedError(f"disk tier takes no writes: {self.degraded}")
            self._writing += 1
        try:
            self._write(entry, payload, seq)
        finally:
            with self._writes_lock:
                self._writing -= 1

    def _write(self, entry: BlockEntry, payload: memoryview, seq: int | None) -> None:
        if seq is None:
            seq = self.reserve_seqs(1)
        csum = checksum([payload])
        header = encode_header(entry.key, entry.layout_digest, csum, entry.length)
        page = header + encode_ext(header, seq, entry.namespace)
        try:
            _pwrite_all(self._fd, [page + bytes(PAGE - len(page)), payload], entry.offset)
            if self.sync:
                os.fdatasync(self._fd)
            entry.checksum = csum
            self._index.put(Row(seq, entry.key, entry.unit, entry.length, entry.namespace,
                                entry.layout_digest, csum))
        except Exception as e:  # OSError from the file, plain Exception from RocksDB
            self._degrade(f"write failed: {one_line(e)}")
            raise DiskDegradedError(f"disk write failed: {one_line(e)}") from None

    def read_into(self, entry: BlockEntry, dst: memoryview) -> None:
        """Read and verify a record's payload into `dst`; `IntegrityError` on any damage."""
        if len(dst) != entry.length:
            raise InvalidArgumentError(f"destination is {len(dst)} bytes, block is {entry.length}")
        if self.fault_read_delay_s:
            time.sleep(self.fault_read_delay_s)
        head = bytearray(HEADER_BYTES)
        n = os.preadv(self._fd, [head], entry.offset)
        header = decode_header(memoryview(head)[:n])
        verify_binding(header, entry.length, entry.key, entry.layout_digest)
        if entry.checksum and header.checksum != entry.checksum:
            raise IntegrityError("record checksum differs from the index")
        # Hash each piece right after reading it, while it is still in the CPU's cache: one
        # pass over memory instead of a read followed by a second pass to verify.
        h = xxhash.xxh3_128()
        for off in range(0, entry.length, READ_PIECE):
            piece = dst[off : off + READ_PIECE]
            n = os.preadv(self._fd, [piece], entry.offset + PAGE + off)
            if n != len(piece):
                raise IntegrityError(f"truncated record: {off + n} of {entry.length} "
                                     "payload bytes")
            h.update(piece)
        if h.digest() != header.checksum:
            raise IntegrityError("payload checksum mismatch")

    def _on_drop(self, entry: BlockEntry) -> None:
        if self.degraded:  # written when the disk takes writes again (`try_recover`); the
            # entry comes back if the daemon restarts first (its bytes verified)
            self._unsynced_drops.append((entry.key, entry.offset))
            return
        try:
            # Unmark the record first, so that an index rebuild never brings it back (not made
            # durable: after a crash a rebuild might; its bytes are still verified).
            os.pwrite(self._fd, bytes(4), entry.offset)
            self._index.delete(entry.key)
        except Exception as e:
            self._degrade(f"index update failed: {one_line(e)}")
            self._unsynced_drops.append((entry.key, entry.offset))

    @property
    def file_bytes(self) -> int:
        return os.fstat(self._fd).st_size

    def close(self) -> None:
        if self._fd >= 0:
            # The clean-close marker lets the next start notice entries lost in silence.
            self._index.close(None if self.degraded else self.committed_blocks)
            os.close(self._fd)
            self._fd = -1
        self._forget_all()
