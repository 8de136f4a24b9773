"""docs/CONFIG.md is generated from the configuration's definitions and must not drift."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvstore.config import ServerConfig
from kvstore.configdoc import render

DOC = Path(__file__).resolve().parents[2] / "docs" / "CONFIG.md"


def test_config_md_is_up_to_date():
    assert DOC.read_text() == render(), (
        "docs/CONFIG.md is stale: run `python -m kvstore.configdoc > docs/CONFIG.md`")


def test_every_option_is_documented_with_bounds_or_choices():
    for f in dataclasses.fields(ServerConfig):
        assert f.metadata["doc"], f.name
        assert f"`{f.name}`" in DOC.read_text(), f.name
        if isinstance(f.default, int | float) and not isinstance(f.default, bool):
            assert f.metadata["min"] is not None, f"{f.name} has no lower bound"
