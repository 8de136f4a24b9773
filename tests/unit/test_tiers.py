"""Host, GPU (on CPU) and disk tiers: the two-phase lifecycle, bytes, persistence, damage."""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstore.errors import CapacityError, IntegrityError, InvalidArgumentError
from kvstore.integrity import HEADER_BYTES
from kvstore.tiers.base import PAGE, BlockEntry, Tier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.gpu import GpuTier
from kvstore.tiers.host import HostTier
from kvstore.tiers.slab import SlabTier

NS = b"n" * 32
LAYOUT = b"L" * 32
LENGTH = 5000  # two pages in a slab; a header page plus two on disk


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def payload(i: int, length: int = LENGTH) -> bytes:
    g = torch.Generator().manual_seed(i)
    return bytes(torch.randint(0, 256, (length,), dtype=torch.uint8, generator=g).numpy())


# ---------------------------------------------------------------- memory tiers (host, gpu/cpu)

@pytest.fixture(params=["host", "gpu-on-cpu"])
def slab(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SlabTier]:
    tier: SlabTier
    if request.param == "host":
        tier = HostTier(10 * PAGE, shm_dir=tmp_path)
    else:
        tier = GpuTier(10 * PAGE, device="cpu")
    yield tier
    tier.close()


def store(tier: SlabTier, i: int, length: int = LENGTH) -> BlockEntry:
    entry = tier.prepare_store(key(i), NS, LAYOUT, length)
    assert entry is not None
    tier.memview(entry)[:] = payload(i, length)
    tier.complete_store(entry)
    return entry


def test_slab_store_and_read_back(slab: SlabTier) -> None:
    entry = store(slab, 1)
    assert slab.contains(key(1))
    assert slab.get(key(1)) is entry
    assert entry.offset % PAGE == 0
    assert entry.units == 2
    loaded = slab.prepare_load(key(1))
    assert bytes(slab.memview(loaded)) == payload(1)
    slab.complete_load(loaded)
    s = slab.stats()
    assert (s.blocks, s.used_bytes, s.capacity_bytes, s.pinned_blocks) == (1, 2 * PAGE,
                                                                           10 * PAGE, 0)


def test_slab_blocks_do_not_overlap(slab: SlabTier) -> None:
    entries = [store(slab, i) for i in range(5)]  # fills the 10 pages
    assert slab.prepare_store(key(99), NS, LAYOUT, LENGTH) is None
    for i, e in enumerate(entries):
        assert bytes(slab.memview(e)) == payload(i)


def test_reserved_block_is_invisible(slab: SlabTier) -> None:
    entry = slab.prepare_store(key(1), NS, LAYOUT, LENGTH)
    assert entry is not None
    assert not entry.committed
    assert not slab.contains(key(1))
    assert slab.get(key(1)) is None
    assert list(slab.keys()) == []
    assert slab.next_victim() is None  # in flight: not evictable
    assert not slab.remove(key(1))
    with pytest.raises(InvalidArgumentError):
        slab.prepare_load(key(1))
    with pytest.raises(InvalidArgumentError, match="already present or being written"):
        slab.prepare_store(key(1), NS, LAYOUT, LENGTH)
    assert slab.stats().blocks == 0
    assert slab.stats().used_bytes == 2 * PAGE  # the space is held
    slab.complete_store(entry)
    assert slab.contains(key(1))
    assert list(slab.keys()) == [key(1)]
    assert slab.next_victim() == key(1)


def test_abort_store_returns_space(slab: SlabTier) -> None:
    entries = [slab.prepare_store(key(i), NS, LAYOUT, LENGTH) for i in range(5)]
    assert all(e is not None for e in entries)
    assert slab.prepare_store(key(5), NS, LAYOUT, LENGTH) is None  # full
    slab.abort_store(entries[2])  # type: ignore[arg-type]
    assert key(2) not in slab.entries
    assert slab.stats().used_bytes == 8 * PAGE
    again = slab.prepare_store(key(5), NS, LAYOUT, LENGTH)
    assert again is not None
    assert again.unit == entries[2].unit  # type: ignore[union-attr]
    slab.abort_store(entries[2])  # type: ignore[arg-type]  # twice: a no-op
    assert key(5) in slab.entries


