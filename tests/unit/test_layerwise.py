"""`LayerwiseLoad`: a load copied layer by layer beside the forward (vLLM's
`kvstore.layerwise_load`): a layer's wait returns once that layer is in place, waiting threads
copy unclaimed layers, a stopped or failed copy releases every waiter, and a fetch that
hands its blocks over in several calls releases layers only when it is over."""

from __future__ import annotations

import threading
import time

import pytest

from kvstore.client.integrations.layerwise import LayerwiseLoad


def _start(target, *args) -> threading.Thread:
    t = threading.Thread(target=target, args=args, daemon=True)
    t.start()
    return t


def test_a_layer_is_released_as_soon_as_it_is_copied() -> None:
    """Layer 0 copied, layer 1 still being copied: a wait for layer 0 returns, one for layer
    1 does not (and, with nothing left to claim but layers after it, copies those)."""
    load = LayerwiseLoad(3)
    gate = threading.Event()
    claimed: list[int] = []

    def copy(layer: int, part: int) -> bool:
        claimed.append(layer)
        if layer == 1:  # the loader is slow in layer 1
            gate.wait(10)
        return True

    result: list[bool] = []
    loader = _start(lambda: result.append(load.copy_all(copy, signal=True)))
    while 1 not in claimed:
        time.sleep(0.001)
    load.wait(0)  # layer 0 is in place: returns at once
    released = threading.Event()
    _start(lambda: (load.wait(1), released.set()))
    assert not released.wait(0.2)
    assert claimed == [0, 1, 2] and load.helped == 1  # the waiter copied layer 2 meanwhile
    gate.set()
    assert released.wait(10)
    loader.join(10)
    assert result == [True]


def test_a_waiting_thread_copies_layers_nobody_claimed() -> None:
    """The loader is stuck in layer 0; the forward, waiting for layer 3, copies 1, 2 and 3
    itself and goes on without waiting for layer 0's copy."""
    load = LayerwiseLoad(4)
    stuck = threading.Event()
    by: dict[int, str] = {}

    def copy(layer: int, part: int) -> bool:
        by[layer] = threading.current_thread().name
        if layer == 0:
            stuck.wait(10)
        return True

    result: list[bool] = []
    loader = threading.Thread(target=lambda: result.append(load.copy_all(copy, True)),
                              name="loader")
    loader.start()
    while 0 not in by:
        time.sleep(0.001)
    load.wait(3)  # returns only once layer 3 is copied: by this thread
    assert by == {0: "loader", 1: threading.current_thread().name,
                  2: threading.current_thread().name, 3: threading.current_thread().name}
    assert load.helped == 3
    assert loader.is_alive()  # copy_all waits for layer 0 (its own) before it returns
    stuck.set()
    loader.join(10)
    assert result == [True]


@pytest.mark.parametrize("how", ["stopped", "raises"])
def test_a_copy_that_stops_releases_every_waiter_once_the_fetch_is_over(how: str) -> None:
    load = LayerwiseLoad(3)

    def copy(layer: int, part: int) -> bool:
        if layer == 1:
            if how == "raises":
                raise RuntimeError("the copy routine failed")
            return False
        return True

    assert load.copy_all(copy, signal=True) is False
    released = threading.Event()
    _start(lambda: (load.wait(2), released.set()))
    assert not released.wait(0.2)  # layer 2 was never copied: not ready
    whole = threading.Event()
    _start(lambda: (load.wait(None), whole.set()))  # a layer not ours: the whole load
    assert not whole.wait(0.2)
    load.finish()  # the fetch returned: the caller reports what it did not bring
    assert released.wait(10)
    assert whole.wait(10)


def test_calls_that_cover_part_of_the_blocks_release_layers_only_at_the_end() -> None:
    """A disk hit comes in several calls: a layer copied for the first call's blocks is not
    ready (the second call's blocks of it are not there yet)."""
    load = LayerwiseLoad(2)
    assert load.copy_all(lambda layer, part: True, signal=False)
    released = threading.Event()
    _start(lambda: (load.wait(0), released.set()))
    assert not released.wait(0.2)
    assert load.copy_all(lambda layer, part: True, signal=False)
    assert not released.is_set()
    load.finish()
    assert released.wait(10)


def test_a_layer_in_parts_is_ready_once_every_part_is() -> None:
    """Pieces go out layer-major (layer 0's parts, then layer 1's); layer 0 is not ready while
    one of its parts is still being copied, and is once it is."""
    load = LayerwiseLoad(2)
    held = threading.Event()
    order: list[tuple[int, int]] = []

    def copy(layer: int, part: int) -> bool:
        order.append((layer, part))
        if (layer, part) == (0, 2):
            held.wait(10)
        return True

    result: list[bool] = []
    loader = _start(lambda: result.append(load.copy_all(copy, signal=True, parts=3)))
    while (0, 2) not in order:
        time.sleep(0.001)
    released = threading.Event()
    _start(lambda: (load.wait(0), released.set()))
    assert not released.wait(0.2)
    held.set()
    assert released.wait(10)
    loader.join(10)
    assert result == [True]
    assert order == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert load.pieces == 6
