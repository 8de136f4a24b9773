"""Real Redis servers for tests and benchmarks: a standalone server and a 3-node Cluster.

Each server is a `redis-server` process on a free loopback port, in its own temporary
directory, with persistence off (`--save '' --appendonly no`): the tests want a cache, not a
database. Cluster nodes keep their `nodes.conf` in that directory, so a killed node restarted on
the same port and file rejoins with its identity and slots, as a rebooted machine would.
Processes are stopped by their pid, never by name.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from pathlib import Path

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
SKIP_REASON = ("redis-server / redis-cli not found: install the Debian packages redis-server "
               "and redis-tools (scripts/setup.sh does)")


def available() -> bool:
    return REDIS_SERVER is not None and REDIS_CLI is not None


def free_port(cluster: bool = False) -> int:
    """A loopback port free now; for a Cluster node, its bus port (port + 10000) is free too."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not cluster:
            return port
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free loopback port pair found")


def cli(port: int, *args: str, timeout: float = 10.0) -> str:
    """Run `redis-cli -p port args...` and return its output."""
    assert REDIS_CLI is not None, SKIP_REASON
    out = subprocess.run([REDIS_CLI, "-h", "127.0.0.1", "-p", str(port), *args],
                         capture_output=True, text=True, timeout=timeout, check=True)
    return out.stdout


class _PortTaken(RuntimeError):
    """redis-server could not bind its port or its Cluster bus port."""


class RedisServer:
    """One `redis-server` process; `start` again after `kill` reuses its port and directory."""

    def __init__(self, directory: Path, port: int | None = None, cluster: bool = False,
                 password: str | None = None) -> None:
        self.dir = Path(directory).resolve()  # redis-server chdirs into it before opening files
        self.cluster = cluster
        self.password = password  # `requirepass`: clients must AUTH
        self.port = port or free_port(cluster)
        # A port we chose may be taken between `free_port`'s check and redis-server's bind
        # (another test's server, a client's ephemeral port): until it first starts, such a
        # server moves to a fresh port. Once started, a restart keeps its port (nodes.conf).
        self._may_move = port is None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        for attempt in range(3):
            try:
                self._start_once(timeout)
            except _PortTaken:
                if not self._may_move or attempt == 2:
                    raise
                self.port = free_port(self.cluster)
                continue
            self._may_move = False
            return self
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> None:
        assert REDIS_SERVER is not None, SKIP_REASON
        self.dir.mkdir(parents=True, exist_ok=True)
        log_file = self.dir / "redis.log"
        log_start = log_file.stat().st_size if log_file.exists() else 0  # this attempt's lines
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.dir), "--save", "", "--appendonly", "no",
                "--logfile", str(self.dir / "redis.log"), "--protected-mode", "yes"]
        if self.password is not None:
            args += ["--requirepass", self.password]
        if self.cluster:
            # A short node timeout so a killed node is noticed (and a restarted one trusted
            # again) within the test's time; partial coverage keeps the live nodes serving.
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", "1000", "--cluster-require-full-coverage", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                auth = ["-a", self.password, "--no-auth-warning"] if self.password else []
                # Ours, not another server that holds the port while ours fails to bind it.
                info = cli(self.port, *auth, "INFO", "server", timeout=2).split()
                if f"process_id:{self.proc.pid}" in info:
                    return
            time.sleep(0.02)
        log = log_file.read_bytes()[log_start:].decode(errors="replace")[-2000:] \
            if log_file.exists() else ""
        self.stop()
        error = _PortTaken if "Address already in use" in log else RuntimeError
        raise error(f"redis-server on port {self.port} did not start:\n{log}")

    def kill(self) -> None:
        """SIGKILL: the node vanishes as a crashed machine would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


class RedisClusterNodes:
    """A Cluster of `n` primaries (no replicas) on loopback, created with `redis-cli --cluster`."""

    def __init__(self, directory: Path, n: int = 3) -> None:
        self.nodes = [RedisServer(Path(directory) / f"node{i}", cluster=True) for i in range(n)]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.nodes)

    def start(self, timeout: float = 30.0) -> RedisClusterNodes:
        try:
            for node in self.nodes:
                node.start()
            subprocess.run(
                [REDIS_CLI, "--cluster", "create",
                 *(f"127.0.0.1:{s.port}" for s in self.nodes),
                 "--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True, text=True, timeout=timeout, check=True)
            self.wait_ok(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def state(self, node: RedisServer) -> str:
        for line in cli(node.port, "CLUSTER", "INFO", timeout=2).splitlines():
            if line.startswith("cluster_state:"):
                return line.split(":", 1)[1].strip()
        return "unknown"

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every running node reports `cluster_state:ok` and knows every other node."""
        deadline = time.monotonic() + timeout
        while True:
            live = [s for s in self.nodes if s.proc is not None and s.proc.poll() is None]
            try:
                if all(self.state(s) == "ok" and self._all_connected(s) for s in live):
                    return
            except (subprocess.SubprocessError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("redis cluster did not reach cluster_state:ok")
            time.sleep(0.1)

    def _all_connected(self, node: RedisServer) -> bool:
        lines = [ln for ln in cli(node.port, "CLUSTER", "NODES", timeout=2).splitlines() if ln]
        return len(lines) == len(self.nodes) and all(
            " connected" in ln and "fail" not in ln.split()[2] for ln in lines)

    def kill(self, i: int) -> None:
        self.nodes[i].kill()

    def restart(self, i: int, timeout: float = 30.0) -> None:
        """Start node `i` again on its port with its `nodes.conf`; wait for the Cluster to be ok."""
        self.nodes[i].start()
        self.wait_ok(timeout)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
