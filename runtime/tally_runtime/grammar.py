"""Checking a client's JSON schema with the engine's grammar backend, without letting it hurt the server.

A request with `response_format` or tools is checked before it is admitted (a schema the backend refuses is a
400 naming the parameter, billed nothing). The check had run on the event loop, in the serving process: a
41-byte schema crashed the process (llama.cpp's parser recursing once per nested group) and another held the
loop for 7 s. Now, in order:
1. the schema is parsed and held to the backend's bounds (schema_limits.py, pure), before any converter;
2. what passes is compiled in a child process (grammar_child.py) with the backend itself, one schema at a time,
   within `COMPILE_SECONDS` and an address-space limit; a child that dies or overruns is killed and started
   again for the next schema, and the request that did it is refused;
3. the answer is remembered by the schema's digest (`CACHED` of them), since clients send the same schema again
   and again; not when the compiler overran its time or could not start (that may pass).
The engine compiles an accepted schema again when it generates (llama.cpp in the generation's own thread, SGLang
in its scheduler): the same input its backend already took once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import sys
from collections import OrderedDict
from typing import Any

import orjson

from tally_runtime.schema_limits import LIMITS, SchemaLimits, check_schema

log = logging.getLogger("tally_runtime.grammar")

COMPILE_SECONDS = 10.0
START_SECONDS = 120.0  # loading the backend: llama.cpp reads the model's vocabulary, xgrammar imports torch
CACHED = 512
MAX_ANSWER_BYTES = 4096
# The child's address space: the backend, a vocabulary and one grammar. xgrammar's import maps torch's libraries
MEMORY_BYTES = {"llama.cpp": 2 << 30, "xgrammar": 16 << 30}


class GrammarWorker:
    """One engine's grammar compiler in its own process, started on first use. `backend` is "llama.cpp" or
    "xgrammar" (compiled in the child), or the name of another SGLang backend (held to the bounds only; SGLang
    compiles it when the request runs)."""

    def __init__(self, backend: str, model_path: str = "", compile_seconds: float = COMPILE_SECONDS,
                 limits: SchemaLimits | None = None) -> None:
        self.backend = backend
        self.model_path = model_path
        self.compile_seconds = compile_seconds
        self.limits = limits or LIMITS.get(backend, LIMITS["xgrammar"])
        self.compiles = backend in MEMORY_BYTES
        self._child: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self._answers: OrderedDict[bytes, str] = OrderedDict()  # schema digest -> "" (accepted) or why not
        self.restarts = 0

    async def check(self, schema: str) -> None:
        """Raise ValueError, saying why, when the backend cannot (or may not) constrain output to `schema`."""
        digest = hashlib.sha256(schema.encode()).digest()
        known = self._answers.get(digest)
        if known is None:
            known, lasting = await self._check(schema)
            if lasting:
                self._answers[digest] = known
                while len(self._answers) > CACHED:
                    self._answers.popitem(last=False)
        else:
            self._answers.move_to_end(digest)
        if known:
            raise ValueError(known)

    async def _check(self, schema: str) -> tuple[str, bool]:
        """Why the schema is refused ("" when it is not), and whether that answer would stay the same."""
        try:
            check_schema(orjson.loads(schema), self.limits)
        except orjson.JSONDecodeError as err:
            return f"it is not JSON: {err}", True
        except ValueError as err:
            return f"the schema {err}", True
        if not self.compiles:
            return "", True
        async with self._lock:  # one schema at a time: the child answers in order
            return await self._compile(schema)

    async def _compile(self, schema: str) -> tuple[str, bool]:
        child = await self._running()
        if child is None:
            return f"the {self.backend} grammar compiler could not start; see the server's log", False
        assert child.stdin is not None and child.stdout is not None
        try:
            child.stdin.write(orjson.dumps({"schema": schema}) + b"\n")
            await child.stdin.drain()
            line = await asyncio.wait_for(child.stdout.readline(), self.compile_seconds)
        except TimeoutError:
            await self._kill(f"took longer than {self.compile_seconds:g}s")
            return f"compiling it took longer than {self.compile_seconds:g}s", False
        except (ConnectionError, OSError, ValueError):  # a pipe gone, or a line past the reader's limit
            line = b""
        answer = _answer(line)
        if answer is None:
            code = await self._kill("died")
            return f"the {self.backend} grammar compiler failed on it (exit {code})", True
        return answer, True

    async def _running(self) -> asyncio.subprocess.Process | None:
        if self._child is not None and self._child.returncode is None:
            return self._child
        command = [sys.executable, "-m", "tally_runtime.grammar_child", self.backend,
                   str(MEMORY_BYTES[self.backend]), *([self.model_path] if self.model_path else [])]
        child = await asyncio.create_subprocess_exec(*command, stdin=asyncio.subprocess.PIPE,
                                                     stdout=asyncio.subprocess.PIPE, limit=MAX_ANSWER_BYTES * 4)
        assert child.stdout is not None
        try:
            ready = await asyncio.wait_for(child.stdout.readline(), START_SECONDS)
        except TimeoutError:
            ready = b""
        if _answer(ready, "ready") is None:
            with contextlib.suppress(ProcessLookupError):
                child.kill()
            await child.wait()
            log.error("The %s grammar compiler did not start (exit %s)", self.backend, child.returncode)
            return None
        self._child = child
        return child

    async def _kill(self, why: str) -> int | None:
        child, self._child = self._child, None
        if child is None:
            return None
        if child.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                child.kill()
        code = await child.wait()
        self.restarts += 1
        log.warning("The %s grammar compiler %s on a schema (exit %s); it starts again for the next one",
                    self.backend, why, code)
        return code

    async def close(self) -> None:
        child, self._child = self._child, None
        if child is not None and child.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                child.kill()
            await child.wait()


def _answer(line: bytes, key: str = "") -> str | None:
    """The child's answer: "" accepted, else why not; None when it said nothing an answer looks like."""
    if not line or len(line) > MAX_ANSWER_BYTES:
        return None
    try:
        message: Any = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(message, dict):
        return None
    if key:
        return "" if message.get(key) is True else None
    if message.get("ok") is True:
        return ""
    error = message.get("error")
    return str(error) if isinstance(error, str) and error else None
