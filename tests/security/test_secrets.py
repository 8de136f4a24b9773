"""Secrets and ownership (issue 13, item 8), through real daemon processes.

- The admin token comes from a file (`token_file`, mode 0600) or the environment
  (`KVSTORE_TOKEN`), never necessarily from the command line, which every local user reads in
  /proc/PID/cmdline; the flag still works but warns. A token under 16 characters is refused.
- A daemon never takes over a socket another live daemon answers on (it unlinked it before).
- Stale arenas are judged by their lock, not by the pid in their name: an arena named after a
  live pid but unlocked is removed; a live daemon's arena named after a pid that does not exist
  here (another pid namespace) is kept.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import grpc
import pytest

from kvstore.client import KVClient, cli
from kvstore.proto import kvstore_pb2 as pb
from kvstore.server.process import DaemonProcess
from tests.conftest import random_kv, same_bytes, small_layout
from tests.reliability import stub

pytestmark = [pytest.mark.integration]
ADMIN = "admin-token-0123456789abcdef"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _secret_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    os.chmod(path, mode)
    return path


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """The `kvstore` CLI, in this process (its own process spends seconds importing torch):
    exit code and stderr."""
    capsys.readouterr()
    rc = cli.main(list(args))
    return rc, capsys.readouterr().err


def _refused(d: DaemonProcess) -> str:
    """Start `d`, expecting a refusal: exit 2 and no traceback. Returns its log."""
    try:
        with pytest.raises(RuntimeError, match="did not start"):
            d.start(timeout=30)
    finally:
        d.kill()
    log = d.log.read_text()
    assert d.proc is not None and d.proc.returncode == 2, log
    assert "Traceback" not in log, log
    return log


def test_short_token_is_refused(daemon_factory) -> None:
    port = _free_port()
    log = _refused(daemon_factory("--listen", f"127.0.0.1:{port}", "--token", "s3cret"))
    assert "token" in log and "16 characters" in log, log
    assert "s3cret" not in log  # a refused secret is not echoed either


def test_token_from_file_or_environment_and_the_flag_warns(daemon_factory, tmp_path, capsys,
                                                          monkeypatch) -> None:
    port = _free_port()
    tcp = f"127.0.0.1:{port}"
    token_file = _secret_file(tmp_path / "admin.token", ADMIN + "\n")
    d = daemon_factory("--listen", tcp, "--token-file", str(token_file)).start()
    assert ADMIN not in Path(f"/proc/{d.proc.pid}/cmdline").read_text()
    layout = small_layout()
    tokens, kv = list(range(32)), random_kv(layout, 32)
    with KVClient(tcp, layout, token=ADMIN, deadline_s=5) as c:
        assert c.publish(tokens, kv) == 32
        n, got = c.fetch(tokens)
        assert n == 32 and same_bytes(got, kv)
    with KVClient(tcp, layout, token="x" * 16 + "-wrong", deadline_s=1) as c:
        assert c.lookup(tokens) == 0  # unauthenticated: a miss
    # The CLI takes the token from a file or the environment too, and warns on the flag.
    monkeypatch.delenv("KVSTORE_TOKEN", raising=False)
    rc, err = _cli(capsys, "--target", tcp, "--token-file", str(token_file), "ping")
    assert rc == 0 and "warning" not in err.lower(), err
    rc, err = _cli(capsys, "--target", tcp, "ping")
    assert rc == 1, "no token: UNAUTHENTICATED"
    monkeypatch.setenv("KVSTORE_TOKEN", ADMIN)
    rc, err = _cli(capsys, "--target", tcp, "ping")
    assert rc == 0 and "warning" not in err.lower(), err
    monkeypatch.delenv("KVSTORE_TOKEN")
    rc, err = _cli(capsys, "--target", tcp, "--token", ADMIN, "ping")
    assert rc == 0 and "/proc" in err, err  # works, but warns
    rc, err = _cli(capsys, "--target", tcp, "--token-file", str(tmp_path / "nope"), "ping")
    assert rc == 2 and "--token-file" in err, err
    os.chmod(token_file, 0o644)
    rc, err = _cli(capsys, "--target", tcp, "--token-file", str(token_file), "ping")
    assert rc == 2 and "chmod 600" in err, err
    os.chmod(token_file, 0o600)
    assert "warning" not in d.log.read_text().lower()
    assert d.stop() == 0
    # The environment: works, no warning. The flag: works, and the daemon warns.
    env_port = _free_port()
    monkeypatch.setenv("KVSTORE_TOKEN", ADMIN)
    e = daemon_factory("--listen", f"127.0.0.1:{env_port}", name="env").start()
    monkeypatch.delenv("KVSTORE_TOKEN")
    assert "/proc" not in e.log.read_text()
    assert _cli(capsys, "--target", f"127.0.0.1:{env_port}", "--token-file", str(token_file),
                "ping")[0] == 0
    assert e.stop() == 0
    f = daemon_factory("--listen", f"127.0.0.1:{_free_port()}", "--token", ADMIN,
                       name="flag").start()
    log = f.log.read_text()
    assert "WARNING" in log and "/proc" in log and "token_file" in log, log
    assert ADMIN not in log


def test_token_file_readable_by_others_is_refused(daemon_factory, tmp_path) -> None:
    token_file = _secret_file(tmp_path / "admin.token", ADMIN, mode=0o640)
    log = _refused(daemon_factory("--listen", f"127.0.0.1:{_free_port()}",
                                  "--token-file", str(token_file)))
    assert "token_file" in log and "chmod 600" in log, log
    short = _secret_file(tmp_path / "short.token", "tiny\n")
    log = _refused(daemon_factory("--listen", f"127.0.0.1:{_free_port()}",
                                  "--token-file", str(short), name="short"))
    assert "token_file" in log and "16 characters" in log, log
    log = _refused(daemon_factory("--listen", f"127.0.0.1:{_free_port()}", "--token", ADMIN,
                                  "--token-file", str(token_file), name="both"))
    assert "token_file" in log and "both" in log, log


class _SocketDaemon(DaemonProcess):
    """A daemon listening on a socket outside its data directory."""

    def __init__(self, data_dir: Path, sock: Path, *args: str) -> None:
        super().__init__(data_dir, "--socket", str(sock), *args)
        self.sock = sock

    @property
    def socket(self) -> str:
        return str(self.sock)


def _ping(target: str) -> bool:
    channel, s = stub(target)
    with channel:
        try:
            s.Info(pb.InfoRequest(), timeout=2)
        except grpc.RpcError:
            return False
    return True


def test_second_daemon_on_a_live_socket_is_refused(tmp_path: Path) -> None:
    sock = tmp_path / "shared.sock"
    first = _SocketDaemon(tmp_path / "a", sock, "--host-bytes", "1MiB", "--disk-bytes", "0")
    second = _SocketDaemon(tmp_path / "b", sock, "--host-bytes", "1MiB", "--disk-bytes", "0")
    try:
        first.start()
        log = _refused(second)
        assert "socket" in log and str(sock) in log and "in use" in log, log
        assert _ping(first.target), "the first daemon lost its socket"
        # A socket left by a killed daemon is stale: nobody answers, so it is replaced.
        first.kill()
        assert sock.exists() and not _ping(first.target)
        second.start()
        assert _ping(second.target)
        assert second.stop() == 0
        # A path that is not a socket is never replaced.
        sock.write_text("not a socket")
        log = _refused(_SocketDaemon(tmp_path / "c", sock, "--disk-bytes", "0"))
        assert "not a socket" in log and sock.read_text() == "not a socket", log
    finally:
        first.kill()
        second.kill()


def test_stale_arenas_are_judged_by_lock_not_pid(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    args = ("--host-bytes", "1MiB", "--disk-bytes", "0", "--shm-dir", str(shm))
    # Left by a dead daemon whose pid is now someone else's (here: this test's own pid).
    reused = shm / f"kvstore-{os.getpid()}-0123456789ab.arena"
    reused.write_bytes(bytes(4096))
    first = DaemonProcess(tmp_path / "a", *args)
    second = DaemonProcess(tmp_path / "b", *args)
    try:
        first.start()
        assert not reused.exists(), "an unlocked arena is stale whatever its pid"
        # The first daemon's arena, as a daemon in another pid namespace would name it: its
        # pid does not exist here. The second daemon must keep it: its owner is alive.
        channel, s = stub(first.target)
        with channel:
            arena = Path(s.Info(pb.InfoRequest(), timeout=5).arena_path)
        foreign = shm / "kvstore-4194999-0123456789ab.arena"
        arena.rename(foreign)
        second.start()
        assert foreign.exists(), "a live daemon's arena was removed"
        assert first.stop() == 0
        assert second.stop() == 0
        # Its owner gone, the lock is free: the next daemon removes it.
        third = DaemonProcess(tmp_path / "c", *args).start()
        assert not foreign.exists()
        assert third.stop() == 0
    finally:
        first.kill()
        second.kill()
