"""`kvstore.client.integrations.settings.read_extra`: the `kvstore.*` keys of an engine's extra
config (vLLM's connector and SGLang's HiCache backend both read theirs with it)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvstore.client.integrations.settings import read_extra


class SettingsError(ValueError):
    pass


@dataclass(frozen=True)
class Settings:
    target: str = "unix:///x.sock"
    token: str | None = None
    block_tokens: int | None = None
    deadline_s: float = 1.0
    async_save: bool = True


def read(**extra: object) -> dict[str, object]:
    return read_extra(Settings, extra, "test", SettingsError)


def test_values_are_converted_to_their_fields_types() -> None:
    got = read(**{"kvstore.block_tokens": "256", "kvstore.deadline_s": "2.5",
                  "kvstore.async_save": "off", "kvstore.token": None, "other.key": object()})
    assert got == {"block_tokens": 256, "deadline_s": 2.5, "async_save": False, "token": None}
    assert Settings(**got).block_tokens == 256  # type: ignore[arg-type]


def test_none_and_empty_extra_read_as_no_settings() -> None:
    assert read_extra(Settings, None, "test", SettingsError) == {}
    assert read() == {}


@pytest.mark.parametrize(("extra", "message"), [
    ({"kvstore.targt": "x"}, "unknown kvstore test settings ['kvstore.targt']"),
    ({"kvstore.deadline_s": "soon"}, "kvstore.deadline_s must be a number, got 'soon'"),
    ({"kvstore.block_tokens": True}, "kvstore.block_tokens must be a number"),
    ({"kvstore.block_tokens": "2.5"}, "kvstore.block_tokens must be a number, got '2.5'"),
    ({"kvstore.deadline_s": None}, "kvstore.deadline_s must be a number"),
    ({"kvstore.async_save": "maybe"}, "kvstore.async_save must be true or false"),
    ({"kvstore.target": 7}, "kvstore.target must be a string, got 7"),
])
def test_bad_settings_name_the_key(extra: dict[str, object], message: str) -> None:
    with pytest.raises(SettingsError) as err:
        read_extra(Settings, extra, "test", SettingsError)
    assert message in str(err.value)
