"""The disk tier's index (RocksDB via `rocksdict`), how damage to it is detected, and how it is
rebuilt from the data file.

The index maps key -> where the key's record lies (`Row`). It is only a cache of what the data
file says: every record is self-describing (framed header: key, layout, length, checksum; then,
in the rest of its header page, `RecordExt`: write sequence and namespace), so a damaged index
is moved aside and rebuilt by scanning the file and verifying each record in full. Nothing
unverified is ever indexed, and reads verify again anyway.

Damage is detected, not assumed away:
- opening fails (a flipped, truncated or deleted SST, MANIFEST or CURRENT: RocksDB refuses);
- iterating with checksum verification ends with an error status (a flipped data block: the
  plain iterator just stops early, and half the entries would vanish in silence);
- the index is empty and was never marked as created by kvstore, while the data file holds
  bytes (the index directory deleted, or a MANIFEST cut back to nothing);
- iterating finds fewer entries than the count written at the last clean close.
A filesystem that cannot be written (read-only, full) is not damage: the index is then opened
read-only and the tier serves what it holds without taking writes.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import xxhash
from rocksdict import AccessType, Options, Rdict, ReadOptions, WriteBatch, WriteOptions

from kvstore.errors import IntegrityError
from kvstore.integrity import HEADER_BYTES, decode_header
from kvstore.tiers.base import PAGE

log = logging.getLogger(__name__)

READ_PIECE = 8 << 20  # bytes read, then hashed, at a time: big for readahead, cache-sized
_ROW = struct.Struct("<QQQ32s32s16s")  # seq, unit, length, namespace, layout digest, checksum
_EXT = struct.Struct("<4sQ32s")  # magic, write sequence, namespace
_EXT_SUM = struct.Struct("<Q")  # xxh3-64 of the framed header + the fields above
EXT_MAGIC = b"KVSX"
EXT_BYTES = _EXT.size + _EXT_SUM.size
KEY_BYTES = 32
# Meta keys are not 32 bytes long, so they never collide with a block key.
META_CREATED = b"\x00kvstore:created"  # written once, when kvstore creates the index
META_CLEAN = b"\x00kvstore:clean"  # entry count at a clean close; deleted at open


@dataclass(frozen=True)
class Row:
    seq: int
    key: bytes
    unit: int
    length: int
    namespace: bytes
    layout_digest: bytes
    checksum: bytes

    def pack(self) -> bytes:
        return _ROW.pack(self.seq, self.unit, self.length, self.namespace, self.layout_digest,
                         self.checksum)

    @classmethod
    def unpack(cls, key: bytes, value: bytes) -> Row:
        seq, unit, length, ns, layout, csum = _ROW.unpack(value)
        return cls(seq, key, unit, length, ns, layout, csum)


def encode_ext(header: bytes, seq: int, namespace: bytes) -> bytes:
    """What follows the framed header in a record's header page (bound to that header)."""
    body = _EXT.pack(EXT_MAGIC, seq, namespace)
    return body + _EXT_SUM.pack(xxhash.xxh3_64_intdigest(header + body))


def decode_ext(page: bytes) -> tuple[int, bytes] | None:
    """(seq, namespace) from a header page, or None (records written before it existed)."""
    raw = page[HEADER_BYTES : HEADER_BYTES + EXT_BYTES]
    if len(raw) < EXT_BYTES:
        return None
    body, (digest,) = raw[: _EXT.size], _EXT_SUM.unpack(raw[_EXT.size :])
    if xxhash.xxh3_64_intdigest(page[:HEADER_BYTES] + body) != digest:
        return None
    magic, seq, namespace = _EXT.unpack(body)
    return (seq, namespace) if magic == EXT_MAGIC else None


def one_line(e: BaseException) -> str:
    """An error's text on one line (RocksDB's messages span several): one log line per event."""
    return " ".join(str(e).split())


class IndexDamagedError(Exception):
    """The index cannot be trusted; the message says why."""


@dataclass
class ScanResult:
    rows: list[Row]
    damaged: int  # records whose header is intact but whose payload or extension is not
    old_format: int  # intact records without a namespace extension: not brought back
    seconds: float