def test_when_landed_tells_each_end_of_a_write_in_flight(slab: SlabTier) -> None:
    # What a fetch waiting for another's promotion relies on: told once, whichever way the
    # write ends (committed, aborted, detached into scratch), and at once if none is in flight.
    told: list[str] = []
    slab.when_landed(key(9), lambda: told.append("none"))  # nothing in flight
    for how in ("commit", "abort", "detach"):
        entry = slab.prepare_store(key(1), NS, LAYOUT, LENGTH)
        assert entry is not None
        slab.when_landed(key(1), lambda h=how: told.append(h))
        assert told[-1] != how  # not before it lands
        if how == "commit":
            slab.complete_store(entry)
            slab.when_landed(key(1), lambda: told.append("committed already"))
            assert slab.remove(key(1))
        elif how == "abort":
            slab.abort_store(entry)
        else:
            space = slab.detach(entry)
            assert space is not None
            slab.free_scratch(space)
    assert told == ["none", "commit", "committed already", "abort", "detach"]


def test_prepare_load_pins_against_eviction(slab: SlabTier) -> None:
    for i in range(3):
        store(slab, i)
    assert slab.next_victim() == key(0)
    e0 = slab.prepare_load(key(0))
    assert slab.next_victim() == key(1)
    assert not slab.remove(key(0))
    assert not slab.evict(key(0))
    e0b = slab.prepare_load(key(0))  # a second reader
    slab.complete_load(e0)
    assert slab.next_victim() == key(1)  # still held by the second reader
    slab.complete_load(e0b)
    assert slab.next_victim() == key(0)
    assert slab.evict(key(0))
    assert not slab.contains(key(0))
    assert slab.stats().evictions == 1


def test_lru_and_touch_chain(slab: SlabTier) -> None:
    for i in range(4):
        store(slab, i)
    slab.touch_chain([key(0), key(1)])
    order = []
    while (victim := slab.next_victim()) is not None:
        order.append(victim)
        assert slab.evict(victim)
    assert order == [key(2), key(3), key(1), key(0)]
    assert slab.stats().used_bytes == 0
    assert slab.alloc.free_units == 10


def test_keys_by_namespace(slab: SlabTier) -> None:
    store(slab, 1)
    other = slab.prepare_store(key(2), b"o" * 32, LAYOUT, 10)
    assert other is not None
    slab.complete_store(other)
    assert set(slab.keys()) == {key(1), key(2)}
    assert list(slab.keys(NS)) == [key(1)]
    assert list(slab.keys(b"o" * 32)) == [key(2)]


def test_block_larger_than_tier_raises(slab: SlabTier) -> None:
    with pytest.raises(CapacityError, match="exceeds"):
        slab.prepare_store(key(1), NS, LAYOUT, 10 * PAGE + 1)
    assert slab.prepare_store(key(1), NS, LAYOUT, 10 * PAGE) is not None


def test_capacity_rounds_down_to_pages() -> None:
    tier = GpuTier(3 * PAGE + 100, device="cpu")
    assert tier.capacity_bytes == 3 * PAGE
    assert tier.alloc.total == 3
    with pytest.raises(InvalidArgumentError):
        GpuTier(-1, device="cpu")


def test_gpu_tier_on_cpu_byte_round_trip() -> None:
    tier = GpuTier(4 * PAGE, device="cpu")
    assert tier.buffer.device.type == "cpu"
    entry = tier.prepare_store(key(7), NS, LAYOUT, 3 * PAGE)
    assert entry is not None
    src = torch.arange(3 * PAGE, dtype=torch.int64).remainder(251).to(torch.uint8)
    tier.view(entry).copy_(src)
    tier.complete_store(entry)
    out = torch.empty_like(src)
    out.copy_(tier.view(tier.prepare_load(key(7))))
    assert torch.equal(out, src)
    tier.close()
    assert tier.buffer.numel() == 0
    assert tier.entries == {}


def test_host_arena_file_mode_and_cleanup(tmp_path: Path) -> None:
    tier = HostTier(4 * PAGE, shm_dir=tmp_path)
    path = tier.arena.path
    assert path.parent == tmp_path
    assert path.exists()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.stat().st_size == 4 * PAGE
    assert not tier.pinned  # no CUDA here
    tier.close()
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []


def test_host_arena_is_shared_with_a_second_mapping(tmp_path: Path) -> None:
    from kvstore.arena import Arena

    tier = HostTier(4 * PAGE, shm_dir=tmp_path)
    entry = store(tier, 3)
    client = Arena.attach(tier.arena.path, tier.arena.size)  # what a same-node client maps
    assert bytes(client.tensor[entry.offset : entry.offset + entry.length].numpy()) == payload(3)
    client.tensor[entry.offset] = 42
    assert int(tier.view(entry)[0]) == 42
    with pytest.raises(ValueError, match="smaller"):
        Arena.attach(tier.arena.path, tier.arena.size + 1)
    tier.close()


