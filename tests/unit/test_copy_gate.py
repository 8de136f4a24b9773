"""The client's arena prefault waits while a copy runs (`_CopyGate`): touching pages beside a
warm fetch's copy slowed that copy, the thing the prefault exists to speed up."""

from __future__ import annotations

import threading

import pytest

from kvstore.client.aio import _copies, _CopyGate, prefault_paused


def test_the_prefault_waits_for_running_copies_and_resumes_after() -> None:
    gate = _CopyGate()
    copying, release, resumed = threading.Event(), threading.Event(), threading.Event()

    def copy(tag: str) -> int:
        copying.set()
        assert release.wait(5)
        return len(tag)

    def prefault() -> None:
        gate.wait_idle()
        resumed.set()

    runner = threading.Thread(target=lambda: gate.run(copy, "abc"))
    runner.start()
    assert copying.wait(5)
    waiter = threading.Thread(target=prefault)
    waiter.start()
    assert not resumed.wait(0.2)  # a copy runs: the prefault waits
    release.set()
    runner.join(5)
    assert resumed.wait(5)  # the copy ended: the prefault goes on
    waiter.join(5)
    assert gate.run(copy, "abcd") == 4  # the copy's result is passed through


def test_a_copy_that_raises_still_opens_the_gate() -> None:
    gate = _CopyGate()

    def broken() -> int:
        raise RuntimeError("copy failed")

    with pytest.raises(RuntimeError, match="copy failed"):
        gate.run(broken)
    done = threading.Event()
    threading.Thread(target=lambda: (gate.wait_idle(), done.set())).start()
    assert done.wait(5)


def test_an_engines_prefill_holds_the_prefault_off_too() -> None:
    """`prefault_paused` (held by `CachedPrefill.prefill`): the prefault's page faults beside
    a forward pass slowed it 4-5x; it waits until the last holder, copies included, is done."""
    resumed = threading.Event()
    with prefault_paused():
        waiter = threading.Thread(target=lambda: (_copies.wait_idle(), resumed.set()))
        waiter.start()
        assert _copies.run(lambda: 7) == 7  # a copy inside the prefill ends: still held
        assert not resumed.wait(0.2)
    assert resumed.wait(5)
    waiter.join(5)
