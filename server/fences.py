"""Space of expired zero-copy publishes, kept out of use while their writer may still copy.

A same-node client writes a publish straight into its reservation in the shared arena. When
its lease expires (the process froze, was swapped out, or ran past `lease_timeout_s`), the
reservation must end, yet the writer may still be in the middle of a copy into it: were its
slots handed to another block, the rest of that copy would land in that block, a wrong answer
served as a hit. So the space is *fenced*: the key is given up (it can be published again) but
the slots stay allocated, under no key, until the writer cannot write any more:

- it ends the lease (Commit or Release): the client sends either only after its copy stopped;
- its process is gone (its lock file, `kvstore.writer_lock`, is unlocked);
- `write_fence_s` has passed (a process frozen longer than that is not protected).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvstore.tiers.base import PAGE, BlockEntry
from kvstore.writer_lock import writer_alive

log = logging.getLogger(__name__)


@dataclass
class _Fenced:
    space: list[BlockEntry]  # the reservation's slots, as scratch space under no key
    owner: str  # the lease's tenant: only it ends the fence early
    writer: str  # the writer's lock file name
    since: float


class Fences:
    def __init__(self, directory: Path, max_s: float, free: Callable[[BlockEntry], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.directory = directory
        self.max_s = max_s
        self._free = free
        self._clock = clock
        self._fenced: dict[int, _Fenced] = {}
        self.fenced_total = 0  # leases fenced since start (Stats, metrics)

    def __contains__(self, lease_id: int) -> bool:
        return lease_id in self._fenced

    def __len__(self) -> int:
        return len(self._fenced)

    @property
    def nbytes(self) -> int:
        """Bytes held out of use now."""
        return sum(e.units * PAGE for f in self._fenced.values() for e in f.space)

    def fence(self, lease_id: int, owner: str, writer: str, space: list[BlockEntry]) -> None:
        self._fenced[lease_id] = _Fenced(space, owner, writer, self._clock())
        self.fenced_total += 1
        log.warning("publish lease %d expired while its writer (%s) lives: %.1f MiB of the "
                    "arena stay out of use until it ends the lease or exits", lease_id, writer,
                    sum(e.length for e in space) / (1 << 20))

    def end(self, lease_id: int, owner: str | None) -> bool:
        """The writer ended the lease (its copy is over): free the space. With `owner`, only
        a fence of that tenant. False when there was none."""
        f = self._fenced.get(lease_id)
        if f is None or (owner is not None and f.owner != owner):
            return False
        self._end(lease_id)
        return True

    def sweep(self) -> int:
        """Free the space of writers that are gone, or fenced for `max_s`; returns how many."""
        now = self._clock()
        old = {i for i, f in self._fenced.items() if now - f.since >= self.max_s}
        done = [i for i, f in self._fenced.items()
                if i in old or not writer_alive(self.directory, f.writer)]
        for lease_id in done:
            if lease_id in old:
                log.warning("publish lease %d: its writer may still live after write_fence_s; "
                            "freeing its space", lease_id)
            self._end(lease_id)
        return len(done)

    def _end(self, lease_id: int) -> None:
        for entry in self._fenced.pop(lease_id).space:
            self._free(entry)

    def close(self) -> None:
        for lease_id in list(self._fenced):
            self._end(lease_id)