def test_two_host_tiers_get_distinct_arenas(tmp_path: Path) -> None:
    a, b = HostTier(PAGE, shm_dir=tmp_path), HostTier(PAGE, shm_dir=tmp_path)
    assert a.arena.path != b.arena.path
    a.close()
    assert b.arena.path.exists()
    b.close()


def test_zero_capacity_host_tier(tmp_path: Path) -> None:
    tier = HostTier(0, shm_dir=tmp_path)
    with pytest.raises(CapacityError):
        tier.prepare_store(key(1), NS, LAYOUT, 1)
    tier.close()
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- disk tier

DISK_CAP = 16 * PAGE  # five 3-page records fit, a sixth does not


def disk_write(tier: DiskTier, i: int, length: int = LENGTH) -> BlockEntry | None:
    entry = tier.prepare_store(key(i), NS, LAYOUT, length)
    if entry is None:
        return None
    tier.write(entry, memoryview(payload(i, length)))
    tier.complete_store(entry)
    return entry


def disk_read(tier: DiskTier, i: int) -> bytes:
    entry = tier.prepare_load(key(i))
    try:
        dst = bytearray(entry.length)
        tier.read_into(entry, memoryview(dst))
        return bytes(dst)
    finally:
        tier.complete_load(entry)


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[DiskTier]:
    tier = DiskTier(tmp_path / "disk", DISK_CAP, sync="never")
    yield tier
    tier.close()


def test_disk_round_trip(disk: DiskTier) -> None:
    entry = disk_write(disk, 1)
    assert entry is not None
    assert entry.units == 3  # header page + two payload pages
    assert disk.contains(key(1))
    assert disk_read(disk, 1) == payload(1)
    assert len(entry.checksum) == 16
    odd = disk_write(disk, 2, length=1)  # tiny and odd-sized payloads too
    assert odd is not None
    assert disk_read(disk, 2) == payload(2, 1)


def test_disk_reserved_record_invisible(disk: DiskTier) -> None:
    entry = disk.prepare_store(key(1), NS, LAYOUT, LENGTH)
    assert entry is not None
    assert not disk.contains(key(1))
    disk.write(entry, memoryview(payload(1)))
    assert not disk.contains(key(1))  # written but not completed
    disk.complete_store(entry)
    assert disk.contains(key(1))


def test_disk_write_length_checked(disk: DiskTier) -> None:
    entry = disk.prepare_store(key(1), NS, LAYOUT, LENGTH)
    assert entry is not None
    with pytest.raises(InvalidArgumentError, match="reserved"):
        disk.write(entry, memoryview(payload(1, LENGTH - 1)))
    disk.write(entry, memoryview(payload(1)))
    disk.complete_store(entry)
    with pytest.raises(InvalidArgumentError, match="destination"):
        disk.read_into(entry, memoryview(bytearray(LENGTH + 1)))


def test_disk_sync_option_validated(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="sync"):
        DiskTier(tmp_path / "d", DISK_CAP, sync="sometimes")
    tier = DiskTier(tmp_path / "d", DISK_CAP, sync="always")
    assert disk_write(tier, 1) is not None
    assert disk_read(tier, 1) == payload(1)
    tier.close()


def test_disk_capacity_enforced_and_file_bounded(disk: DiskTier) -> None:
    for i in range(5):
        assert disk_write(disk, i) is not None
        assert disk.file_bytes <= DISK_CAP
    assert disk.prepare_store(key(5), NS, LAYOUT, LENGTH) is None
    assert disk.file_bytes <= DISK_CAP
    with pytest.raises(CapacityError):
        disk.prepare_store(key(6), NS, LAYOUT, DISK_CAP)  # header page + payload > capacity
    # Evicting makes room; the freed extent is reused, so the file does not grow.
    assert disk.next_victim() == key(0)
    assert disk.evict(key(0))
    assert disk_write(disk, 5) is not None
    assert disk.get(key(5)).unit == 0  # type: ignore[union-attr]
    assert disk.file_bytes <= DISK_CAP
    for i in range(1, 6):
        assert disk_read(disk, i) == payload(i)


