"""First-fit allocator of contiguous runs over a space of fixed-size units.

The host arena and the disk data file are both carved into page-sized units; a block takes one
contiguous run, so a client copies a whole block with one strided copy and the disk reads it with
one large I/O. Free runs are coalesced on release. With one layout per daemon (the common case)
every run has the same length and the space never fragments; with several, a failed
allocation makes the caller evict until a run fits.
"""

from __future__ import annotations

import bisect

from kvstore.errors import InvalidArgumentError


class ExtentAllocator:
    """Allocates runs of `n` contiguous units out of `total` units."""

    def __init__(self, total: int) -> None:
        if total < 0:
            raise InvalidArgumentError(f"total units must be >= 0, got {total}")
        self.total = total
        self._starts: list[int] = [0] if total else []  # sorted starts of free runs
        self._lengths: dict[int, int] = {0: total} if total else {}
        self.free_units = total

    def allocate(self, n: int) -> int | None:
        """Start of a free run of `n` units, or None when no run is long enough."""
        if n <= 0:
            raise InvalidArgumentError(f"allocation size must be positive, got {n}")
        for i, start in enumerate(self._starts):
            length = self._lengths[start]
            if length >= n:
                del self._lengths[start]
                if length == n:
                    del self._starts[i]
                else:
                    self._starts[i] = start + n
                    self._lengths[start + n] = length - n
                self.free_units -= n
                return start
        return None

    def reserve(self, start: int, n: int) -> None:
        """Mark `[start, start+n)` used; it must be free (used to rebuild state at start-up)."""
        if n <= 0:  # an empty run would split a free run in two without using any of it
            raise InvalidArgumentError(f"reservation size must be positive, got {n}")
        i = bisect.bisect_right(self._starts, start) - 1
        if i < 0:
            raise InvalidArgumentError(f"run [{start}, {start + n}) is not free")
        run_start = self._starts[i]
        run_len = self._lengths[run_start]
        if start + n > run_start + run_len:
            raise InvalidArgumentError(f"run [{start}, {start + n}) is not free")
        del self._starts[i]
        del self._lengths[run_start]
        if start > run_start:
            self._insert(run_start, start - run_start)
        if start + n < run_start + run_len:
            self._insert(start + n, run_start + run_len - start - n)
        self.free_units -= n

    def free(self, start: int, n: int) -> None:
        """Return a run; adjacent free runs merge."""
        if n <= 0 or start < 0 or start + n > self.total:
            raise InvalidArgumentError(f"cannot free run [{start}, {start + n})")
        i = bisect.bisect_left(self._starts, start)
        prev_ok = i > 0 and self._starts[i - 1] + self._lengths[self._starts[i - 1]] > start
        next_ok = i < len(self._starts) and self._starts[i] < start + n
        if prev_ok or next_ok:
            raise InvalidArgumentError(f"double free of run [{start}, {start + n})")
        self.free_units += n
        if i < len(self._starts) and self._starts[i] == start + n:  # merge with the next run
            n += self._lengths.pop(self._starts[i])
            del self._starts[i]
        if i > 0 and self._starts[i - 1] + self._lengths[self._starts[i - 1]] == start:
            self._lengths[self._starts[i - 1]] += n  # merge into the previous run
            return
        self._starts.insert(i, start)
        self._lengths[start] = n

    def first_free(self) -> int | None:
        """The first free unit, or None when every unit is used. Safe from another thread
        while this one frees (one slice, which the GIL makes atomic)."""
        first = self._starts[:1]
        return first[0] if first else None

    def _insert(self, start: int, n: int) -> None:
        bisect.insort(self._starts, start)
        self._lengths[start] = n

    @property
    def high_water(self) -> int:
        """One past the last used unit: the file size the disk tier needs."""
        if not self._starts:
            return self.total
        last = self._starts[-1]
        return last if last + self._lengths[last] == self.total else self.total
