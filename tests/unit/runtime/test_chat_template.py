"""A chat template that refuses a conversation: the client's messages are at fault, so it is a 400 naming
`messages` (a 500 is retried by SDKs twice, so each such call ran three times)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import pytest
from scripted_engine import INFO, Script, ScriptedEngine

from tally_runtime.prepare import Preparer
from tally_runtime.protocol import ApiError, ChatCompletionRequest, validated


class StrictTemplate(ScriptedEngine):
    def render_chat(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        roles = [m["role"] for m in messages]
        if any(a == b for a, b in pairwise(roles)):
            raise ValueError("Conversation roles must alternate user/assistant/user/assistant/...")
        return super().render_chat(messages, tools)


class BrokenTemplate(ScriptedEngine):
    def render_chat(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        raise KeyError("a template bug, not the client's")


def prepare(engine: ScriptedEngine, roles: list[str]) -> object:
    body = {"messages": [{"role": r, "content": f"hi {i}"} for i, r in enumerate(roles)], "max_tokens": 2}
    return asyncio.run(Preparer(engine, INFO, "m", 4).chat(validated(ChatCompletionRequest, body)))


def test_a_template_refusal_is_a_400_naming_messages() -> None:
    with pytest.raises(ApiError) as refused:
        prepare(StrictTemplate(Script({})), ["user", "user"])
    assert (refused.value.status, refused.value.param) == (400, "messages")
    assert "alternate" in refused.value.message
    assert prepare(StrictTemplate(Script({})), ["user", "assistant", "user"]) is not None


def test_a_template_that_is_broken_is_still_the_servers_error() -> None:
    with pytest.raises(KeyError):
        prepare(BrokenTemplate(Script({})), ["user"])
