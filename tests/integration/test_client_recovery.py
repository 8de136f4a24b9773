"""The client against a real daemon process: it is back on the cache soon after a restart, a
refused call is not an outage, a dropped save is counted and logged (issue 12 items 1 and 6,
issue 13 item 9)."""

from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path

import pytest

from kvstore.client import KVClient
from kvstore.client.backoff import BackoffPolicy
from kvstore.errors import PermissionDeniedError
from kvstore.proto import kvstore_pb2 as pb
from tests.conftest import random_kv, small_layout

pytestmark = pytest.mark.integration
LONG = BackoffPolicy(initial_s=30.0, maximum_s=30.0, jitter=0.0)
"""A backoff that alone would keep a client off the daemon for 30 s after one failure."""
TOKEN_A = "alpha-token-0123456789"
ADMIN = "admin-token-0123456789"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _first_hit(client: KVClient, tokens: list[int], give_up_s: float) -> tuple[bool, int]:
    """Look `tokens` up until they hit or `give_up_s` passes: (hit, misses before it)."""
    misses = 0
    end = time.monotonic() + give_up_s
    while time.monotonic() < end:
        if client.lookup(tokens) == len(tokens):
            return True, misses
        misses += 1
        time.sleep(0.02)
    return False, misses


def test_client_uses_the_cache_again_soon_after_a_daemon_restart(daemon):
    """The daemon stops (SIGTERM: its blocks go to disk) while the client keeps calling; once
    it is back, a cheap probe lets calls through again: the client hits long before its
    30 s backoff would have let it try."""
    layout = small_layout()
    tokens = list(range(64))
    with KVClient(daemon.target, layout, backoff=LONG) as c:
        assert c.publish(tokens, random_kv(layout, 64)) == 64
        assert daemon.stop() == 0
        for _ in range(5):  # an outage the client notices: misses, instantly after the first
            assert c.lookup(tokens) == 0
        daemon.start()
        hit, misses = _first_hit(c, tokens, give_up_s=10.0)
        assert hit, f"no hit 10 s after the restart ({misses} misses): the client waited out " \
                    f"its backoff instead of probing"


def test_refused_clear_all_is_an_error_not_an_outage(daemon_factory, tmp_path: Path):
    """A tenant may not clear every namespace: the call raises, naming the refusal, and the
    tenant's own client goes on hitting at once (no backoff)."""
    port = _free_port()
    tokens_file = tmp_path / "tenants.txt"
    tokens_file.write_text(f"alpha {TOKEN_A}\n")
    os.chmod(tokens_file, 0o600)
    daemon_factory("--listen", f"127.0.0.1:{port}", "--token", ADMIN,
                   "--tenant-tokens-file", str(tokens_file)).start()
    layout = small_layout()
    tokens = list(range(48))
    with KVClient(f"127.0.0.1:{port}", layout, token=TOKEN_A, backoff=LONG) as a:
        assert a.publish(tokens, random_kv(layout, 48)) == 48
        with pytest.raises(PermissionDeniedError, match="refused"):
            a.clear(all_namespaces=True)
        assert a.lookup(tokens) == 48  # the very next call goes through
        assert a.fetch(tokens)[0] == 48


def test_refused_engine_call_is_a_miss_without_backoff(daemon):
    """A call the daemon refuses (here: a Release of a lease it does not know) costs that
    call only: the client does not back off."""
    layout = small_layout()
    tokens = list(range(32))
    with KVClient(daemon.target, layout, backoff=LONG) as c:
        assert c.publish(tokens, random_kv(layout, 32)) == 32
        aio = c._aio
        # An unknown lease: the daemon answers NOT_FOUND. A refusal, not an outage.
        released = c._run(aio._guard(lambda: aio._unary(
            "Release", pb.ReleaseRequest(lease_id=12345)), None), None)
        assert released is None or not released.released
        assert not aio._breaker.open
        assert c.lookup(tokens) == 32


def test_dropped_saves_are_counted_and_logged(daemon, caplog):
    """Saves that do not happen (the daemon gone, or too full for them) are counted; the first
    is logged at once, later ones in a summary."""
    layout = small_layout()
    caplog.set_level(logging.WARNING, logger="kvstore.client")
    with KVClient(daemon.target, layout, backoff=BackoffPolicy(maximum_s=0.05)) as c:
        assert c.publish(list(range(32)), random_kv(layout, 32)) == 32
        assert c.dropped_saves == 0
        daemon.kill()
        assert c.publish(list(range(100, 132)), random_kv(layout, 32)) == 0
        assert c.dropped_saves == 1
        assert any("a save was dropped" in r.getMessage() for r in caplog.records)
        caplog.clear()
        for i in range(3):
            c.publish(list(range(1000 * (i + 1), 1000 * (i + 1) + 32)), random_kv(layout, 32))
        assert c.dropped_saves == 4
        assert not any("a save was dropped" in r.getMessage() for r in caplog.records), \
            "every drop logged: the log would flood"
    # Closing the client summarises the drops not logged yet.
    assert any("saves dropped" in r.getMessage() for r in caplog.records)


def test_a_client_never_closed_stops_its_thread_when_collected_and_at_exit(daemon, tmp_path):
    """A `KVClient` dropped without `close` ends its loop thread (it leaked one per client
    before), and one still open at exit is closed before the interpreter finalizes."""
    import gc
    import subprocess
    import sys

    layout = small_layout()
    tokens = list(range(2 * layout.block_tokens))
    c = KVClient(daemon.target, layout)
    assert c.publish(tokens, random_kv(layout, len(tokens), 1)) == len(tokens)
    thread = c._thread
    del c
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()
    closed = KVClient(daemon.target, layout)
    closed.close()
    closed.close()  # twice: nothing more
    with pytest.raises(RuntimeError, match="closed"):
        closed.lookup(tokens)
    script = (
        "import sys\n"
        "from kvstore.client import KVClient\n"
        "from tests.conftest import small_layout\n"
        "layout = small_layout()\n"
        "c = KVClient(sys.argv[1], layout)\n"
        f"n, kv = c.fetch({tokens!r})\n"
        "assert n == len(kv[0, 0]) and n > 0, n\n"
        "print('FETCHED', flush=True)\n")  # exits with `c` open
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", script, daemon.target], cwd=root,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "FETCHED" in r.stdout, r.stderr[-2000:]
    assert "Task was destroyed" not in r.stderr and "Traceback" not in r.stderr, r.stderr
