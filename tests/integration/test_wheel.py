"""The installed distribution, as a user gets it: build the wheel from this tree, install it (not
editable) into a clean venv beside Hugging Face's `kernels`, and run what the README runs.

kvstore's subpackages live in the repository's top-level folders (kernels/, tiers/, server/,
client/) and reach the wheel as kvstore.kernels, kvstore.tiers, ... through the links in
kvstore/, so the wheel's only top-level import package is `kvstore`: it shadows no `kernels`
(Hugging Face's, which transformers imports for hub kernels), `client`, `server` or `tiers`.

Slow-ish (a venv and a torch install: ~1 min) but in the default run: packaging breaks silently
otherwise (a module that only a checkout can import, a data file the wheel lacks).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HF_KERNELS = "kernels==0.17.2"  # Hugging Face's hub-kernels package (import name `kernels`)
# Not copied into the build tree: environments, caches, results, VCS data.
_SKIP = shutil.ignore_patterns(".git", ".venv*", ".data", "build", "dist", "*.egg-info",
                               "__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache",
                               "results")

pytestmark = pytest.mark.timeout(900)


def _run(cmd: list[str], cwd: Path, timeout: float = 600, **kw: object,
         ) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=env, check=False, **kw)  # type: ignore[call-overload]


def _ok(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 0, (f"{r.args} exited {r.returncode}:\n"
                               f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A copy of the tree, links kept as links: a build writes build/ and *.egg-info in place.
    src = tmp_path_factory.mktemp("src") / "kvstore"
    shutil.copytree(ROOT, src, symlinks=True, ignore=_SKIP)
    out = tmp_path_factory.mktemp("wheel")
    _ok(_run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
              "-w", str(out), str(src)], cwd=out))
    (whl,) = out.glob("kvstore_cache-*.whl")
    return whl


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with nothing but the wheel, its dependencies and Hugging Face's kernels. The wheel
    is installed last, so it is the one that would overwrite a clashing module."""
    env = tmp_path_factory.mktemp("venv") / "v"
    base = getattr(sys, "_base_executable", sys.executable)
    _ok(_run([base, "-m", "venv", str(env)], cwd=env.parent))
    pip = [str(env / "bin" / "python"), "-m", "pip", "install", "-q"]
    # torch pinned to the local CPU build, as scripts/setup.sh does (a looser pin downloads CUDA).
    _ok(_run([*pip, "torch==2.13.0", HF_KERNELS], cwd=env.parent, timeout=900))
    _ok(_run([*pip, str(wheel)], cwd=env.parent, timeout=900))
    return env


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """A working directory that is not the repository (where a checkout's folders import)."""
    d = tmp_path / "user"
    d.mkdir()
    return d


def test_wheel_installs_one_top_level_package_with_its_data_files(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"kvstore"}, f"the wheel installs top-level {sorted(top)}"
    for data in ("kvstore/kernels/kv_copy.cu", "kvstore/client/integrations/vllm_cpu_copy.c",
                 "kvstore/proto/kvstore.proto", "kvstore/server/__main__.py"):
        assert data in names, f"{data} is missing from the wheel"
    entry_points = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "kvstore-server = kvstore.server.__main__:main" in entry_points
    assert "kvstore = kvstore.client.cli:main" in entry_points


def test_both_kernels_packages_import_side_by_side(venv: Path, elsewhere: Path) -> None:
    code = """
import importlib.util, sys
from kernels import get_kernel               # Hugging Face's, untouched by the wheel
import kvstore, kvstore.kernels, kvstore.client.integrations.paged, kvstore.server.app  # ours
from kvstore.client import KVClient
assert callable(get_kernel) and kvstore.kernels.gather
for name in ("client", "server", "tiers"):
    assert importlib.util.find_spec(name) is None, f"the venv has a top-level {name}"
print(kvstore.__file__)
"""
    out = _ok(_run([str(venv / "bin" / "python"), "-c", code], cwd=elsewhere))
    assert "site-packages/kvstore/__init__.py" in out, out  # the installed copy, not the tree


def test_console_scripts_run_and_the_readme_example_works(venv: Path, elsewhere: Path) -> None:
    bin_ = venv / "bin"
    sock = elsewhere / "kv.sock"
    target = f"unix://{sock}"
    r = _run([str(bin_ / "kvstore"), "ping", "--target", target], cwd=elsewhere, timeout=60)
    assert r.returncode == 1, f"ping of a missing daemon: {r.returncode} {r.stderr}"

    daemon = subprocess.Popen(
        [str(bin_ / "kvstore-server"), "--data-dir", str(elsewhere / "data"), "--socket",
         str(sock), "--host-bytes", "256MiB", "--disk-bytes", "512MiB"],
        cwd=elsewhere, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_ping(bin_, target, elsewhere, daemon)
        out = _ok(_run([str(bin_ / "python"), "-c", _readme_example(target)], cwd=elsewhere))
        assert "README example ok" in out, out
        stats = _ok(_run([str(bin_ / "kvstore"), "stats", "--json", "--target", target],
                         cwd=elsewhere, timeout=60))
        reply = json.loads(stats)
        assert int(reply["storedBlocks"]) == 2 and int(reply["hitBlocks"]) >= 2, reply
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(10)


def _wait_for_ping(bin_: Path, target: str, cwd: Path, daemon: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            pytest.fail(f"kvstore-server exited {daemon.returncode}: {daemon.stdout.read()}")  # type: ignore[union-attr]
        if _run([str(bin_ / "kvstore"), "ping", "--target", target], cwd=cwd,
                timeout=30).returncode == 0:
            return
        time.sleep(0.5)
    pytest.fail("kvstore-server did not answer a ping within 60 s")


def _readme_example(target: str) -> str:
    """The README's Python example, verbatim but for its socket, with the `tokens` and `kv` it
    leaves to the reader and checks of what it promises."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    example = next(b for b in blocks if "KVClient(" in b and "c.publish" in b)
    assert "unix:///run/kv.sock" in example, "the README example's target changed"
    example = example.replace("unix:///run/kv.sock", target)
    setup = """
import torch
tokens = list(range(1000, 1000 + 600))            # 2 full blocks of 256 and a tail
kv = torch.randn(32, 2, len(tokens), 8, 128).to(torch.bfloat16)
"""
    # Each call of the example, kept, and what it returned checked.
    example = (example.replace("    c.publish(tokens, kv)", "    published = c.publish(tokens, kv)")
                      .replace("    c.lookup(tokens)", "    found = c.lookup(tokens)"))
    check = """
assert published == 512 and found == 512 and n == 512, (published, found, n)
assert torch.equal(kv2, kv[:, :, :512]), "fetched bytes differ"
print("README example ok")
"""
    return setup + example + check
