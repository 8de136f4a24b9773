"""The vLLM connector's save queue when it is full: a save that does not fit is turned away at
once (the engine's step never waits for a slow save), nothing is left pending for it, it is
counted, and only the first drop of a period is logged; the saves queued before it still run,
in order."""

from __future__ import annotations

import importlib.util
import logging
import threading
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed in this interpreter: run `bash scripts/setup_vllm.sh`",
                allow_module_level=True)

from kvstore.client.backoff import LogThrottle
from kvstore.client.integrations.vllm import KVStoreConnector, _Saver

pytestmark = [pytest.mark.vllm]


def spec(req_id: str) -> SimpleNamespace:
    return SimpleNamespace(req_id=req_id)  # `_Saver` reads only the request id


@pytest.mark.timeout(60)
def test_full_queue_drops_at_once_counts_and_logs_once(caplog: pytest.LogCaptureFixture,
                                                       ) -> None:
    started, release = threading.Event(), threading.Event()
    ran: list[str] = []

    def save(s: SimpleNamespace, queued: float) -> None:
        started.set()
        assert release.wait(30), "the test never released the save"
        ran.append(s.req_id)

    saver = _Saver(save, maxsize=1)
    # A connector with only what the drop path reads (no engine behind it).
    conn = KVStoreConnector.__new__(KVStoreConnector)
    conn._drops, conn._cfg = LogThrottle(60.0), SimpleNamespace(save_queue=1)
    try:
        assert saver.submit(spec("a"))
        assert started.wait(10)  # "a" is running: the queue is empty again
        assert saver.submit(spec("b"))  # waits in the queue's one slot
        caplog.set_level(logging.WARNING, logger="kvstore.vllm")
        for req in ("c", "d"):
            assert not saver.submit(spec(req))  # full: refused without blocking
            assert not saver.pending(req)  # vLLM may free its blocks at once
            conn._dropped(req)
        assert conn.dropped_saves == 2
        warnings = [m for m in (r.getMessage() for r in caplog.records) if "save queue full" in m]
        assert len(warnings) == 1 and "request c" in warnings[0], warnings
        assert saver.pending("a") and saver.pending("b")
        assert not saver.wait(["a", "b"], timeout=0.2)  # still held by the blocked save
        release.set()
        assert saver.wait(["a", "b"], timeout=10)
        assert ran == ["a", "b"]
    finally:
        release.set()
        assert saver.close(timeout=10)
