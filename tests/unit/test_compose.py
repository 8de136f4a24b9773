"""The docker-compose file validates against the compose spec, and its commands run natively."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvstore.server.__main__ import build_parser

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"


def test_compose_file_matches_the_compose_spec():
    exe = shutil.which("check-jsonschema") or str(Path(sys.executable).parent / "check-jsonschema")
    if not Path(exe).exists():
        pytest.skip("check-jsonschema is not installed (make setup installs it)")
    proc = subprocess.run([exe, "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_daemon_command_in_compose_parses_natively():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    cmd = services["kvstore"]["command"]
    assert cmd[0] == "kvstore-server"
    args = build_parser().parse_args(cmd[1:])  # raises SystemExit on an unknown flag
    assert args.socket == "/run/kvstore/kv.sock"
    demo = services["bench"]["command"]
    assert demo[:3] == ["python", "-m", "benchmarks.demo"]


def test_every_service_command_exists_natively():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name in ("bench", "model-init"):
        cmd = services[name]["command"]
        assert cmd[:2] == ["python", "-m"], name
        module = ROOT / (cmd[2].replace(".", "/") + ".py")
        assert module.exists(), f"{name}: {module} missing"
    vllm = services["vllm"]["command"]
    flag = next(a for a in vllm if a.startswith("--kv-transfer-config="))
    cfg = json.loads(flag.split("=", 1)[1])
    assert cfg["kv_connector"] == "KVStoreConnector"
    assert (ROOT / (cfg["kv_connector_module_path"].replace(".", "/") + ".py")).exists()


def test_monitoring_scrapes_the_daemon_and_charts_exported_metrics():
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    port = next(a for a in services["kvstore"]["command"] if a.startswith("--metrics-port="))
    prom = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = prom["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == [f"kvstore:{port.split('=')[1]}"]
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/kvstore.json").read_text())
    used = {m for p in dashboard["panels"] for t in p["targets"]
            for m in re.findall(r"kvstore_[a-z_]+", t["expr"])}
    documented = (ROOT / "docs/OPERATIONS.md").read_text()
    for metric in used:
        base = re.sub(r"_(bucket|total)$", "", metric)
        assert base in documented, f"dashboard uses {metric}, not in OPERATIONS.md"


def test_health_check_is_a_fast_ping_of_the_daemon_socket():
    """The check runs `kvstore ping` (no torch: tests/unit/test_cli_fast.py) on the daemon's
    socket, with a per-call timeout that leaves margin inside docker's timeout."""
    from kvstore.client.cli import build_parser as cli_parser

    services = yaml.safe_load(COMPOSE.read_text())["services"]
    check = services["kvstore"]["healthcheck"]
    assert check["test"][:2] == ["CMD", "kvstore"]
    args = cli_parser().parse_args(check["test"][2:])
    daemon = build_parser().parse_args(services["kvstore"]["command"][1:])
    assert args.command == "ping"
    assert args.target == f"unix://{daemon.socket}"
    docker_timeout = float(check["timeout"].removesuffix("s"))
    assert args.timeout <= docker_timeout / 2, "a hung daemon must fail the ping, not docker"
