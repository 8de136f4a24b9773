"""The `kvstore` CLI: no torch on the operator path, global flags before or after the command.

The daemon is stood in for by a small gRPC server in this process (Info, Stats, Inspect), so
the CLI runs in a subprocess exactly as the compose health check runs it, without starting a
daemon. Speed is checked by what the CLI process imported (sys.modules), not by a timer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvstore.client.cli import build_parser, normalize_target
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]

# Runs the CLI's main() as the console script does, then reports on stderr what was imported.
_WRAPPER = """
import sys
from kvstore.client.cli import main
rc = main(sys.argv[1:])
heavy = sorted(m for m in ("torch", "numpy", "kvstore.client.aio", "kvstore.client.sync")
               if m in sys.modules)
print("IMPORTED=" + ",".join(heavy), file=sys.stderr)
sys.exit(rc)
"""


class _FakeDaemon(pb_grpc.KVStoreServicer):  # type: ignore[misc]
    def Info(self, request: Any, context: Any) -> pb.InfoReply:
        return pb.InfoReply(version="9.9.9-fake")

    def Stats(self, request: Any, context: Any) -> pb.StatsReply:
        return pb.StatsReply(version="9.9.9-fake", uptime_s=3.0, hit_blocks=3, miss_blocks=1,
                             tiers=[pb.TierStats(name="host", blocks=3, capacity_bytes=1 << 30)])

    def Inspect(self, request: Any, context: Any) -> pb.InspectReply:
        return pb.InspectReply()


@pytest.fixture
def fake_daemon(tmp_path: Path) -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_KVStoreServicer_to_server(_FakeDaemon(), server)
    target = f"unix://{tmp_path}/kv.sock"
    server.add_insecure_port(target)
    server.start()
    yield target
    server.stop(grace=None)


def run_cli(*args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    r = subprocess.run([sys.executable, "-c", _WRAPPER, *args], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    line = next((x for x in r.stderr.splitlines() if x.startswith("IMPORTED=")), None)
    assert line is not None, r.stderr
    return r, {m for m in line.removeprefix("IMPORTED=").split(",") if m}


@pytest.mark.parametrize("command", [["ping"], ["stats"], ["stats", "--json"], ["inspect"],
                                     ["top", "--count", "1"]])
def test_cli_answers_without_importing_torch(fake_daemon: str, command: list[str]) -> None:
    r, imported = run_cli("--target", fake_daemon, *command)
    assert r.returncode == 0, r.stderr
    assert "9.9.9-fake" in r.stdout or command == ["inspect"]
    assert imported == set(), f"`kvstore {' '.join(command)}` imported {imported}"


def test_flags_after_the_subcommand(fake_daemon: str) -> None:
    r, _ = run_cli("stats", "--json", "--target", fake_daemon)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["version"] == "9.9.9-fake"
    r, _ = run_cli("ping", "--target", fake_daemon, "--timeout", "2", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"ok": True, "version": "9.9.9-fake"}


def test_ping_of_a_missing_daemon_exits_1_without_torch(tmp_path: Path) -> None:
    r, imported = run_cli("ping", "--target", f"unix://{tmp_path}/none.sock")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "UNAVAILABLE" in r.stderr
    assert imported == set()
    r, _ = run_cli("--json", "ping", "--target", f"unix://{tmp_path}/none.sock")
    assert r.returncode == 1 and '"ok": false' in r.stderr


@pytest.mark.parametrize("argv", [
    ["--target", "unix:///a", "--json", "--timeout", "2", "stats"],
    ["stats", "--target", "unix:///a", "--json", "--timeout", "2"],
    ["--target", "unix:///a", "stats", "--json", "--timeout", "2"],
    ["--json", "--timeout", "2", "stats", "--target", "unix:///a"],
])
def test_global_flags_parse_the_same_before_or_after(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    assert (args.command, args.target, args.json, args.timeout) == ("stats", "unix:///a", True, 2.0)


def test_a_flag_before_the_subcommand_is_not_reset_by_its_defaults() -> None:
    args = build_parser().parse_args(["--target", "h:1", "--token-file", "/t", "clear", "--all"])
    assert (args.target, args.token_file, args.all, args.json) == ("h:1", "/t", True, False)
    args = build_parser().parse_args(["config", "check", "f.toml", "--json"])
    assert (args.command, args.config_command, args.file, args.json) == (
        "config", "check", "f.toml", True)
    args = build_parser().parse_args(["top", "--count", "2", "--target", "h:2"])
    assert (args.count, args.target, args.timeout) == (2, "h:2", 5.0)


def test_bad_usage_exits_2() -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["stats", "--bogus"])
    assert e.value.code == 2


def test_target_normalized_as_the_client_does() -> None:
    from kvstore.client.aio import normalize_target as client_normalize  # imports torch: here only

    for t in ("/run/kv.sock", "unix:/run/kv.sock", "unix:///run/kv.sock", "host:9000"):
        assert normalize_target(t) == client_normalize(t)


def test_public_names_still_import_and_stay_lazy() -> None:
    code = """
import sys
import kvstore.client
assert "torch" not in sys.modules and "numpy" not in sys.modules, "eager import"
from kvstore.client import AsyncKVClient, BackoffPolicy, KVClient, cli
from kvstore import KVLayout, Namespace, chain_keys, InvalidArgumentError, __version__
ns = {}
exec("from kvstore.client import *; from kvstore import *", ns)
assert {"KVClient", "AsyncKVClient", "BackoffPolicy", "Namespace", "chain_keys"} <= set(ns)
assert KVClient.__module__ == "kvstore.client.sync" and cli.__name__ == "kvstore.client.cli"
try:
    kvstore.client.no_such_name
except AttributeError:
    print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
