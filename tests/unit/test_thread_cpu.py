"""`benchmarks.thread_cpu`: the CPU seconds of a benchmark's processes, by role, found however
deep in the process tree they run; a worker's main thread apart from its other threads, those
that ended included."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from benchmarks.thread_cpu import WORKER_COMM, cpu_by_role, descendants

# A child that starts a grandchild named like vLLM's worker; the grandchild spends 0.4 s of
# CPU on its main thread and 0.2 s on another, the child 0.1 s; each then says so and waits.
BURN = """
import threading, time
def burn(s):
    end = time.thread_time() + s
    while time.thread_time() < end:
        pass
"""
GRANDCHILD = BURN + textwrap.dedent(f"""
    open("/proc/self/comm", "w").write({WORKER_COMM!r})
    t = threading.Thread(target=burn, args=(0.2,))
    t.start()
    burn(0.4)
    t.join()
    print("done", flush=True)
    time.sleep(60)
""")
CHILD = BURN + textwrap.dedent(f"""
    import subprocess, sys
    g = subprocess.Popen([sys.executable, "-c", {GRANDCHILD!r}], stdout=subprocess.PIPE,
                         text=True)
    burn(0.1)
    assert g.stdout.readline() == "done\\n"
    print("done", flush=True)
    time.sleep(60)
""")


def test_roles_and_grandchildren() -> None:
    before = cpu_by_role()
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "done\n"
        tree = descendants()
        assert child.pid in tree and len(tree) >= 2  # the grandchild too
        got = {k: v - before[k] for k, v in cpu_by_role().items()}
    finally:
        for pid in [*reversed(descendants(child.pid)), child.pid]:  # this test's tree only
            subprocess.run(["kill", str(pid)], check=False)
        child.wait(10)
    # The clock ticks are 10 ms: each figure at most a tick or two short of what was spent.
    assert 0.38 <= got["worker compute"] < 0.6, got
    assert 0.18 <= got["worker other"] < 0.4, got  # a thread that ended counts
    assert got["all"] >= got["worker compute"] + got["worker other"] + 0.08, got
