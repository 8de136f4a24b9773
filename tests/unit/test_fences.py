"""Fenced reservations (`server.fences`): a zero-copy publish whose lease expired while its
writer process lives keeps its slots out of use, since the writer may still be copying into
them; the key is free again at once, and the slots come back when the writer ends the lease,
dies, or `write_fence_s` passes."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.errors import NotFoundError
from kvstore.server.store import TieredStore
from kvstore.tiers.base import PAGE
from kvstore.tiers.host import HostTier
from kvstore.writer_lock import remove_stale, writer_alive, writer_lock
from tests.unit.test_store import LAYOUT, LENGTH, NS_A, key, payload, publish

BLOCK = 2 * PAGE  # LENGTH in host pages


def make(tmp_path: Path, fence_s: float = 600.0) -> tuple[TieredStore, list[float]]:
    store = TieredStore(HostTier(4 * BLOCK, shm_dir=tmp_path), None, lease_timeout_s=1.0,
                        io_threads=1, write_fence_s=fence_s)
    now = [1000.0]
    store.clock = lambda: now[0]  # stepped by hand
    return store, now


def dead_writer(directory: Path) -> str:
    """A writer lock left by a process that died without removing it (as after SIGKILL)."""
    code = ("import os, sys; from kvstore.writer_lock import writer_lock; "
            "print(writer_lock(sys.argv[1])); sys.stdout.flush(); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code, str(directory)], check=True,
                         capture_output=True, text=True)
    name = out.stdout.strip()
    assert (directory / name).exists()
    return name


def expire(store: TieredStore, now: list[float], writer: str, keys: list[bytes]) -> int:
    """Reserve `keys` for `writer`, let the lease expire; returns the lease id."""
    lease = asyncio.run(store.reserve(NS_A, LAYOUT, keys, LENGTH, writer=writer))
    assert len(lease.entries) == len(keys)
    now[0] += 1.01
    assert store.reap_expired() == 1
    assert store.leases == {}
    return lease.id


def test_a_live_writers_expired_space_is_never_handed_to_another_block(tmp_path: Path) -> None:
    store, now = make(tmp_path)
    me = writer_lock(tmp_path)
    old = asyncio.run(store.reserve(NS_A, LAYOUT, [key(0), key(1)], LENGTH, writer=me))
    old_offsets = {e.offset for e in old.entries}
    now[0] += 1.01
    assert store.reap_expired() == 1
    assert store.counters.expired_leases == 1 and store.fences.fenced_total == 1
    assert store.fences.nbytes == 2 * BLOCK
    assert store.host.stats().used_bytes == 2 * BLOCK  # held, under no key
    # The keys are free at once, and what is written now goes elsewhere.
    again = asyncio.run(publish(store, [key(0), key(1)]))
    assert again.needed == [True, True]
    assert {e.offset for e in again.entries}.isdisjoint(old_offsets)
    # The tier is full: a third block evicts one of the new ones, never takes fenced space.
    asyncio.run(publish(store, [key(2)]))
    assert store.host.stats().used_bytes <= 4 * BLOCK
    for e in [*again.entries]:
        if store.host.contains(e.key):
            assert bytes(store.host.memview(e)) == payload(e.key)
    now[0] += 100
    assert store.reap_expired() == 0 and store.fences.nbytes == 2 * BLOCK  # still alive
    # The writer's copy is over when it ends the lease: Release answers "expired", frees.
    assert store.release(old.id, owner="another tenant") is False
    assert store.fences.nbytes == 2 * BLOCK  # only the lease's own tenant ends it
    assert store.release(old.id) is False
    assert store.fences.nbytes == 0
    assert store.host.stats().used_bytes == store.host.committed_blocks * BLOCK
    store.close()


def test_a_fenced_writers_commit_fails_and_frees_the_space(tmp_path: Path) -> None:
    store, now = make(tmp_path)
    lease_id = expire(store, now, writer_lock(tmp_path), [key(0)])
    assert store.fences.nbytes == BLOCK
    with pytest.raises(NotFoundError):
        store.commit(lease_id)
    assert store.fences.nbytes == 0 and not store.host.contains(key(0))
    store.close()


def test_a_dead_writers_space_comes_back_at_expiry(tmp_path: Path) -> None:
    store, now = make(tmp_path)
    writer = dead_writer(tmp_path)
    expire(store, now, writer, [key(0), key(1)])
    assert store.fences.fenced_total == 1 and store.fences.nbytes == 0
    assert store.host.stats().used_bytes == 0
    assert not (tmp_path / writer).exists()  # the dead writer's file went with it
    store.close()


def test_the_fence_ends_after_write_fence_s(tmp_path: Path) -> None:
    store, now = make(tmp_path, fence_s=60.0)
    expire(store, now, writer_lock(tmp_path), [key(0)])
    now[0] += 58
    store.reap_expired()
    assert store.fences.nbytes == BLOCK
    now[0] += 2
    store.reap_expired()
    assert store.fences.nbytes == 0 and store.host.stats().used_bytes == 0
    store.close()


@pytest.mark.parametrize("writer", ["", "fence off", "../../etc/passwd"])
def test_no_fence_without_a_writer_or_with_fencing_off(tmp_path: Path, writer: str) -> None:
    """No writer named (a raw client), a name that is no writer lock, or `write_fence_s` 0:
    the space is reused at expiry, as before fencing."""
    store, now = make(tmp_path, fence_s=0.0 if writer == "fence off" else 600.0)
    name = writer_lock(tmp_path) if writer == "fence off" else writer
    expire(store, now, name, [key(0)])
    assert store.fences.nbytes == 0 and store.host.stats().used_bytes == 0
    store.close()


def test_the_daemon_removes_dead_writers_lock_files_not_live_ones(tmp_path: Path) -> None:
    dead = dead_writer(tmp_path)
    live = writer_lock(tmp_path)
    assert writer_lock(tmp_path) == live  # one per process and directory
    (tmp_path / f".{dead}.new").touch()  # one that died while making its file
    assert remove_stale(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [live]
    assert writer_alive(tmp_path, live)


def test_a_writer_lock_that_cannot_be_made_is_empty_and_logged_once(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """No directory to make it in (the arena's directory is not this process's to write):
    Reserve names no writer, so its space is reused at expiry, as before fencing."""
    missing = tmp_path / "not-there"
    with caplog.at_level("WARNING", logger="kvstore.writer_lock"):
        assert writer_lock(missing) == ""
        assert writer_lock(missing) == ""  # tried once per process and directory
    assert len([r for r in caplog.records if "cannot make a writer lock" in r.message]) == 1
