"""`make soak`: the long versions of the fault and security tests, and their counts.

Runs `tests/fault` and `tests/security` with KV_SOAK_S set, so every time-bounded test
(kill loop, cancellation, eviction races, overload, fuzzing) runs that many seconds instead of
its `make test` few; each test appends what it saw to a report, printed here as a table with
totals: operations, kills, faults injected, wrong blocks served (must be 0).

    python scripts/soak.py --seconds 120 [-- extra pytest arguments]

Exit status: pytest's, or 1 if any wrong block was served.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ("operations", "kills", "faults", "wrong")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=120.0,
                   help="how long each time-bounded test runs (default 120)")
    p.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "soak.jsonl"
        env = {**os.environ, "KV_SOAK_S": str(args.seconds),
               "KV_SOAK_REPORT": str(report)}
        started = time.monotonic()
        rc = subprocess.call(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             f"--timeout={int(args.seconds * 3 + 600)}", "tests/fault", "tests/security",
             *args.pytest_args], cwd=ROOT, env=env)
        elapsed = time.monotonic() - started
        rows = [json.loads(line) for line in report.read_text().splitlines()] if (
            report.exists()) else []
    print(f"\nsoak: {len(rows)} test runs in {elapsed / 60:.1f} min, "
          f"KV_SOAK_S={args.seconds:g}")
    print(f"{'test':<44}" + "".join(f"{c:>12}" for c in COLUMNS) + "  other")
    totals = dict.fromkeys(COLUMNS, 0)
    for row in rows:
        name = row.pop("test")
        for c in COLUMNS:
            totals[c] += row.get(c, 0)
        other = ", ".join(f"{k}={v}" for k, v in row.items() if k not in COLUMNS)
        print(f"{name:<44}" + "".join(f"{row.get(c, 0):>12}" for c in COLUMNS) + f"  {other}")
    print(f"{'TOTAL':<44}" + "".join(f"{totals[c]:>12}" for c in COLUMNS))
    if totals["wrong"]:
        print(f"FAIL: {totals['wrong']} wrong blocks served")
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
