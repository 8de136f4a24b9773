"""What docs/OPERATIONS.md says the daemon exports, checked against a `/metrics` page."""

from __future__ import annotations

import re
from pathlib import Path

OPERATIONS = Path(__file__).resolve().parents[1] / "docs" / "OPERATIONS.md"


def undocumented_exports(text: str, remote: bool) -> set[str]:
    """Metric names OPERATIONS.md documents that a `/metrics` page does not export: those of
    the remote tier (`remote`; a daemon without one exports none), or all the others."""
    documented = set(re.findall(r"`(kvstore_[a-z_]+)", OPERATIONS.read_text()))
    documented = {n for n in documented if n.startswith("kvstore_remote_") == remote}
    assert len(documented) > (3 if remote else 10)
    exported = set(re.findall(r"^(kvstore_[a-z_]+)", text, re.MULTILINE))
    return {n for n in documented if not any(e.startswith(n) for e in exported)}