def scan_records(fd: int, file_bytes: int) -> ScanResult:
    """Every intact record of the data file, verified in full; one row per key (the latest
    write wins). Free space and torn records are stepped over a page at a time."""
    began = time.perf_counter()
    best: dict[bytes, Row] = {}
    damaged = old = 0
    piece = bytearray(READ_PIECE)
    off = 0
    while off + PAGE <= file_bytes:
        page = os.pread(fd, PAGE, off)
        try:
            header = decode_header(page)
        except IntegrityError:
            off += PAGE
            continue
        units = 1 + -(-header.length // PAGE)
        if header.length == 0 or off + PAGE + header.length > file_bytes:
            damaged += 1  # a header whose payload the file does not hold
            off += PAGE
            continue
        ext = decode_ext(page)
        h = xxhash.xxh3_128()
        pos, end = off + PAGE, off + PAGE + header.length
        while pos < end:
            view = memoryview(piece)[: min(READ_PIECE, end - pos)]
            n = os.preadv(fd, [view], pos)
            if n <= 0:
                break
            h.update(view[:n])
            pos += n
        if pos != end or h.digest() != header.checksum:
            damaged += 1
            off += PAGE  # a torn record: a later one may start inside it
            continue
        if ext is None:
            old += 1
        else:
            seq, namespace = ext
            row = Row(seq, header.key, off // PAGE, header.length, namespace,
                      header.layout_digest, header.checksum)
            if header.key not in best or best[header.key].seq < seq:
                best[header.key] = row
        off += units * PAGE
    return ScanResult(sorted(best.values(), key=lambda r: r.unit), damaged, old,
                      time.perf_counter() - began)


class Index:
    """The RocksDB index of one disk tier: opened read-write when the filesystem allows,
    read-only otherwise (`writable`), or absent (`db` None) when neither works and the rows
    were rebuilt in memory."""

    def __init__(self, path: Path, sync: bool) -> None:
        self.path = path
        self.db: Rdict | None = None
        self.writable = False
        self.read_only_reason = ""  # why it is not writable, for the tier's `degraded`
        self.malformed = 0  # entries whose value did not parse at load (deleted, a miss)
        self._copy: Path | None = None  # a private copy opened read-only (see `open`)
        self.wopts = WriteOptions()
        self.wopts.sync = sync

    @staticmethod
    def _options() -> Options:
        opts = Options(raw_mode=True)
        opts.set_paranoid_checks(True)
        return opts

    def open(self) -> None:
        """Open read-write, or read-only when the filesystem refuses writes. Raises
        `IndexDamagedError` when neither open works."""
        try:
            self.db = Rdict(str(self.path), self._options())
            self.writable = True
            return
        except Exception as e:  # rocksdict raises plain Exception: IO error, Corruption, ...
            rw_error = one_line(e)
        self.read_only_reason = f"index cannot be opened for writing: {rw_error}"
        ro = self._options(), AccessType.read_only(False)
        try:
            self.db = Rdict(str(self.path), ro[0], access_type=ro[1])
            return
        except Exception as e:
            log.debug("disk index: read-only open failed: %s", one_line(e))
        # rocksdict (0.3.29) writes its own config file even to open read-only, which a
        # read-only filesystem refuses: open a private copy of the index instead.
        tmp = Path(tempfile.mkdtemp(prefix="kvstore-index-"))
        try:
            shutil.copytree(self.path, tmp / "index")
            self.db = Rdict(str(tmp / "index"), ro[0], access_type=ro[1])
            self._copy = tmp
        except Exception:
            shutil.rmtree(tmp, ignore_errors=True)
            raise IndexDamagedError(f"cannot be opened: {rw_error}") from None

    def load(self, file_bytes: int) -> list[Row]:
        """Every row, checksums verified; `IndexDamagedError` when the index cannot be trusted.
        Malformed rows are left out (and deleted, when writable)."""
        if self.db is None:
            raise IndexDamagedError("it is not open")
        ropts = ReadOptions()
        ropts.set_verify_checksums(True)
        rows: list[Row] = []
        meta: dict[bytes, bytes] = {}
        bad: list[bytes] = []
        it = self.db.iter(ropts)
        it.seek_to_first()
        while it.valid():
            key, value = it.key(), it.value()
            if len(key) != KEY_BYTES:
                meta[key] = value
            else:
                try:
                    rows.append(Row.unpack(key, value))
                except struct.error:
                    bad.append(key)
            it.next()
        try:
            it.status()  # raises on a checksum mismatch: iteration stopped early
        except Exception as e:
            raise IndexDamagedError(f"reading it failed: {one_line(e)}") from None
        finally:
            del it
        n = len(rows) + len(bad)
        self.malformed = len(bad)
        if META_CREATED not in meta and n == 0 and file_bytes > 0:
            raise IndexDamagedError("it is empty but the data file is not (index lost?)")
        clean = int.from_bytes(meta[META_CLEAN], "little") if META_CLEAN in meta else None
        if clean is not None and n < clean:  # entries lost in silence (more is no loss)
            raise IndexDamagedError(f"it holds {n} entries, {clean} at the last clean close")
        if self.writable:
            try:
                batch = WriteBatch(raw_mode=True)
                for key in bad:
                    batch.delete(key)
                batch.put(META_CREATED, b"1")
                batch.delete(META_CLEAN)  # a crash from now on leaves no clean marker
                self.db.write(batch, self.wopts)
            except Exception as e:
                self.writable = False
                self.read_only_reason = f"index write failed: {one_line(e)}"
        return rows

    def recreate(self, rows: list[Row]) -> None:
        """A fresh index holding `rows` (after the damaged one was moved aside). On failure
        the tier keeps the rows in memory only and takes no writes."""
        try:
            self.db = Rdict(str(self.path), self._options())
            batch = WriteBatch(raw_mode=True)
            for row in rows:
                batch.put(row.key, row.pack())
            batch.put(META_CREATED, b"1")
            sync = WriteOptions()
            sync.sync = True
            self.db.write(batch, sync)
            self.writable = True
            self.read_only_reason = ""  # the damaged index's failed open is over
        except Exception as e:
            self.close(None)
            self.writable = False
            self.read_only_reason = f"rebuilt index cannot be written: {one_line(e)}"

    def quarantine(self) -> Path | None:
        """Move the damaged index aside (kept for a post-mortem); None if it could not be."""
        self.close(None)
        if not self.path.exists():
            return None
        stamp = time.strftime("%Y%m%dT%H%M%S")
        dest = self.path.with_name(f"{self.path.name}.damaged-{stamp}")
        n = 1
        while dest.exists():
            dest = self.path.with_name(f"{self.path.name}.damaged-{stamp}.{n}")
            n += 1
        try:
            os.rename(self.path, dest)
        except OSError as e:
            self.read_only_reason = f"damaged index cannot be moved aside: {e.strerror or e}"
            return None
        return dest

    def reopen_writable(self) -> None:
        """Reopen read-write (after the filesystem took writes again); `OSError` if it still
        cannot be. The rows need no reload: the tier's memory holds them."""
        self.close(None)  # the read-only handle, or the private copy
        try:
            self.db = Rdict(str(self.path), self._options())
        except Exception as e:
            self.writable = False
            raise OSError(errno.EROFS, f"index cannot be opened for writing: {one_line(e)}") \
                from None
        self.writable = True
        self.read_only_reason = ""

    def forget(self, keys: list[bytes]) -> None:
        """Delete `keys` in one synced batch, and mark the index as written since its last
        clean close (an index opened read-only kept that marker)."""
        batch = WriteBatch(raw_mode=True)
        for key in keys:
            batch.delete(key)
        batch.put(META_CREATED, b"1")
        batch.delete(META_CLEAN)
        sync = WriteOptions()
        sync.sync = True
        self._db().write(batch, sync)

    def _db(self) -> Rdict:
        if self.db is None or not self.writable:
            raise OSError(f"disk index is not writable: {self.read_only_reason or 'closed'}")
        return self.db

    def put(self, row: Row) -> None:
        self._db().put(row.key, row.pack(), self.wopts)

    def delete(self, key: bytes) -> None:
        self._db().delete(key, self.wopts)

    def close(self, clean_count: int | None) -> None:
        """Close; with `clean_count`, first record it as the clean-close marker."""
        db, self.db = self.db, None
        if db is None:
            return
        try:
            if clean_count is not None and self.writable:
                sync = WriteOptions()
                sync.sync = True
                db.put(META_CLEAN, clean_count.to_bytes(8, "little"), sync)
        except Exception as e:
            log.warning("disk index: clean-close marker not written: %s", one_line(e))
        try:
            db.close()
        except Exception as e:  # a full disk can fail the final flush; the WAL has it all
            log.warning("disk index: close failed: %s", one_line(e))
        if self._copy is not None:
            shutil.rmtree(self._copy, ignore_errors=True)
            self._copy = None
