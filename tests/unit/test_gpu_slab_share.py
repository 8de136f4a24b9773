"""`GpuTier.share`: what a same-node client maps the slab by, and a slab that cannot be
shared (the host path then serves its blocks; the daemon's Info must still answer)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvstore.client.slab import map_slab
from kvstore.proto import kvstore_pb2 as pb
from kvstore.tiers.gpu import GpuTier

SIZE = 1 << 20


def test_a_cpu_slab_is_a_shared_file_a_client_maps_and_close_removes(tmp_path: Path) -> None:
    tier = GpuTier(SIZE, "cpu", shm_dir=tmp_path)
    share = tier.share()
    assert share is not None and share == tier.share()  # made once
    assert share["device"] == "cpu" and share["size"] == SIZE and share["id"] == tier.slab_id
    assert Path(share["path"]).parent == tmp_path and Path(share["path"]).exists()
    tier.buffer[123] = 45  # the daemon's write is the client's read: one memory
    mapped = map_slab(pb.Slab(**share))
    assert mapped is not None and int(mapped.tensor[123]) == 45
    tier.close()
    assert not Path(share["path"]).exists()


def test_a_private_cpu_slab_is_not_shared() -> None:
    assert GpuTier(SIZE, "cpu").share() is None


def test_a_slab_that_cannot_be_shared_is_logged_once_and_served_through_host(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Stands in for a CUDA allocation IPC cannot export, which a CPU cannot produce.
    tier = GpuTier(SIZE, "cpu", shm_dir=tmp_path)
    calls = []

    def refuse() -> None:
        calls.append(1)
        raise RuntimeError("not exportable")

    monkeypatch.setattr(tier, "_share", refuse)
    with caplog.at_level(logging.WARNING):
        assert tier.share() is None and tier.share() is None
    assert calls == [1]
    assert [r.getMessage() for r in caplog.records if "cannot be shared" in r.getMessage()] \
        and "not exportable" in caplog.text
    tier.close()


def test_a_client_refusing_slabs_maps_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           ) -> None:
    tier = GpuTier(SIZE, "cpu", shm_dir=tmp_path)
    share = tier.share()
    assert share is not None
    monkeypatch.setenv("KVCLIENT_SLAB", "0")
    assert map_slab(pb.Slab(**share)) is None
    tier.close()
