"""deploy/kubernetes: valid against the Kubernetes API schemas, and consistent with the daemon.

Validation is offline: `kubernetes-validate` (PyPI, a dev extra) bundles the API's JSON
schemas, and the test cuts the process off the network while it runs. Nothing is deployed.
The cross-checks run the daemon's own parser (`python -m kvstore.server --print-config`) on the
DaemonSet's command and compare what the engine pod mounts and dials with what the daemon uses.
"""

from __future__ import annotations

import ast
import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstore.client.cli import build_parser as cli_parser

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "deploy/kubernetes").glob("*.yaml"))
OLDEST_KUBERNETES = "1.29.0"  # docs/OPERATIONS.md#kubernetes
GIB = 1 << 30


def documents() -> list[dict[str, Any]]:
    return [d for path in MANIFESTS for d in yaml.safe_load_all(path.read_text()) if d]


def resource(kind: str, name: str) -> dict[str, Any]:
    return next(d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name)


def pod(kind: str, name: str) -> dict[str, Any]:
    spec: dict[str, Any] = resource(kind, name)["spec"]["template"]["spec"]
    return spec


def host_mounts(spec: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    """mountPath -> hostPath of a container's hostPath volumes."""
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    return {m["mountPath"]: host[m["name"]] for m in container["volumeMounts"]
            if m["name"] in host}


def quantity(q: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": GIB, "Ti": 1 << 40}
    return int(q[:-2]) * units[q[-2:]] if q[-2:] in units else int(q)


@pytest.fixture(scope="module")
def daemon_config() -> dict[str, Any]:
    """The daemon's effective configuration for the DaemonSet's command, from the daemon."""
    cmd = pod("DaemonSet", "kvstore")["containers"][0]["command"]
    assert cmd[0] == "kvstore-server"
    r = subprocess.run([sys.executable, "-m", "kvstore.server", "--print-config", *cmd[1:]],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, f"the daemon refuses the DaemonSet's flags: {r.stderr}"
    config: dict[str, Any] = json.loads(r.stdout)
    return config


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network access during offline validation: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


def test_manifests_validate_against_the_kubernetes_api_schemas(no_network: None) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="make setup installs it (dev extra)")
    versions = {kv.latest_version() + ".0"}
    if OLDEST_KUBERNETES in kv.utils.all_versions():
        versions.add(OLDEST_KUBERNETES)
    docs = documents()
    assert {d["kind"] for d in docs} >= {"Namespace", "DaemonSet", "Deployment", "Service"}
    for version in sorted(versions):
        for d in docs:
            kv.validate(d, version, strict=True)  # raises naming the field


def test_the_validator_rejects_a_misspelt_field(no_network: None) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="make setup installs it (dev extra)")
    ds = resource("DaemonSet", "kvstore")
    ds["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 30
    with pytest.raises(kv.ValidationError, match="terminationGracePeriodSecond"):
        kv.validate(ds, kv.latest_version(), strict=True)


def test_engine_pod_reaches_the_daemon_socket_and_arena(daemon_config: dict[str, Any]) -> None:
    ds, engine = pod("DaemonSet", "kvstore"), pod("Deployment", "vllm")
    daemon_mounts = host_mounts(ds, ds["containers"][0])
    engine_mounts = host_mounts(engine, engine["containers"][0])
    sock_dir = str(Path(daemon_config["socket"]).parent)
    # The client dials the socket and maps the arena at the paths the daemon has: the same
    # host directories must be mounted at the same paths in both pods.
    for path in (sock_dir, daemon_config["shm_dir"]):
        assert path in daemon_mounts, f"the daemon's {path} is not a host directory"
        assert engine_mounts.get(path) == daemon_mounts[path], f"engine does not share {path}"
    assert daemon_mounts[daemon_config["shm_dir"]].startswith("/dev/shm/"), "arena off tmpfs"
    assert daemon_config["data_dir"] in daemon_mounts
    # The socket and arena are 0600: the engine runs as the daemon's user.
    for key in ("runAsUser", "runAsGroup"):
        assert engine["securityContext"][key] == ds["securityContext"][key]
    # Scheduled onto nodes that run a daemon.
    assert ds["nodeSelector"].items() <= engine["nodeSelector"].items()

    flag = next(a for a in engine["containers"][0]["command"]
                if a.startswith("--kv-transfer-config="))
    cfg = json.loads(flag.split("=", 1)[1])
    assert cfg["kv_connector"] == "KVStoreConnector"
    module = ROOT / (cfg["kv_connector_module_path"].replace(".", "/") + ".py")
    assert module.exists()
    extra = cfg["kv_connector_extra_config"]
    assert extra["kvstore.target"] == f"unix://{daemon_config['socket']}"
    assert {k.removeprefix("kvstore.") for k in extra} <= connector_settings(module)


def connector_settings(module: Path) -> set[str]:
    """Fields of the connector's `ConnectorConfig` (its module imports vLLM: read, not run)."""
    tree = ast.parse(module.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ConnectorConfig")
    return {n.target.id for n in cls.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def test_probes_ping_the_daemon_socket_within_their_timeout(daemon_config: dict[str, Any]
                                                            ) -> None:
    container = pod("DaemonSet", "kvstore")["containers"][0]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container[kind]
        cmd = probe["exec"]["command"]
        assert cmd[0] == "kvstore"
        args = cli_parser().parse_args(cmd[1:])
        assert args.command == "ping" and args.target == f"unix://{daemon_config['socket']}"
        assert args.timeout <= probe["timeoutSeconds"] / 2, kind


def test_resources_hold_the_arena_and_shutdown_fits_the_grace_period(
        daemon_config: dict[str, Any]) -> None:
    ds = pod("DaemonSet", "kvstore")
    res = ds["containers"][0]["resources"]
    assert res["requests"] == res["limits"], "Guaranteed QoS: evicted last"
    # The arena's tmpfs pages are charged to the daemon's pod: the limit holds them and more.
    assert quantity(res["limits"]["memory"]) >= daemon_config["host_bytes"] + GIB
    assert ds["terminationGracePeriodSeconds"] > (daemon_config["drain_grace_s"]
                                                  + daemon_config["shutdown_flush_s"])


def test_metrics_port_is_exposed_and_scraped(daemon_config: dict[str, Any]) -> None:
    template = resource("DaemonSet", "kvstore")["spec"]["template"]
    port = daemon_config["metrics_port"]
    assert port and daemon_config["metrics_host"] == "0.0.0.0"
    notes = template["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true" and int(notes["prometheus.io/port"]) == port
    assert port in [p["containerPort"] for p in template["spec"]["containers"][0]["ports"]]
