"""`kvstore.malloc_tuning`: glibc's thresholds set once per process, and left alone on
request (`KVSTORE_MALLOC_TUNING=0`). Each case runs in a fresh interpreter: the settings are
process-wide and applied once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
from kvstore import malloc_tuning
applied = malloc_tuning.keep_large_buffers()
assert malloc_tuning.keep_large_buffers() is applied  # once: the second call is the first's
print(applied)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
@pytest.mark.parametrize("opt_out", [None, "0"])
def test_thresholds_are_applied_once_or_left_alone(opt_out: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_MALLOC_TUNING"}
    if opt_out is not None:
        env["KVSTORE_MALLOC_TUNING"] = opt_out
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out[0] == str(opt_out is None), out
