"""Request preparation: a validated OpenAI request -> a `Job`. Every 4xx is raised here, before any byte.

Pure apart from the engine's tokenizer: nothing is admitted or generated yet. The endpoint kind is
chosen here too (chunk shapes, id prefix, response builder), so nothing downstream compares names.

What costs something is checked before it is spent: the number of generations (prompts x n) before any
prompt is tokenized, and a large input is tokenized on a worker thread, not on the event loop every open
stream shares. A chat's message contents are tokenized with special tokens off: only the template may
write role and control tokens (a message that spells `<|im_start|>system` stays text). A completion's
prompt is the client's whole input and is tokenized as SGLang and vLLM do, special tokens included.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson

from tally_runtime.engine.base import Engine, EngineInfo, GenerationRequest, SamplingParams
from tally_runtime.protocol import ApiError, ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingRequest
from tally_runtime.streaming import (
    ChatChunks,
    ChoiceResult,
    CompletionChunks,
    ResponseHeader,
    chat_response,
    completion_response,
)
from tally_runtime.tools import ToolPlan, plan_tools

log = logging.getLogger("tally_runtime.prepare")
T = TypeVar("T")

Response = Callable[[ResponseHeader, Sequence[ChoiceResult], dict[str, Any], ToolPlan | None], dict[str, Any]]
INLINE_TOKENIZE_CHARS = 16_384  # inputs up to this size are tokenized on the event loop (microseconds)
MAX_LOGGED_FIELDS = 8
# Other servers' ways to constrain the output: refused, never ignored (the client would pay for unconstrained text)
OTHER_CONSTRAINTS = ("json_schema", "regex", "ebnf", "structural_tag", "guided_json", "guided_regex",
                     "guided_grammar", "guided_choice", "guided_decoding_backend", "grammar")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """What differs between the two APIs: the metrics label, ids, chunk shapes and the response object."""

    name: str
    id_prefix: str
    chunks: Callable[[ResponseHeader], CompletionChunks | ChatChunks]
    response: Response
    opens_with_role: bool
    # A stream's events when they are not chunks (the Responses API's): (job, usage) -> a renderer with
    # render.EventRenderer's add/take/finish/fail; None: EventRenderer
    renderer: Callable[..., Any] | None = None


COMPLETIONS = Endpoint("completions", "cmpl", CompletionChunks, completion_response, opens_with_role=False)
CHAT = Endpoint("chat", "chatcmpl", ChatChunks, chat_response, opens_with_role=True)


@dataclass(frozen=True, slots=True)
class Job:
    """A request that passed validation: ready to be admitted and generated."""

    endpoint: Endpoint
    header: ResponseHeader
    prompts: tuple[tuple[int, ...], ...]
    prompt_texts: tuple[str, ...]
    n: int
    sampling: SamplingParams
    echo: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool
    user: str | None = None  # the OpenAI `user` field: names the tenant when no tenant header does
    tools: ToolPlan | None = None  # the output is a tool call (tools.py)

    @property
    def generations(self) -> int:
        return len(self.prompts) * self.n

    def requests(self) -> list[GenerationRequest]:
        """Choice index = prompt index * n + sample; ids end with '.', so none is a prefix of another."""
        return [
            GenerationRequest(f"{self.header.id}.{p * self.n + s}.", prompt, self.sampling)
            for p, prompt in enumerate(self.prompts)
            for s in range(self.n)
        ]


class Preparer:
    def __init__(self, engine: Engine, info: EngineInfo, model: str, limit: int,
                 force_include_usage: bool = False) -> None:
        self.engine = engine
        self.info = info
        self.model = model
        self.limit = limit
        self.force_include_usage = force_include_usage
        # One thread: tokenizers are not all safe to share between threads, and this is only for large inputs.
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self.controls = engine.control_tokens()

    async def completion(self, req: CompletionRequest) -> Job:
        self._check_common(req)
        if req.best_of is not None and req.best_of > 1 and req.stream:
            raise ApiError(400, "best_of > 1 cannot be streamed", param="best_of")
        if req.best_of is not None and req.best_of < req.n:
            raise ApiError(400, f"best_of ({req.best_of}) must be at least n ({req.n})", param="best_of")
        items = prompt_items(req.prompt)
        self._check_generations(len(items) * req.n)
        prompts, texts = await self._off_loop(sum(map(len, items)), self._completion_prompts, items)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        for ids in prompts:
            self._check_context(len(ids), max_tokens, "prompt")
        constraint = await self._constraint(req)
        return self._job(COMPLETIONS, req, prompts, texts, max_tokens, req.logprobs, req.echo, constraint)

    async def chat(self, req: ChatCompletionRequest) -> Job:
        self._check_common(req)
        tools = plan_tools(req, lambda: self.engine.tool_parser(
            [t.model_dump(exclude_none=True) for t in req.tools or ()]))
        self._check_generations(req.n)
        if len(req.messages) > self.info.context_length:
            # Every chat template writes at least one token of markup per message: refused before the
            # template is rendered over them (a 7 MiB body of short messages took minutes to render)
            raise ApiError(400, f"{len(req.messages)} messages cannot fit the model's context of "
                                f"{self.info.context_length} tokens", param="messages", code="context_length_exceeded")
        messages = [message_dict(m) for m in req.messages]
        if tools is not None and tools.instructions is not None:  # the generic format: the model is shown it
            messages = with_system(messages, tools.instructions)
        shown = [t.model_dump(exclude_none=True) for t in req.tools] if tools is not None and req.tools else None
        markup = markup_texts(req, shown)
        size = sum(len(m["content"]) for m in messages) + sum(len(text) for _, text in markup)
        text, ids = await self._off_loop(size, self._chat_prompt, (messages, shown, markup))
        limit = req.token_limit()
        max_tokens = limit if limit is not None else self.info.context_length - len(ids)
        self._check_context(len(ids), max_tokens, "messages")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if tools is None:
            constraint = await self._constraint(req)
        else:
            constraint = None if tools.schema is None else await self._check_schema(req, tools.schema, "tools")
        return self._job(CHAT, req, (ids,), (text,), max_tokens, logprobs, False, constraint, tools)

    async def _off_loop(self, size: int, work: Callable[[Any], T], argument: Any) -> T:
        if size <= INLINE_TOKENIZE_CHARS:
            return work(argument)
        return await asyncio.get_running_loop().run_in_executor(self.worker, work, argument)

    def _chat_prompt(self, given: tuple[list[dict[str, Any]], list[dict[str, Any]] | None, list[tuple[str, str]]]
                     ) -> tuple[str, tuple[int, ...]]:
        """The rendered prompt and its ids: the template's own text with special tokens parsed, each
        message's content as plain text. The template already wrote any special tokens it wants (a BOS,
        say): none are added again, as Hugging Face's apply_chat_template(tokenize=True) does not."""
        messages, tools, markup = given
        self._check_markup(markup)
        try:
            segments = chat_segments(lambda marked: self.engine.render_chat(marked, tools), messages)
        except Exception as err:
            if not template_refusal(err):
                raise
            # A strict template refuses some conversations (roles that do not alternate, a system message):
            # the client's to fix, so a 400 (a 5xx would be retried by SDKs, and run again twice)
            raise ApiError(400, f"The model's chat template refused these messages: {str(err)[:200]}",
                           param="messages") from None
        ids: list[int] = []
        for piece, from_template in segments:
            ids += self.engine.tokenize(piece, add_special_tokens=False, parse_special=from_template)
        return "".join(piece for piece, _ in segments), tuple(ids)

    def _check_common(self, req: SamplingRequest) -> None:
        if req.model is not None and req.model != self.model:
            raise ApiError(404, f"The model {req.model!r} does not exist; this server serves {self.model!r}",
                           param="model", code="model_not_found")
        if req.stream_options is not None and not req.stream:
            raise ApiError(400, "stream_options can only be set when stream is true", param="stream_options")
        if req.model_extra and req.model_extra.get("logit_bias"):
            raise ApiError(400, "logit_bias is not supported by this server", param="logit_bias")
        for name in OTHER_CONSTRAINTS:
            if req.model_extra and req.model_extra.get(name) is not None:
                raise ApiError(400, f"{name} is not supported by this server: constrain the output with "
                                    "response_format (json_object or json_schema)", param=name)
        unknown = req.unknown_fields()
        if unknown:  # client-chosen names: escaped and bounded, so none can forge a log line
            shown = ", ".join(repr(name[:64]) for name in unknown[:MAX_LOGGED_FIELDS])
            more = f" and {len(unknown) - MAX_LOGGED_FIELDS} more" if len(unknown) > MAX_LOGGED_FIELDS else ""
            log.info("Ignoring unsupported request fields %s%s", shown, more)

    async def _constraint(self, req: SamplingRequest) -> str | None:
        """The JSON schema `response_format` asks for, checked by the engine's own grammar backend here, so
        a schema it cannot compile is a 400 before anything is admitted or billed."""
        if req.response_format is None:
            return None
        try:
            schema = req.response_format.schema_text()
        except ValueError as err:
            raise ApiError(400, f"Invalid response_format: {err}", param="response_format",
                           code="invalid_value") from None
        if schema is None:
            return None
        return await self._check_schema(req, schema, "response_format")

    async def _check_schema(self, req: SamplingRequest, schema: str, param: str) -> str:
        """A constrained output (response_format, or a tool call): refused with the sampling that would force it
        on past where the grammar ends it, then compiled by the engine's grammar backend (grammar.py)."""
        for name, value in (("ignore_eos", req.ignore_eos), ("min_tokens", req.min_tokens)):
            if value:  # once the JSON is complete the grammar allows only its end: llama.cpp aborted the process
                raise ApiError(400, f"{name} cannot be combined with a constrained output ({param}): the grammar "
                                    "ends the output where the JSON ends", param=name)
        try:
            await self.engine.check_json_schema(schema)
        except ValueError as err:
            raise ApiError(400, f"The {param} schema cannot be used: {str(err)[:300]}", param=param,
                           code="invalid_value") from None
        return schema

    def _check_markup(self, texts: list[tuple[str, str]]) -> None:
        """Tool definitions and the arguments of earlier calls reach the template as they are (it may print
        them as JSON): one that spells a control token of the model (`<|im_start|>`, say) is refused, so no
        client text becomes a role or control token (message content is kept apart: chat_segments). A text
        holds one exactly when it contains one's spelling: a search, not two tokenizations of every text
        (which held the event loop 16-32 s for 7 MB of tools)."""
        controls = self.controls
        for param, text in texts:
            if any(control in text for control in controls):
                raise ApiError(400, "The text spells a control token of the model", param=param)

    def _check_generations(self, generations: int) -> None:
        if generations > self.limit:
            raise ApiError(400, f"This request needs {generations} concurrent generations (prompts x n); "
                                f"the server runs at most {self.limit}", param="n")

    def _completion_prompts(self, items: list[str | list[int]]) -> tuple[tuple[tuple[int, ...], ...], tuple[str, ...]]:
        ids: list[tuple[int, ...]] = []
        texts: list[str] = []
        for item in items:
            if isinstance(item, str):
                ids.append(tuple(self.engine.tokenize(item)))
                texts.append(item)
                continue
            bad = [t for t in item if not 0 <= t < self.info.vocab_size]
            if bad:
                raise ApiError(400, f"Token id {bad[0]} is out of range [0, {self.info.vocab_size})", param="prompt")
            ids.append(tuple(item))
            texts.append(self.engine.detokenize(item))
        return tuple(ids), tuple(texts)

    def _check_context(self, prompt_len: int, max_tokens: int, param: str) -> None:
        limit = self.info.context_length
        if prompt_len + max_tokens > limit or max_tokens < 0:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max(max_tokens, 0)} tokens ({prompt_len} in the prompt, "
                f"{max(max_tokens, 0)} for the completion). Please reduce the prompt or max_tokens.",
                param=param, code="context_length_exceeded",
            )

    def _job(self, endpoint: Endpoint, req: SamplingRequest, prompts: tuple[tuple[int, ...], ...],
             texts: tuple[str, ...], max_tokens: int, logprobs: int | None, echo: bool,
             json_schema: str | None, tools: ToolPlan | None = None) -> Job:
        sampling = SamplingParams(
            max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            seed=req.seed, stop=req.stop_list(), presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
            ignore_eos=req.ignore_eos, min_tokens=min(req.min_tokens, max_tokens), logprobs=logprobs,
            json_schema=json_schema,
        )
        options = req.stream_options
        header = ResponseHeader(f"{endpoint.id_prefix}-{uuid.uuid4().hex}", int(time.time()), self.model)
        return Job(
            endpoint=endpoint, header=header, prompts=prompts, prompt_texts=texts, n=req.n, sampling=sampling,
            echo=echo, stream=req.stream,
            include_usage=bool(options and options.include_usage) or self.force_include_usage,
            continuous_usage=bool(options and options.continuous_usage_stats), user=req.user, tools=tools,
        )


