"""Every CUDA source compiles for sm_80 and sm_90, with no GPU and no driver.

NVRTC is what production uses (cupy.RawModule); nvcc is a second, stricter
front end and reports register use and spills through ptxas. Both produce
real-architecture CUBINs here. The PTX check proves the fast path really
issues 16-byte loads and stores.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvstore.kernels.cuda import KV_COPY_SOURCE, NVRTC_OPTIONS, cuda_sources
from kvstore.kernels.plan import KERNEL_NAMES, POINTER_PARAMS, SCALAR_PARAMS, UNROLL

ARCHS = ("sm_80", "sm_90")
SOURCES = cuda_sources()


def _nvrtc() -> Any:
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception as e:  # ImportError, or the NVRTC library failing to load
        pytest.skip(f"NVRTC unavailable (pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12): {e}")
    return nvrtc


def nvrtc_compile(source: Path, arch: str, want: str) -> bytes:
    nvrtc = _nvrtc()
    prog = nvrtc.createProgram(source.read_text(), source.name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", *NVRTC_OPTIONS])
        except nvrtc.NVRTCError as e:
            raise AssertionError(f"NVRTC {arch}: {e}\n{nvrtc.getProgramLog(prog)}") from e
        log = nvrtc.getProgramLog(prog).strip("\x00\n ")
        assert not log, f"NVRTC {arch} warnings for {source.name}:\n{log}"
        return nvrtc.getCUBIN(prog) if want == "cubin" else nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)


def test_there_are_sources() -> None:
    assert KV_COPY_SOURCE in SOURCES


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_nvrtc_cubin(source: Path, arch: str) -> None:
    cubin = nvrtc_compile(source, arch, "cubin")
    assert cubin[:4] == b"\x7fELF", "NVRTC did not produce an ELF cubin"
    for name in KERNEL_NAMES:
        assert name.encode() in cubin, f"{name} missing from the {arch} cubin"


def test_fast_path_uses_16_byte_accesses() -> None:
    ptx = nvrtc_compile(KV_COPY_SOURCE, "compute_90", "ptx").decode()
    for name in ("kv_gather_v16", "kv_scatter_v16"):
        body = ptx.split(f".entry {name}(", 1)[1].split("\n}\n", 1)[0]
        assert re.search(r"ld\.global(\.nc)?\.v4\.u32", body), f"{name}: no 16-byte loads"
        assert re.search(r"st\.global\.v4\.u32", body), f"{name}: no 16-byte stores"
        assert len(re.findall(r"\.v4\.u32", body)) == 2 * UNROLL, f"{name}: unroll changed"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_nvcc_cubin(source: Path, arch: str, tmp_path: Path) -> None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not on PATH (install the CUDA toolkit to run this check)")
    out = tmp_path / f"{source.stem}.{arch}.cubin"
    cmd = [nvcc, f"-arch={arch}", "-cubin", "-std=c++17", "-Xptxas", "-v"]
    cmd += ["--Werror", "all-warnings", "-x", "cu", str(source), "-o", str(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr}"
    assert out.read_bytes()[:4] == b"\x7fELF"
    usage = re.findall(
        r"Compiling entry function '(\w+)'.*?(\d+) bytes stack frame, (\d+) bytes spill stores, "
        r"(\d+) bytes spill loads.*?Used (\d+) registers",
        result.stderr,
        flags=re.S,
    )
    assert sorted(u[0] for u in usage) == sorted(KERNEL_NAMES), result.stderr
    for name, stack, spill_st, spill_ld, regs in usage:
        # A copy kernel that spills or runs short of registers loses bandwidth.
        assert (stack, spill_st, spill_ld) == ("0", "0", "0"), f"{name} spills on {arch}"
        assert int(regs) <= 64, f"{name} uses {regs} registers on {arch}"


def test_kernel_signature_matches_python() -> None:
    cu = KV_COPY_SOURCE.read_text()
    macro = cu.split("#define KV_COPY_ARGS", 1)[1].split("#define", 1)[0]
    params = re.findall(
        r"(kv_u64|kv_i64|int|unsigned char)\s*\*?\s*(?:__restrict__\s+)?(\w+)", macro
    )
    names = [n for _, n in params]
    assert names == [*POINTER_PARAMS, *(n for n, _ in SCALAR_PARAMS)], names
    c_types = {"i32": "int", "i64": "kv_i64"}
    assert [t for t, _ in params[len(POINTER_PARAMS) :]] == [c_types[t] for _, t in SCALAR_PARAMS]
    assert re.search(rf"#define KV_UNROLL {UNROLL}\b", cu), "UNROLL differs from kv_copy.cu"