def test_disk_reopen_keeps_blocks_and_lru_order(tmp_path: Path) -> None:
    d = tmp_path / "disk"
    tier = DiskTier(d, DISK_CAP, sync="always")
    for i in (3, 1, 4, 2):
        disk_write(tier, i)
    tier.evict(key(1))
    tier.close()
    again = DiskTier(d, DISK_CAP)
    try:
        assert again.dropped_at_open == 0
        assert set(again.keys()) == {key(3), key(4), key(2)}
        assert not again.contains(key(1))
        order = list(again.policy.lru_order())
        assert order == [key(3), key(4), key(2)]  # oldest write first
        assert again.stats().used_bytes == 9 * PAGE
        for i in (3, 4, 2):
            assert disk_read(again, i) == payload(i)
        # Allocation state was rebuilt: a new record lands in the hole key(1) left.
        hole = disk_write(again, 9)
        assert hole is not None
        assert hole.unit == 3
        assert disk_read(again, 9) == payload(9)
        # New writes are newer than everything reloaded.
        assert list(again.policy.lru_order())[-1] == key(9)
    finally:
        again.close()


def test_disk_reopen_with_smaller_capacity_drops_entries_beyond(tmp_path: Path) -> None:
    d = tmp_path / "disk"
    tier = DiskTier(d, DISK_CAP, sync="never")
    entries = [disk_write(tier, i) for i in range(5)]  # units 0-2, 3-5, 6-8, 9-11, 12-14
    assert [e.unit for e in entries] == [0, 3, 6, 9, 12]  # type: ignore[union-attr]
    tier.close()
    small = DiskTier(d, 8 * PAGE)  # units 0..7: only the first two records fit whole
    try:
        assert small.dropped_at_open == 3
        assert set(small.keys()) == {key(0), key(1)}
        assert disk_read(small, 0) == payload(0)
        assert disk_read(small, 1) == payload(1)
        assert small.stats().used_bytes == 6 * PAGE
        assert small.file_bytes <= 8 * PAGE
    finally:
        small.close()
    # The dropped entries are gone from the index for good, even at the old capacity.
    big = DiskTier(d, DISK_CAP)
    try:
        assert set(big.keys()) == {key(0), key(1)}
    finally:
        big.close()


def _corrupt(tier: DiskTier, offset: int, n: int = 1) -> None:
    path = tier.directory / "blocks.dat"
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(n)
        f.seek(offset)
        f.write(bytes(b ^ 0x10 for b in old))


@pytest.mark.parametrize("where", [0, 10, 40, HEADER_BYTES - 1,  # header fields, self-checksum
                                   PAGE, PAGE + 1234, PAGE + LENGTH - 1])  # payload
def test_disk_flipped_byte_detected(disk: DiskTier, where: int) -> None:
    disk_write(disk, 0)
    entry = disk_write(disk, 1)
    assert entry is not None
    _corrupt(disk, entry.offset + where)
    with pytest.raises(IntegrityError):
        disk_read(disk, 1)
    assert disk_read(disk, 0) == payload(0)  # the neighbour is untouched


def test_disk_flipped_padding_after_header_is_harmless(disk: DiskTier) -> None:
    entry = disk_write(disk, 1)
    assert entry is not None
    _corrupt(disk, entry.offset + HEADER_BYTES + 10)  # unused rest of the header page
    assert disk_read(disk, 1) == payload(1)


@pytest.mark.parametrize("keep", [0, 50, PAGE, PAGE + LENGTH - 1])
def test_disk_truncated_file_detected(disk: DiskTier, keep: int) -> None:
    entry = disk_write(disk, 0)
    assert entry is not None
    os.truncate(disk.directory / "blocks.dat", entry.offset + keep)
    with pytest.raises(IntegrityError):
        disk_read(disk, 0)


def test_disk_index_entry_over_garbage_record(disk: DiskTier) -> None:
    entry = disk_write(disk, 0)
    assert entry is not None
    path = disk.directory / "blocks.dat"
    with open(path, "r+b") as f:
        f.seek(entry.offset)
        f.write(os.urandom(PAGE + LENGTH))
    with pytest.raises(IntegrityError):
        disk_read(disk, 0)


