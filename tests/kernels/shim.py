"""Run kernels/kv_copy.cu on the CPU: the host-shim build and one-launch runner.

``build_shim`` compiles the kernel source as C++ (g++, ASan + UBSan) under
host_shim/cuda_host_shim.h into a standalone executable. ``ShimRunner`` runs one
kernel launch with it: it writes every storage the launch touches to files,
runs the executable, and returns the bytes the kernel left behind.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from pathlib import Path

import torch

from kvstore.kernels.plan import KernelLaunch, scalar_args

REPO_ROOT = Path(__file__).resolve().parents[2]

SHIM_DIR = Path(__file__).resolve().parent / "host_shim"
KV_COPY_CU = REPO_ROOT / "kernels" / "kv_copy.cu"
SHIM_FLAGS = (
    "-std=c++17",
    "-O1",
    "-g",
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",
    "-fno-omit-frame-pointer",
    # Kernels reinterpret byte pointers as vector types, as CUDA code does.
    "-fno-strict-aliasing",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wno-unknown-pragmas",  # #pragma unroll is for nvcc
)
SANITIZER_ENV = {
    # Leak checking says nothing about the kernel and LeakSanitizer refuses to
    # run under ptrace (debuggers, some CI sandboxes): off.
    "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0:exitcode=86",
    "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1:exitcode=87",
}


def build_shim(out_dir: Path, source: Path = KV_COPY_CU) -> Path:
    """Compile ``source`` + the driver into an ASan/UBSan executable."""
    exe = out_dir / "kvcopy_host"
    cmd = [
        "g++",
        *SHIM_FLAGS,
        "-include",
        str(SHIM_DIR / "cuda_host_shim.h"),
        f'-DKV_KERNEL_SOURCE="{source}"',
        str(SHIM_DIR / "driver.cpp"),
        "-o",
        str(exe),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode:
        raise RuntimeError(f"host shim build failed:\n{' '.join(cmd)}\n{result.stderr}")
    return exe


def storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor aliasing a whole storage."""
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))


@dataclasses.dataclass
class ShimResult:
    """Bytes of every storage after the kernel ran, keyed by storage address."""

    after: dict[int, torch.Tensor]
    stderr: str


class ShimRunner:
    """Runs one ``KernelLaunch`` through the host-shim executable."""

    def __init__(self, exe: Path, work: Path) -> None:
        self.exe = exe
        self.work = work
        self.runs = 0

    def run(
        self,
        plan: KernelLaunch,
        tensors: list[torch.Tensor],
        page_ids: torch.Tensor,
        slot_ids: torch.Tensor,
        *,
        reverse: bool = False,
        check: bool = True,
    ) -> ShimResult:
        self.runs += 1
        job_dir = self.work / f"job{self.runs}"
        job_dir.mkdir()
        storages: dict[int, torch.UntypedStorage] = {}
        for t in tensors:
            st = t.untyped_storage()
            storages.setdefault(st.data_ptr(), st)
        order = sorted(storages)

        def locate(address: int) -> tuple[int, int]:
            for i, base in enumerate(order):
                if base <= address <= base + storages[base].nbytes():
                    return i, address - base
            raise AssertionError(f"address {address:#x} is in no storage of the launch")

        lines = [
            f"kernel {plan.kernel}",
            "grid {} {} {}".format(*plan.grid),
            "block {} {} {}".format(*plan.block),
            f"order {'reverse' if reverse else 'forward'}",
            "scalars " + " ".join(str(v) for v in scalar_args(plan)),
            f"buffers {len(order)}",
        ]
        for i, base in enumerate(order):
            path = job_dir / f"buf{i}.bin"
            path.write_bytes(storage_bytes(storages[base]).numpy().tobytes())
            lines.append(f"{path} {base % 256}")
        lines.append(f"planes {len(plan.plane_ptrs)}")
        lines += ["{} {}".format(*locate(p)) for p in plan.plane_ptrs]
        ids = torch.cat([page_ids.reshape(-1), slot_ids.reshape(-1)]).to(torch.int64)
        (job_dir / "ids.bin").write_bytes(ids.numpy().tobytes())
        lines.append(f"ids {job_dir / 'ids.bin'} {page_ids.numel()} {slot_ids.numel()}")
        lines.append("staging {} {}".format(*locate(plan.staging_ptr)))
        job = job_dir / "job.txt"
        job.write_text("\n".join(lines) + "\n")
        # Not LD_PRELOAD: vLLM sets it (tcmalloc, libgomp) in this process when a test builds
        # an engine or its config, and the ASan runtime must come first in the shim.
        env = {**{k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}, **SANITIZER_ENV}
        proc = subprocess.run(
            [str(self.exe), str(job)], capture_output=True, text=True, env=env, check=False
        )
        if check and proc.returncode:
            raise AssertionError(
                f"host shim exited {proc.returncode} for {plan.kernel}:\n{proc.stderr[-6000:]}"
            )
        after = {
            base: torch.frombuffer(
                bytearray((job_dir / f"buf{i}.bin.out").read_bytes()), dtype=torch.uint8
            )
            for i, base in enumerate(order)
            if proc.returncode == 0
        }
        shutil.rmtree(job_dir)
        return ShimResult(after=after, stderr=proc.stderr)
