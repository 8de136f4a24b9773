"""An engine's extra config (`kvstore.*` keys) read into an integration's settings dataclass.

vLLM's `kv_connector_extra_config` and SGLang's storage extra config are loose dicts (JSON
from a command line): each key is checked against the dataclass's fields and each value
converted to its field's type, so a typo or a wrong value fails at engine start with a message
naming the key, never at the first request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

PREFIX = "kvstore."


def read_extra(cls: type[Any], extra: Mapping[str, Any] | None, what: str,
               error: type[Exception]) -> dict[str, Any]:
    """The `kvstore.*` keys of `extra` as keyword arguments of the dataclass `cls`, typed as
    its fields say (`int`, `float`, `bool`, `str`, each optionally `| None`). Raises `error`
    for a `kvstore.*` key that names no field of `cls`, or a value of the wrong type; keys
    without the prefix belong to the engine and are ignored."""
    extra = extra or {}
    types = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    known = {PREFIX + name for name in types}
    unknown = sorted(k for k in extra if k.startswith(PREFIX) and k not in known)
    if unknown:
        raise error(f"unknown kvstore {what} settings {unknown}; known: {sorted(known)}")
    values: dict[str, Any] = {}
    for key, value in extra.items():
        if key in known:
            name = key.removeprefix(PREFIX)
            values[name] = _typed(value, types[name], key, error)
    return values


def _typed(value: Any, annotation: str, key: str, error: type[Exception]) -> Any:
    parts = {p.strip() for p in annotation.split("|")}
    if value is None and "None" in parts:
        return None
    kind = (parts - {"None"}).pop() if len(parts - {"None"}) == 1 else annotation
    if kind == "bool":
        return as_bool(value, key, error)
    if kind in ("int", "float"):
        if isinstance(value, bool):
            raise error(f"{key} must be a number, got {value!r}")
        try:
            number = float(value) if kind == "float" else int(value)
        except (TypeError, ValueError):
            raise error(f"{key} must be a number, got {value!r}") from None
        return number
    if kind == "str":
        if not isinstance(value, str):
            raise error(f"{key} must be a string, got {value!r}")
        return value
    raise TypeError(f"setting {key} has a type read_extra does not convert: {annotation}")


def as_bool(value: Any, key: str, error: type[Exception]) -> bool:
    """`value` as a flag: a bool, or one of 1/0, true/false, yes/no, on/off in any case."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise error(f"{key} must be true or false, got {value!r}")
