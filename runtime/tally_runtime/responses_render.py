"""PURE: one Responses API stream's deltas as its named SSE events.

The sequence the `openai` SDK's `responses.stream()` consumes: `response.created` and
`response.in_progress`, then per output item `response.output_item.added`, for a message
`response.content_part.added`, `response.output_text.delta`... `response.output_text.done`,
`response.content_part.done`, for a function call `response.function_call_arguments.delta` and `.done`,
then `response.output_item.done`; last `response.completed` (or `response.incomplete`, cut at
max_output_tokens) with the engine's usage. Every event carries its `sequence_number`; no `[DONE]` follows.
A failure after the first byte is an `error` event, then `response.failed`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from tally_runtime.engine.base import Delta, TokenLogprob
from tally_runtime.prepare import Job
from tally_runtime.responses_api import (
    message_id,
    message_item,
    output_items,
    response_object,
    status_of,
    token_logprobs,
)
from tally_runtime.tools import GenericReply
from tally_runtime.usage import ChoiceUsage


def named_event(payload: dict[str, Any]) -> bytes:
    """`event: <type>` and its JSON, as the Responses API frames them."""
    return b"event: " + str(payload["type"]).encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


class ResponsesRenderer:
    """`add` each delta after it was counted; `take` the events since the last take; `finish` with the usage,
    or `fail`. A tool call's output is held until it is whole (it is parsed into calls, as for chat); the generic
    format's reply is streamed as it is written (tools.GenericReply)."""

    def __init__(self, job: Job, usage: Sequence[ChoiceUsage]) -> None:
        self.job = job
        self.head = job.header
        self.sequence = 0
        self.out: list[bytes] = []
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []  # with `include` of the output text's logprobs
        self.finish_reason: str | None = None
        self.opened = False
        self.items: list[dict[str, Any]] = []
        self.streamed = ""  # the generic format's reply, sent as it was written (tools.GenericReply)
        self.reader = GenericReply() if job.tools is not None and job.tools.instructions is not None \
            and not job.tools.answer else None
        opening = response_object(self.head, "in_progress", [], None, brief=True)  # the request's tools: once, last
        self.emit("response.created", response=opening)
        self.emit("response.in_progress", response=opening)

    def emit(self, kind: str, **fields: Any) -> None:
        self.out.append(named_event({"type": kind, "sequence_number": self.sequence, **fields}))
        self.sequence += 1

    def add(self, index: int, delta: Delta) -> None:
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.text:
            self.text.append(delta.text)
            shown = delta.text if self.job.tools is None else self.reader.feed(delta.text) if self.reader else ""
            if shown:
                self._open_message()
                self.streamed += shown
                self.emit("response.output_text.delta", item_id=message_id(self.head.id), output_index=0,
                          content_index=0, delta=shown, logprobs=token_logprobs(delta.logprobs or ()))
        if delta.finish_reason is not None:
            self.finish_reason = str(delta.finish_reason)
            self._close_items()

    def _open_message(self) -> None:
        if not self.opened:
            self.opened = True
            self.emit("response.output_item.added", output_index=0,
                      item=message_item(self.head.id, None, "in_progress"))
            self.emit("response.content_part.added", item_id=message_id(self.head.id), output_index=0, content_index=0,
                      part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})

    def _close_items(self) -> None:
        text = "".join(self.text)
        self.items = output_items(self.head.id, text, self.finish_reason, self.job.tools, self.logprobs)
        for k, item in enumerate(self.items):
            if item["type"] == "message":
                self._open_message()
                whole = item["content"][0]["text"] if item["content"] else ""
                if self.job.tools is not None and whole.startswith(self.streamed) and whole != self.streamed:
                    self.emit("response.output_text.delta", item_id=item["id"], output_index=k, content_index=0,
                              delta=whole[len(self.streamed):], logprobs=[])  # held until whole: the rest now
                part = item["content"][0]
                self.emit("response.output_text.done", item_id=item["id"], output_index=k, content_index=0,
                          text=part["text"], logprobs=part["logprobs"])
                self.emit("response.content_part.done", item_id=item["id"], output_index=k, content_index=0,
                          part=part)
            else:
                opening = {**item, "arguments": "", "status": "in_progress"}
                self.emit("response.output_item.added", output_index=k, item=opening)
                self.emit("response.function_call_arguments.delta", item_id=item["id"], output_index=k,
                          delta=item["arguments"])
                self.emit("response.function_call_arguments.done", item_id=item["id"], output_index=k,
                          name=item["name"], arguments=item["arguments"])
            self.emit("response.output_item.done", output_index=k, item=item)

    def take(self) -> bytes:
        out, self.out = self.out, []
        return b"".join(out)

    def finish(self, usage: dict[str, Any]) -> bytes:
        """The closing event, with the engine's usage: `response.completed`, or `response.incomplete`."""
        status = status_of(self.finish_reason)
        self.emit(f"response.{status}", response=response_object(self.head, status, self.items, usage,
                                                                 self.finish_reason))
        return self.take()

    def fail(self, message: str, code: int | str | None = 500) -> bytes:
        """An error after the first byte: the `error` event, then the response `failed`."""
        self.emit("error", code=str(code), message=message, param=None)
        error = {"code": "server_error", "message": message}
        self.emit("response.failed", response=response_object(self.head, "failed", self.items, None, error=error))
        return self.take()
