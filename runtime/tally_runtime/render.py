"""PURE: one stream's deltas as SSE event bytes.

The first chunk of each choice (role, echo) and chunks carrying a finish reason, logprobs or running
usage go through the chunk dicts; a plain text delta, the bulk of any stream, is written through a byte
template cut from that same dict path (`sse.text_template`), so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from tally_runtime import sse
from tally_runtime.engine.base import Delta
from tally_runtime.prepare import Job
from tally_runtime.streaming import ChatChunks, CompletionChunks, TextLogprobs
from tally_runtime.tools import GenericReply, reply
from tally_runtime.usage import ChoiceUsage

_dumps = orjson.dumps


class EventRenderer:
    """`add` each delta right after it was accounted in `usage` (running usage, `continuous_usage_stats`,
    is then the count as of that very chunk); `take` the events added since the last take."""

    def __init__(self, job: Job, usage: Sequence[ChoiceUsage]) -> None:
        self.job = job
        self.usage = usage
        self.chunks = job.endpoint.chunks(job.header)
        self.opened: set[int] = set()
        # Per opened choice, unless every chunk carries running usage (then no two chunks share bytes).
        self.templates: dict[int, tuple[bytes, bytes]] = {}
        self.out: list[bytes] = []
        self.held: dict[int, list[str]] = {}  # a tool call's output, until it is whole (tools.py)
        self.readers: dict[int, GenericReply] = {}  # the generic format's output: a reply streams as it is written
        if job.tools is not None:
            self.add = self._add_tool_call  # type: ignore[method-assign]

    def add(self, index: int, delta: Delta) -> None:
        """Render the events of one delta (once per token when the client keeps up: a bound method, kept
        lean)."""
        template = self.templates.get(index)
        if template is not None and delta.finish_reason is None and delta.logprobs is None:
            if delta.text:  # the event's three parts; `take` joins them (no bytes built per event)
                out = self.out
                out.append(template[0])
                out.append(_dumps(delta.text))
                out.append(template[1])
            return
        self.out.extend(sse.event(event) for event in self._dicts(index, delta))

    def _add_tool_call(self, index: int, delta: Delta) -> None:
        """A choice that may call tools: nothing but its role chunk until it ends; then the calls (or its text
        as content) and the finish reason. In the generic format a reply (not a call) is streamed as it is
        written: its text, never the JSON around it (tools.GenericReply)."""
        job, usage = self.job, self.usage[index]
        assert job.tools is not None and isinstance(self.chunks, ChatChunks)
        events: list[dict[str, Any]] = []
        if index not in self.opened:
            self.opened.add(index)
            events.append(self.chunks.role(index, usage.running_usage(0) if job.continuous_usage else None, None))
        held = self.held.setdefault(index, [])
        held.append(delta.text)
        streams = job.tools.instructions is not None and not job.tools.answer  # a reply in text: streamed
        reader = self.readers.setdefault(index, GenericReply()) if streams else None
        added = reader.feed(delta.text) if reader is not None else ""
        running = usage.running_usage() if job.continuous_usage else None
        if delta.finish_reason is None:
            if added:
                events.append(self.chunks.content(index, added, None, None, running))
        elif reader is not None and reader.kind == "response":  # streamed: what is left, and the finish reason
            events.append(self.chunks.content(index, added, None, str(delta.finish_reason), running))
        else:
            finish = str(delta.finish_reason)
            content, calls = reply(job.tools, "".join(held), finish)
            if calls:
                if content:
                    events.append(self.chunks.content(index, content, None, None))
                events.append(self.chunks.tool_calls(index, calls))
                events.append(self.chunks.content(index, "", None, "tool_calls" if finish == "stop" else finish,
                                                  running))
            else:
                events.append(self.chunks.content(index, content or "", None, finish, running))
        self.out.extend(sse.event(event) for event in events)

    def take(self) -> bytes:
        """The events added since the last take, as one write (empty if none)."""
        out, self.out = self.out, []
        return b"".join(out)

    def finish(self, usage: dict[str, Any]) -> bytes:
        """The end of a stream that completed: the usage chunk when asked for, then [DONE]."""
        return (sse.event(self.chunks.usage(usage)) if self.job.include_usage else b"") + sse.DONE

    def fail(self, message: str, code: int | str | None = 500) -> bytes:
        """The end of a stream that failed after its first byte: the in-band error, then [DONE]."""
        return sse.error_event(message, code=code) + sse.DONE

    def _dicts(self, index: int, delta: Delta) -> list[dict[str, Any]]:
        job = self.job
        events: list[dict[str, Any]] = []
        usage = self.usage[index]
        text = delta.text
        if index not in self.opened:
            self.opened.add(index)
            template = None if job.continuous_usage else sse.text_template(
                self.chunks.content(index, sse.TEXT_MARK, None, None))
            if template is not None:
                self.templates[index] = template
            if isinstance(self.chunks, ChatChunks):
                # The role chunk carries no token: its running usage has no completion tokens yet.
                events.append(self.chunks.role(index, usage.running_usage(0) if job.continuous_usage else None))
            elif job.echo:
                prefix = job.prompt_texts[index // job.n]
                text = prefix + text
                if isinstance(self.chunks, CompletionChunks):
                    self.chunks.logprobs[index] = TextLogprobs(len(prefix))  # offsets into the echoed text
        if text or delta.finish_reason is not None or delta.logprobs:
            finish = str(delta.finish_reason) if delta.finish_reason is not None else None
            running = usage.running_usage() if job.continuous_usage else None
            events.append(self.chunks.content(index, text, delta.logprobs, finish, running))
        return events
