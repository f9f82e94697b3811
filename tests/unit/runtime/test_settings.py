"""Unit tests of settings."""

from __future__ import annotations

import pytest

from tally_runtime.settings import Settings, settings_from


def test_defaults() -> None:
    assert settings_from([], {}) == Settings()


def test_flags_win_over_environment() -> None:
    environment = {"TALLY_PORT": "9000", "TALLY_CONTEXT_LENGTH": "1024", "TALLY_ENGINE_ARGS": '["--a=1 --b"]'}
    settings = settings_from(["--port", "9001", "--force-include-usage"], environment)
    assert settings.port == 9001 and settings.context_length == 1024
    assert settings.force_include_usage is True and settings.engine_args == ("--a=1 --b",)


def test_engine_args_are_one_item_per_flag_never_split() -> None:
    settings = settings_from(["--engine-arg=--chat-template=x --trust-remote", "--engine-arg", "2"], {})
    assert settings.engine_args == ("--chat-template=x --trust-remote", "2")


@pytest.mark.parametrize(("argv", "env"), [
    pytest.param(["--engine", "tpu"], {}, id="engine"),
    pytest.param(["--port", "0"], {}, id="port"),
    pytest.param([], {"TALLY_FORCE_INCLUDE_USAGE": "maybe"}, id="bool-env"),
    pytest.param(["--max-concurrent-generations", "0"], {}, id="slots"),
    pytest.param([], {"TALLY_ENGINE_ARGS": "--a 1"}, id="engine-args-not-a-json-array"),
    pytest.param(["--max-concurrent-gen", "2"], {}, id="abbreviated-flag"),
])
def test_bad_settings_exit_with_usage(argv: list[str], env: dict[str, str]) -> None:
    with pytest.raises(SystemExit) as caught:
        settings_from(argv, env)
    assert caught.value.code == 2
