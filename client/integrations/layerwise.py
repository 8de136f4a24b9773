"""A load copied into an engine's cache one layer at a time, beside the forward pass.

vLLM calls the connector's `wait_for_layer_load(layer)` in each attention layer before it
reads that layer's cache. A `LayerwiseLoad` lets that wait return as soon as the layer's K/V
are in place, so the forward of the first layers runs while the later ones are still being
copied. A thread that must wait helps instead: it copies the next layer nobody has claimed,
so the forward's CPUs are never idle while the load they wait for is still going.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("kvstore.vllm")


class LayerwiseLoad:
    """One fetch's copy into the engine's pages, layer by layer, shared by the thread that
    fetches (`copy_all`) and the forward's threads (`wait`).

    `copy_all` may run several times for one fetch (a fetch hands its blocks over in several
    calls when they come from disk or a remote tier); only a call that covers every block of
    the load (`signal`) marks layers ready as they complete. The others' layers are ready
    when the fetch is over (`finish`): whatever it brought, the forward must not wait longer,
    and the caller reports what the fetch did not bring as failed."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._cond = threading.Condition()
        self._ready = [False] * num_layers
        self._over = False
        # The call of `copy_all` in progress: its copy, its parts per layer, the next piece
        # (layer-major) to claim, each layer's pieces not yet copied, pieces being copied,
        # whether one failed, whether completed layers are ready.
        self._copy: Callable[[int, int], bool] | None = None
        self._parts = 1
        self._next = 0
        self._left: list[int] = []
        self._copying = 0
        self._failed = False
        self._signal = False
        self.pieces = 0  # pieces copied, by anyone
        self.helped = 0  # of those, pieces the forward's threads copied

    def copy_all(self, copy: Callable[[int, int], bool], signal: bool, parts: int = 1) -> bool:
        """Copy every layer, in `parts` pieces each, with `copy(layer, part)` (False: stopped,
        e.g. by a deadline), helped by threads in `wait`; True when every piece was copied.
        Returns once no piece of this call is being copied any more (by this thread or a
        helper). Small pieces let a helper go back to its forward soon after its layer is
        ready."""
        with self._cond:
            self._copy, self._parts, self._next, self._copying = copy, parts, 0, 0
            self._left = [parts] * self.num_layers
            self._failed, self._signal = False, signal
            self._cond.notify_all()
        while self._copy_one(helping=False):
            pass
        with self._cond:
            self._cond.wait_for(lambda: self._copying == 0)
            ok = not self._failed and not any(self._left)
            self._copy = None
            return ok

    def finish(self) -> None:
        """The fetch is over: no layer is waited for any longer."""
        with self._cond:
            self._over = True
            self._cond.notify_all()

    def wait(self, layer: int | None) -> None:
        """Return once `layer` is in place (None: none is waited for) or the fetch is over;
        meanwhile copy the pieces nobody has claimed yet."""
        def done() -> bool:
            return self._over or (layer is not None and self._ready[layer])

        while True:
            with self._cond:
                self._cond.wait_for(lambda: done() or self._claimable())
                if done():
                    return
            self._copy_one(helping=True)

    def _claimable(self) -> bool:
        return (self._copy is not None and not self._failed
                and self._next < self.num_layers * self._parts)

    def _copy_one(self, helping: bool) -> bool:
        """Claim the next piece and copy it; False when there was none to claim or the copy
        stopped."""
        with self._cond:
            if not self._claimable():
                return False
            copy, signal = self._copy, self._signal
            layer, part = divmod(self._next, self._parts)
            self._next += 1
            self._copying += 1
        ok = False
        try:
            ok = copy(layer, part)  # type: ignore[misc]  # set: `_claimable` held
        except Exception:  # never into the forward: the load fails, vLLM recomputes
            log.exception("kvstore: copying part %d of layer %d failed", part, layer)
        finally:
            with self._cond:
                self._copying -= 1
                if not ok:
                    self._failed = True
                else:
                    self._left[layer] -= 1
                    self._ready[layer] |= signal and not self._left[layer]
                    self.pieces += 1
                    self.helped += helping
                self._cond.notify_all()
        return ok


__all__ = ["LayerwiseLoad"]
