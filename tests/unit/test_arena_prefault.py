"""The arena's first and last touch. The daemon's prefault (`host_prefault`) backs the arena's
pages ahead of the copies and disk reads into them, and never changes a byte stored there, even
while they run; a client's last mapping of an arena is unmapped by a background thread."""

from __future__ import annotations

import errno
import os
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

import kvstore.arena as arena_mod
from kvstore.arena import Arena
from kvstore.tiers.host import HostTier

MIB = 1 << 20


def resident_bytes(path: Path) -> int:
    """Bytes of this process's mappings of `path` backed by pages now (smaps `Rss`)."""
    total, ours = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            # A mapping's header line names its file ("(deleted)" once it is unlinked).
            ours = line.removesuffix(" (deleted)").endswith(str(path))
        elif ours and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total


@pytest.fixture(params=["madvise", "read-touch"])
def populate_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways `Arena.populate` backs pages: MADV_POPULATE_WRITE, and reading one byte per
    page where the kernel lacks it."""
    monkeypatch.setattr(arena_mod, "_populate_unsupported", request.param == "read-touch")
    return str(request.param)


def test_populate_backs_every_page_and_changes_no_byte(tmp_path: Path, populate_path: str) -> None:
    arena = Arena.create(tmp_path, 32 * MIB)
    try:
        rng = np.random.default_rng(0)
        stored = rng.integers(0, 256, 4 * MIB, dtype=np.uint8)
        arena.array[8 * MIB : 12 * MIB] = stored  # a block already written into the arena
        before = resident_bytes(arena.path)
        assert before < 8 * MIB, "a fresh arena is not backed until touched"
        arena.populate(0, arena.size)
        assert resident_bytes(arena.path) == arena.size
        assert np.array_equal(arena.array[8 * MIB : 12 * MIB], stored)
        assert not arena.array[: 8 * MIB].any()  # fresh pages read as zeros, as before
    finally:
        arena.unlink()


def test_populate_beside_writers_loses_none_of_their_bytes(tmp_path: Path,
                                                           populate_path: str) -> None:
    """Copies into the arena (a client's save, the daemon's disk reads) run while the
    prefault passes over the same pages: every byte they wrote is still there."""
    arena = Arena.create(tmp_path, 64 * MIB)
    stop = threading.Event()
    written: list[tuple[int, int]] = []

    def writer() -> None:
        i = 0
        while not stop.is_set():
            off = (i * 257 * 4096) % (arena.size - 4096)
            value = i % 255 + 1
            arena.array[off : off + 4096] = value
            written.append((off, value))
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    try:
        for _ in range(3):
            for off in range(0, arena.size, 4 * MIB):
                arena.populate(off, 4 * MIB)
    finally:
        stop.set()
        t.join()
    try:
        assert written
        last: dict[int, int] = {}
        for off, value in written:
            last[off] = value
        for off, value in last.items():
            assert (arena.array[off : off + 4096] == value).all(), f"bytes at {off} changed"
    finally:
        arena.unlink()


def test_host_tier_prefaults_its_arena_in_the_background(tmp_path: Path) -> None:
    tier = HostTier(48 * MIB, shm_dir=tmp_path)
    try:
        assert tier.prefaulted_bytes == 0
        tier.start_prefault()
        deadline = time.monotonic() + 60
        while tier.prefaulted_bytes < tier.arena.size and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tier.prefaulted_bytes == tier.arena.size
        assert resident_bytes(tier.arena.path) == tier.arena.size
    finally:
        tier.close()


def test_closing_a_host_tier_stops_its_prefault_before_the_arena_goes(tmp_path: Path) -> None:
    tier = HostTier(512 * MIB, shm_dir=tmp_path)
    tier.start_prefault()
    thread = tier._prefault_thread
    assert thread is not None
    tier.close()
    assert not thread.is_alive()
    assert not tier.arena.path.exists()
    assert tier.prefaulted_bytes % (32 * MIB) == 0 or tier.prefaulted_bytes == tier.arena.size


def test_the_last_reference_to_an_arena_is_unmapped_off_the_callers_thread(tmp_path: Path,
                                                                          ) -> None:
    """A client drops a restarted daemon's old arena inside its next call; unmapping the last
    mapping of an unlinked file frees all its pages (0.67 s for 4 GiB here), so that happens
    in a background thread, not in the caller."""
    owner = Arena.create(tmp_path, 8 * MIB)
    mapped = Arena.attach(owner.path, owner.size)  # a client's mapping
    mapped.populate(0, mapped.size)
    unmapped_on: list[str] = []
    done = threading.Event()

    def record() -> None:
        unmapped_on.append(threading.current_thread().name)
        done.set()

    weakref.finalize(mapped._mmap, record)
    name = owner.path.name
    owner.unlink()
    del owner, mapped
    assert done.wait(10), "the mapping was never released"
    assert unmapped_on == ["kvstore-arena-unmap"]
    assert name not in Path("/proc/self/maps").read_text()


def test_a_forked_child_unmaps_its_arenas_itself(tmp_path: Path) -> None:
    """The parent's unmapping thread does not exist in a forked child: an arena the child
    inherited is unmapped as it is dropped there, never queued for a thread that never runs."""
    owner = Arena.create(tmp_path, 8 * MIB)
    mapped = Arena.attach(owner.path, owner.size)  # the parent's reaper runs from here on
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 only if the mapping went at once
        try:
            gone = threading.Event()
            weakref.finalize(mapped._mmap, gone.set)
            del mapped
            os._exit(0 if gone.is_set() else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    owner.unlink()
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_block_about_to_be_read_into_is_backed_first(tmp_path: Path) -> None:
    """`HostTier.back`: the daemon backs a block's fresh pages before a disk read into them
    (`host_prefault` off or not there yet), and only that block's."""
    tier = HostTier(32 * MIB, shm_dir=tmp_path)
    try:
        tier.prepare_store(b"first", b"ns", b"layout", 4 * MIB)  # stays untouched
        entry = tier.prepare_store(b"second", b"ns", b"layout", 4 * MIB)
        assert entry is not None
        before = resident_bytes(tier.arena.path)
        tier.back(entry)
        assert resident_bytes(tier.arena.path) - before == 4 * MIB
    finally:
        tier.close()


