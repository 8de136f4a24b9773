"""The docker-compose file validates against the compose spec, and its commands run natively."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from server.__main__ import build_parser

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
    demo = services["demo"]["command"]
    assert demo[:3] == ["python", "-m", "benchmarks.demo"]