def test_disk_record_of_another_key_detected(disk: DiskTier) -> None:
    a = disk_write(disk, 0)
    b = disk_write(disk, 1)
    assert a is not None
    assert b is not None
    # A record copied over another (a misdirected write): self-consistent, wrong key.
    path = disk.directory / "blocks.dat"
    data = path.read_bytes()
    with open(path, "r+b") as f:
        f.seek(b.offset)
        f.write(data[a.offset : a.offset + PAGE + LENGTH])
    with pytest.raises(IntegrityError):
        disk_read(disk, 1)


def test_disk_unreadable_index_value_dropped_at_open(tmp_path: Path) -> None:
    from rocksdict import Options, Rdict

    d = tmp_path / "disk"
    tier = DiskTier(d, DISK_CAP)
    disk_write(tier, 0)
    disk_write(tier, 1)
    tier.close()
    db = Rdict(str(d / "index"), Options(raw_mode=True))
    db.put(key(1), b"garbage")
    # An entry whose extent overlaps key(0)'s record (units 0-2).
    db.put(key(7), struct.pack("<QQQ32s32s16s", 99, 1, LENGTH, NS, LAYOUT, bytes(16)))
    db.close()
    again = DiskTier(d, DISK_CAP)
    try:
        assert again.dropped_at_open == 2
        assert set(again.keys()) == {key(0)}
        assert disk_read(again, 0) == payload(0)
    finally:
        again.close()


def test_disk_remove_deletes_index_entry(tmp_path: Path) -> None:
    d = tmp_path / "disk"
    tier = DiskTier(d, DISK_CAP)
    disk_write(tier, 0)
    disk_write(tier, 1)
    assert tier.remove(key(0))
    aborted = tier.prepare_store(key(2), NS, LAYOUT, LENGTH)
    assert aborted is not None
    tier.abort_store(aborted)
    tier.close()
    again = DiskTier(d, DISK_CAP)
    try:
        assert set(again.keys()) == {key(1)}
    finally:
        again.close()


def test_every_tier_is_a_tier(tmp_path: Path) -> None:
    host = HostTier(PAGE, shm_dir=tmp_path)
    disk = DiskTier(tmp_path / "d", PAGE * 2)
    try:
        for t in (host, GpuTier(PAGE, device="cpu"), disk):
            assert isinstance(t, Tier)
            assert t.stats().name == t.name
    finally:
        host.close()
        disk.close()


def _walked_counts(tier: Tier) -> tuple[int, dict[bytes, list[int]]]:
    by_ns: dict[bytes, list[int]] = {}
    for e in tier.entries.values():
        if e.committed:
            c = by_ns.setdefault(e.namespace, [0, 0])
            c[0] += 1
            c[1] += e.length
    return sum(c[0] for c in by_ns.values()), by_ns


def test_kept_counts_equal_a_walk_of_the_blocks(tmp_path: Path):
    """Stats, metrics and Inspect read counts the tiers keep as blocks come and go: after
    every kind of change, and after a disk tier is reopened, they equal a walk of the blocks."""
    import random

    rng = random.Random(3)
    disk = DiskTier(tmp_path / "disk", 40 * 3 * PAGE, sync="never")
    host = HostTier(12 * 2 * PAGE, str(tmp_path))
    try:
        for tier in (host, disk):
            for i in range(300):
                k, ns = key(rng.randrange(40)), bytes([rng.randrange(3)]) * 32
                op = rng.random()
                if op < 0.5 and k not in tier.entries:
                    entry = tier.prepare_store(k, ns, LAYOUT, LENGTH - rng.randrange(100))
                    if entry is None:
                        victim = tier.next_victim()
                        if victim is not None:
                            tier.evict(victim)
                        continue
                    if rng.random() < 0.2:
                        tier.abort_store(entry)
                    else:
                        if isinstance(tier, DiskTier):
                            tier.write(entry, memoryview(payload(i, entry.length)))
                        tier.complete_store(entry)
                elif op < 0.8:
                    tier.evict(k)
                else:
                    tier.remove(k)
                assert (tier.committed_blocks, tier.by_namespace) == _walked_counts(tier), i
            assert tier.stats().blocks == tier.committed_blocks
        assert disk.committed_blocks > 0  # the walk above was not of an empty tier
        kept = (disk.committed_blocks, dict(disk.by_namespace))
        disk.close()
        assert (disk.committed_blocks, disk.by_namespace) == (0, {})
        disk = DiskTier(tmp_path / "disk", 40 * 3 * PAGE, sync="never")
        assert (disk.committed_blocks, disk.by_namespace) == kept == _walked_counts(disk)
    finally:
        disk.close()
        host.close()