def test_a_refused_prefault_stops_and_leaves_the_reads_to_back_their_pages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """The kernel refusing to back pages (ENOMEM in a memory-limited cgroup: a fault this
    machine cannot cause, hence the stand-in) stops the prefault with a warning where it got
    to; `back` before a read then does nothing and the read faults its pages in itself."""
    tier = HostTier(64 * MIB, shm_dir=tmp_path)
    calls: list[int] = []

    def refuse_after_one_step(offset: int, length: int) -> None:
        calls.append(offset)
        if len(calls) > 1:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(tier.arena, "populate", refuse_after_one_step)
    try:
        with caplog.at_level("WARNING", logger="kvstore.tiers.host"):
            tier.start_prefault()
            assert tier._prefault_thread is not None
            tier._prefault_thread.join(30)
        assert tier.prefaulted_bytes == 32 * MIB  # the one step that went through
        assert "prefault stopped at 32.0 MiB" in caplog.text
        entry = tier.prepare_store(b"late", b"ns", b"layout", 4 * MIB)
        assert entry is not None
        tier.back(entry)  # refused too: no exception reaches the read
        tier.memview(entry)[:] = b"\x07" * (4 * MIB)
        assert (tier.arena.array[entry.offset : entry.offset + 4 * MIB] == 7).all()
    finally:
        tier.close()


def test_populate_past_the_end_backs_nothing_and_keeps_madvise(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A range past the arena's end is nothing to back, not a kernel refusal: it must not
    switch the process to the read-touch path for good."""
    monkeypatch.setattr(arena_mod, "_populate_unsupported", False)  # restored after the test
    arena = Arena.create(tmp_path, 8 * MIB)
    try:
        arena.populate(arena.size, 4 * MIB)
        arena.populate(arena.size + 4096, 4096)
        assert not arena_mod._populate_unsupported
        assert resident_bytes(arena.path) == 0
    finally:
        arena.unlink()


def test_pin_without_cuda_says_so_and_changes_nothing(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device exists here: tests/integration/test_hf_cuda.py pins")
    arena = Arena.create(tmp_path, 1 << 20)
    arena.tensor[:8] = 7
    assert arena.pin() is False and not arena.pinned
    assert arena.tensor[:8].tolist() == [7] * 8
    arena.unlink()


def test_after_pin_arenas_every_arena_mapped_is_pinned_in_the_background(tmp_path, monkeypatch):
    # No GPU here: `Arena.pin` stands in (records the call) for cudaHostRegister.
    from kvstore.client import aio

    pinned = []
    done = threading.Event()

    def pin(self) -> bool:
        pinned.append((self.path, threading.current_thread().name))
        done.set()
        return True

    monkeypatch.setattr(Arena, "pin", pin)
    monkeypatch.setattr(aio, "_pin_for_cuda", False)
    first = Arena.create(tmp_path, 1 << 20)
    aio._shared_arena(str(first.path), first.size)
    time.sleep(0.2)
    assert pinned == []  # not asked for: nothing registered
    aio.pin_arenas()
    second = Arena.create(tmp_path, 1 << 20)
    aio._shared_arena(str(second.path), second.size)
    assert done.wait(5)
    assert pinned == [(second.path, "kvstore-arena-pin")]  # off the caller's thread
    first.unlink()
    second.unlink()