def message_dict(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates take it: tool calls as OpenAI sends them, a tool result's call id."""
    out: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {"name": c.function.name,
                                                                         "arguments": c.function.arguments}}
                             for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """`text` as the system message: after the client's own system message if there is one, else first."""
    if messages and messages[0]["role"] in ("system", "developer") and messages[0]["content"]:
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def markup_texts(req: ChatCompletionRequest, tools: list[dict[str, Any]] | None) -> list[tuple[str, str]]:
    """Client text that reaches the chat template outside message content, with the parameter that carries it:
    earlier calls' arguments and the tool definitions the template is shown."""
    texts = [(f"messages.{i}.tool_calls", call.function.arguments)
             for i, m in enumerate(req.messages) for call in m.tool_calls or ()]
    if tools:
        texts.append(("tools", orjson.dumps(tools).decode()))
    return texts


def prompt_items(prompt: Any) -> list[str | list[int]]:
    """A completion's prompts (a string, strings, token ids, or lists of them), each one non-empty."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise ApiError(400, "Prompt cannot be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    if any(not item for item in prompt):
        raise ApiError(400, "Prompt cannot be empty", param="prompt")
    return list(prompt)


def template_refusal(error: Exception) -> bool:
    """Whether a chat template raised on purpose: `raise_exception(...)` in a template is a ValueError
    (llama.cpp, older transformers) or jinja2's TemplateError (newer transformers)."""
    return isinstance(error, ValueError) or any(cls.__name__ == "TemplateError" for cls in type(error).__mro__)


def chat_segments(render: Callable[[list[dict[str, Any]]], str],
                  messages: list[dict[str, Any]]) -> list[tuple[str, bool]]:
    """The rendered chat prompt as pieces, each marked whether the template wrote it (True) or it is a
    message's content (False). The template is rendered once with a random marker in place of each content,
    which is then put back between the template's pieces, so what a client wrote can never be read as the
    template's markup. A content the template does not use is simply absent."""
    nonce = uuid.uuid4().hex
    marked = [{**m, "content": f"\ue000{nonce}:{i}\ue001"} for i, m in enumerate(messages)]
    pieces = re.split(f"\ue000{nonce}:(\\d+)\ue001", render(marked))
    segments: list[tuple[str, bool]] = []
    for i, piece in enumerate(pieces):  # template, index, template, index, ..., template
        if i % 2:
            content = messages[int(piece)]["content"]
            if content:
                segments.append((content, False))
        elif piece and segments and segments[-1][1]:  # the template's text around an empty content: one piece
            segments[-1] = (segments[-1][0] + piece, True)
        elif piece:
            segments.append((piece, True))
    return segments
