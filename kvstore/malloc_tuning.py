"""glibc malloc settings for processes that move megabytes through Python `bytes`.

A streamed fetch (TCP) moves each block through 1 MiB messages: the daemon builds one
`bytes` per message, gRPC copies it into its own buffers, the client receives another.
glibc serves an allocation of 1 MiB with a fresh `mmap` (its threshold starts at 128 KiB) and
returns it with `munmap` when freed, so every message faults in 256 new pages on each side:
on this repository's VM that made the copies run at ~2 GB/s and a 32 MiB fetch take 2-3x a bare
gRPC stream of the same bytes. Serving such buffers from the heap and keeping freed heap
memory up to a bound reuses warm pages instead (docs/PERFORMANCE.md, "Fetch over TCP").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
"""Allocations from this size on still get their own mapping (a large tensor, say)."""
TRIM_THRESHOLD = 128 << 20
"""Freed heap memory kept for reuse before glibc returns it to the system."""


OPT_OUT = "KVSTORE_MALLOC_TUNING"
"""Set to 0 to leave the process's malloc settings alone (clients and daemon)."""


@functools.cache
def keep_large_buffers() -> bool:
    """Apply the settings above to this process, once; False where `KVSTORE_MALLOC_TUNING=0`
    or the C library is not glibc (or refuses them), which changes nothing but speed."""
    if os.environ.get(OPT_OUT, "1").strip() == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if ok:
        log.info("malloc: buffers under %d MiB from the heap, %d MiB of freed heap kept (for "
                 "streamed transfers; %s=0 turns this off)", MMAP_THRESHOLD >> 20,
                 TRIM_THRESHOLD >> 20, OPT_OUT)
    else:
        log.debug("mallopt refused the thresholds; large buffers stay mapped per allocation")
    return ok
