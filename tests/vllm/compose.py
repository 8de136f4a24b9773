"""docker-compose.yml's services as native processes, with exactly their flags.

No Docker engine runs here, so the compose tests start each service's `command` as written and
change only what names a container's surroundings: paths inside volumes (`/data`,
`/run/kvstore`, `/models`) become folders of a temporary directory, container hostnames
(`redis`) and published ports become 127.0.0.1 and free ports, and `0.0.0.0` listeners bind
127.0.0.1 (a shared machine). Every other flag and environment variable is the file's.

    python -m tests.vllm.compose [--remote]   # start them by hand; Ctrl-C stops them
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
MODEL_NAME = "llama-8b-kv-shaped"


def services() -> dict[str, Any]:
    return dict(yaml.safe_load(COMPOSE.read_text())["services"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Native:
    """Where the services' volumes and ports land on this machine."""

    root: Path
    redis_port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)

    @property
    def volumes(self) -> dict[str, str]:
        return {"/data": str(self.root / "data"), "/run/kvstore": str(self.root / "run"),
                "/models": str(self.root / "models")}

    @property
    def socket(self) -> str:
        return str(self.root / "run" / "kv.sock")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def path(self, value: str) -> str:
        for inside, outside in self.volumes.items():
            if value == inside or value.startswith(inside + "/"):
                return outside + value[len(inside):]
        return value

    def arg(self, arg: str) -> str:
        """One command-line argument, rewritten for this machine."""
        if "=" not in arg or not arg.startswith("--"):
            return self.path(arg)
        flag, value = arg.split("=", 1)
        if flag in ("--host", "--metrics-host") and value == "0.0.0.0":
            return f"{flag}=127.0.0.1"
        if flag == "--port":
            return f"{flag}={self.http_port}"
        if flag == "--metrics-port":
            return f"{flag}={self.metrics_port}"
        if flag == "--remote":
            return f"{flag}=" + value.replace("redis:6379", f"127.0.0.1:{self.redis_port}")
        if flag == "--kv-transfer-config":
            return f"{flag}=" + value.replace("unix:///run/kvstore/", f"unix://{self.root}/run/")
        return f"{flag}={self.path(value)}"

    def command(self, service: str, *, remote: bool = True, connector: bool = True) -> list[str]:
        """The service's command for this machine: console scripts and `python` from this
        interpreter's venv. `remote=False` leaves the remote tier's flag out (the compose file
        without its redis service); `connector=False` leaves vLLM's connector out (vLLM alone,
        for comparisons)."""
        cmd = [str(c) for c in services()[service]["command"]]
        if cmd[0] == "python":
            cmd[0] = sys.executable
        elif (exe := Path(sys.executable).parent / cmd[0]).exists():
            cmd[0] = str(exe)
        return [self.arg(a) for a in cmd if (remote or not a.startswith("--remote="))
                and (connector or not a.startswith("--kv-transfer-config="))]

    def environment(self, service: str) -> dict[str, str]:
        env = services()[service].get("environment") or {}
        return {str(k): str(v) for k, v in env.items()}


class Service:
    """A started service: its process and log."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.name, self.argv, self.log_path = name, argv, log
        self._log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def log(self, lines: int = 80) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 60) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)  # vLLM: its engine core too
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


def wait_for(what: str, ready: Any, service: Service, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if not service.alive():
            raise RuntimeError(f"{service.name} exited ({service.proc.returncode}) before "
                               f"{what}:\n{service.log()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{service.name}: no {what} within {timeout:.0f} s:\n"
                               f"{service.log()}")
        time.sleep(0.5)


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 600) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        text = resp.read().decode()
    return json.loads(text) if text.strip() else None


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def stack(native: Native, *, remote: bool, vllm_env: dict[str, str] | None = None,
          start_timeout: float = 300, connector: bool = True, vllm_args: tuple[str, ...] = (),
          vllm_python: str | None = None) -> Iterator[dict[str, Service]]:
    """Start redis (when `remote`), the model (model-init), the daemon and vLLM's OpenAI
    server as docker-compose.yml writes them; yield them by service name; stop them all.
    For comparisons: `connector=False` runs vLLM without its kvstore connector, `vllm_args`
    are added to its command, `vllm_python` runs it with another venv's interpreter."""
    for d in native.volumes.values():
        Path(d).mkdir(parents=True, exist_ok=True)
    base = {**os.environ, "PYTHONUNBUFFERED": "1"}
    started: dict[str, Service] = {}
    try:
        if remote:
            redis = shutil.which("redis-server")
            if redis is None:
                raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
            cmd = services()["redis"]["command"]
            started["redis"] = Service("redis", [redis, *cmd[1:], "--port",
                                                 str(native.redis_port), "--bind", "127.0.0.1"],
                                       native.root / "redis.log", base)
        model = native.path(f"/models/{MODEL_NAME}")
        if not (Path(model) / "config.json").exists():
            init = Service("model-init", native.command("model-init"),
                           native.root / "model-init.log", base)
            if init.proc.wait(600) != 0:
                raise RuntimeError(f"model-init failed:\n{init.log()}")
            init.stop()
        started["kvstore"] = daemon = Service(
            "kvstore", native.command("kvstore", remote=remote), native.root / "kvstore.log",
            base)
        wait_for("socket", lambda: os.path.exists(native.socket), daemon, 60)
        env = {**base, **native.environment("vllm"), **(vllm_env or {})}
        argv = native.command("vllm", connector=connector)
        if vllm_python is not None:
            argv[0] = vllm_python
        started["vllm"] = engine = Service("vllm", [*argv, *vllm_args],
                                           native.root / "vllm.log", env)
        wait_for("health", lambda: healthy(native.url), engine, start_timeout)
        yield started
    finally:
        for name in ("vllm", "kvstore", "redis"):
            if name in started:
                started[name].stop()


def remove_volumes(native: Native) -> None:
    """Remove the volumes (the daemon's blocks and the model: gigabytes), keep the logs.

    Left behind, each run's volumes piled up in /tmp (58 GiB on 2026-11-29) until a CI run on a
    copy of the machine failed with ENOSPC."""
    for name in ("data", "models", "run"):
        path = native.root / name
        if path.is_symlink():
            path.unlink()
        else:
            shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    remote = "--remote" in sys.argv
    native = Native(Path(tempfile.mkdtemp(prefix="kvc-", dir="/tmp")))
    try:
        with stack(native, remote=remote, vllm_env={"VLLM_SERVER_DEV_MODE": "1"}):
            print(f"up: vLLM {native.url}, daemon {native.socket}, metrics "
                  f"127.0.0.1:{native.metrics_port}; logs in {native.root}", flush=True)
            with contextlib.suppress(KeyboardInterrupt):
                signal.pause()
    finally:
        remove_volumes(native)


if __name__ == "__main__":
    main()
