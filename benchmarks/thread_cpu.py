"""CPU seconds of the processes a benchmark started, by role, read from /proc.

On this 2-core machine vLLM's worker computes on one core (`VLLM_CPU_NUM_OF_RESERVED_CPU`) and
everything else (the API server, the engine core, a store's daemon or server, a connector's
background threads) shares the other. Wall times move by more between two runs of one engine
than a store's overhead on a miss, but the CPU time of the worker's compute thread for the
same requests shows directly whether a store took time from the forward pass: a connector's
work on the compute thread adds to it, and only there does it delay the forward pass.
"""

from __future__ import annotations

import os
from pathlib import Path

WORKER_COMM = "VLLM::Worker"  # the name vLLM gives its worker processes
_HZ = os.sysconf("SC_CLK_TCK")


def _stat(path: Path) -> tuple[str, int, float] | None:
    """(comm, ppid, CPU seconds) of one /proc stat file; None when it is gone."""
    try:
        text = path.read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    comm, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :]
    fields = rest.split()  # from field 3 (state) on
    return comm, int(fields[1]), (int(fields[11]) + int(fields[12])) / _HZ


def descendants(root: int | None = None) -> list[int]:
    """The pids below `root` (default: this process) in the process tree."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(entry / "stat")) is not None:
            parent[int(entry.name)] = st[1]
    root = os.getpid() if root is None else root
    found, frontier = [], {root}
    while frontier:
        frontier = {pid for pid, pp in parent.items() if pp in frontier}
        found += sorted(frontier)
    return found


def cpu_by_role(root: int | None = None) -> dict[str, float]:
    """CPU seconds so far of the processes below `root`: "worker compute" (the main thread of
    each vLLM worker process, which runs the whole forward pass where vLLM computes with one
    OMP thread, as on this 2-core machine; more OMP threads would count as "worker other"),
    "worker other" (the worker's other threads: a connector's saves and loads, its client),
    and "all" (every descendant, those two included). A process's figure counts its threads
    that ended; a process that ended is not counted."""
    out = {"worker compute": 0.0, "worker other": 0.0, "all": 0.0}
    for pid in descendants(root):
        proc = _stat(Path(f"/proc/{pid}/stat"))  # the whole thread group's time
        if proc is None:
            continue
        out["all"] += proc[2]
        if proc[0] == WORKER_COMM:
            main = _stat(Path(f"/proc/{pid}/task/{pid}/stat"))
            compute = main[2] if main is not None else 0.0
            out["worker compute"] += compute
            out["worker other"] += max(0.0, proc[2] - compute)
    return out
