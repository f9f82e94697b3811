"""Engine arguments against SGLang 0.5.23's own parser: the allow-list names real options of the right kind,
and no spelling of `--trust-remote-code` or a remote tokenizer gets through the runtime's parse."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from sglang.srt.server_args import ServerArgs

from tally_runtime.contract import ENGINE_ARG_SWITCHES, ENGINE_ARG_VALUES, STREAMING_FLAGS
from tally_runtime.engine.sglang import JSON_WHITESPACE_RUN, parse_pass_through, tally_defaults

pytestmark = pytest.mark.sglang


def sglang_options() -> dict[str, argparse.Action]:
    parser = argparse.ArgumentParser(add_help=False)
    ServerArgs.add_cli_args(parser)
    return {name: action for action in parser._actions for name in action.option_strings}


def test_every_allowed_option_is_a_full_sglang_option_of_its_kind() -> None:
    options = sglang_options()
    for name in ENGINE_ARG_VALUES:
        assert name in options, name
        assert options[name].nargs != 0, f"{name} is a switch in SGLang"
    for name in ENGINE_ARG_SWITCHES - STREAMING_FLAGS:
        assert name in options, name
        assert options[name].nargs == 0, f"{name} takes a value in SGLang"


@pytest.mark.parametrize("args", [
    pytest.param(["--chat-template=x --trust-remote --tokenizer-pa evil-org/evil"], id="joined-in-one-item"),
    pytest.param([" --trust-remote"], id="leading-space"),
    pytest.param(["--trust-remote"], id="abbreviation"),
    pytest.param(["--tokenizer-pa", "evil-org/evil"], id="abbreviated-tokenizer"),
])
def test_the_runtime_parse_never_turns_on_remote_code(args: list[str]) -> None:
    try:
        parsed = parse_pass_through(ServerArgs, args)
    except ValueError:
        return
    assert not parsed.get("trust_remote_code") and "tokenizer_path" not in parsed, parsed


def test_allowed_options_parse_to_their_fields() -> None:
    parsed = parse_pass_through(ServerArgs, ["--stream-interval=2", "--disable-radix-cache", "--device=cpu"])
    assert parsed["stream_interval"] == 2 and parsed["disable_radix_cache"] is True and parsed["device"] == "cpu"


def test_json_whitespace_runs_are_bounded_unless_a_service_says_otherwise() -> None:
    """SGLang's own default lets constrained JSON run whitespace without end (a request once spent its
    400 tokens so): Tally starts SGLang with a bound, a service's --constrained-json-max-whitespace-cnt wins,
    and a generation without the option gets nothing it would refuse."""
    assert tally_defaults(ServerArgs) == {"constrained_json_max_whitespace_cnt": JSON_WHITESPACE_RUN}
    given = {**tally_defaults(ServerArgs),
             **parse_pass_through(ServerArgs, ["--constrained-json-max-whitespace-cnt=2"])}
    assert given["constrained_json_max_whitespace_cnt"] == 2
    assert parse_pass_through(ServerArgs, ["--constrained-json-disable-any-whitespace"]) == {
        "constrained_json_disable_any_whitespace": True}

    @dataclasses.dataclass
    class Older:  # an older generation's ServerArgs, without the option
        model_path: str = ""

    assert tally_defaults(Older) == {}
