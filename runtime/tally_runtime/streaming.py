"""Pure translation of normalized engine deltas into OpenAI chunks and responses.

Two shapes: legacy completions (`text_completion`) and chat (`chat.completion.chunk`). Nothing
here does I/O; `serving.py` drives it. Wire rules (OPENAI_PROTOCOL.md §1): id and created are
constant per response, content chunks carry `usage: null` unless continuous stats were asked for,
the usage chunk has `choices: []`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tally_runtime.engine.base import TokenLogprob
from tally_runtime.tools import ToolPlan, reply


@dataclass(slots=True)
class TextLogprobs:
    """Legacy completions logprobs; `text_offset` continues across chunks of one choice."""

    offset: int = 0

    def render(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        offsets = []
        for item in logprobs:
            offsets.append(self.offset)
            self.offset += len(item.token)
        return {
            "tokens": [item.token for item in logprobs],
            "token_logprobs": [item.logprob for item in logprobs],
            "top_logprobs": [dict(item.top) for item in logprobs],
            "text_offset": offsets,
        }


def chat_logprobs(logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": item.token,
                "logprob": item.logprob,
                "bytes": list(item.token.encode()),
                "top_logprobs": [
                    {"token": tok, "logprob": lp, "bytes": list(tok.encode())} for tok, lp in item.top
                ],
            }
            for item in logprobs
        ],
        "refusal": None,
    }


@dataclass(frozen=True, slots=True)
class ResponseHeader:
    id: str
    created: int
    model: str

    def envelope(self, kind: str, choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        """One response object or chunk: the same id and created on every chunk of a response."""
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                "usage": usage}


@dataclass(slots=True)
class CompletionChunks:
    header: ResponseHeader
    logprobs: dict[int, TextLogprobs] = field(default_factory=dict)

    def content(
        self,
        index: int,
        text: str,
        logprobs: Sequence[TokenLogprob] | None,
        finish_reason: str | None,
        usage: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        rendered = None
        if logprobs is not None:
            rendered = self.logprobs.setdefault(index, TextLogprobs()).render(logprobs)
        choice = {"index": index, "text": text, "logprobs": rendered, "finish_reason": finish_reason}
        return self._envelope([choice], usage)

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        return self._envelope([], usage)

    def _envelope(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        return self.header.envelope("text_completion", choices, usage)


@dataclass(slots=True)
class ChatChunks:
    header: ResponseHeader

    def role(self, index: int, usage: dict[str, Any] | None = None, content: str | None = "") -> dict[str, Any]:
        """The first chunk of a choice (`content` None for a tool call, as OpenAI sends it)."""
        return self._envelope(
            [{"index": index, "delta": {"role": "assistant", "content": content}, "logprobs": None,
              "finish_reason": None}],
            usage,
        )

    def content(
        self,
        index: int,
        text: str,
        logprobs: Sequence[TokenLogprob] | None,
        finish_reason: str | None,
        usage: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        rendered = chat_logprobs(logprobs) if logprobs is not None else None
        choice = {"index": index, "delta": delta, "logprobs": rendered, "finish_reason": finish_reason}
        return self._envelope([choice], usage)

    def tool_calls(self, index: int, calls: list[dict[str, Any]]) -> dict[str, Any]:
        """One chunk with the whole of each call (the SDK's stream helpers assemble deltas the same way)."""
        delta = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
        return self._envelope([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}], None)

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        return self._envelope([], usage)

    def _envelope(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        return self.header.envelope("chat.completion.chunk", choices, usage)


@dataclass(slots=True)
class ChoiceResult:
    """One choice of a non-streamed response, accumulated from its deltas."""

    index: int
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    text_offset: int = 0  # where the generated text starts in `text` (after an echoed prompt)


def completion_response(
    header: ResponseHeader, results: Sequence[ChoiceResult], usage: dict[str, Any], tools: ToolPlan | None = None,
) -> dict[str, Any]:
    choices = []
    for result in sorted(results, key=lambda r: r.index):
        rendered = TextLogprobs(result.text_offset).render(result.logprobs) if result.logprobs is not None else None
        choices.append(
            {"index": result.index, "text": result.text, "logprobs": rendered, "finish_reason": result.finish_reason}
        )
    return header.envelope("text_completion", choices, usage)


def chat_response(header: ResponseHeader, results: Sequence[ChoiceResult], usage: dict[str, Any],
                  tools: ToolPlan | None = None) -> dict[str, Any]:
    choices = []
    for result in sorted(results, key=lambda r: r.index):
        content, calls = reply(tools, result.text, result.finish_reason)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:  # content None unless the model wrote text around its calls, as OpenAI sends it
            message["tool_calls"] = calls
        choices.append(
            {
                "index": result.index,
                "message": message,
                "logprobs": chat_logprobs(result.logprobs) if result.logprobs is not None else None,
                "finish_reason": "tool_calls" if calls and result.finish_reason == "stop" else result.finish_reason,
            }
        )
    return header.envelope("chat.completion", choices, usage)
