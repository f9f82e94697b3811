"""The grammar compiler runs apart from the serving process (grammar.py): with llama.cpp itself, a schema that
crashes its parser or overruns its time kills only the child, the caller gets a refusal, and the next schema is
compiled by a new child. The bounds (schema_limits.py) refuse such schemas before any child sees them; these
tests lift the bounds to reach the child."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest

from tally_runtime.engine.llamacpp import embedded_model_path
from tally_runtime.grammar import GrammarWorker
from tally_runtime.schema_limits import SchemaLimits

NO_BOUNDS = SchemaLimits(repeat=10**9, total_repeat=10**9, optional_properties=10**6, properties=10**6)
GOOD = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}},
                   "required": ["name"]})
CRASHES_LLAMA_CPP = json.dumps({"type": "string", "maxLength": 30000})  # its parser recurses past the stack
SLOW = json.dumps({"type": "string", "minLength": 30_000_000})  # about 7 s and 1.2 GB in llama.cpp


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def refusal(loop: asyncio.AbstractEventLoop, worker: GrammarWorker, schema: str) -> str:
    try:
        loop.run_until_complete(worker.check(schema))
    except ValueError as err:
        return str(err)
    return ""


def test_a_schema_that_crashes_llama_cpp_kills_only_the_child(loop: asyncio.AbstractEventLoop) -> None:
    # A generous clock: on a loaded machine the crash came after the default 10 s, and a timeout was reported
    worker = GrammarWorker("llama.cpp", str(embedded_model_path()), compile_seconds=120.0, limits=NO_BOUNDS)
    try:
        assert refusal(loop, worker, GOOD) == ""
        first = worker._child
        assert "failed on it (exit -11)" in refusal(loop, worker, CRASHES_LLAMA_CPP)  # SIGSEGV, in the child
        assert worker.restarts == 1 and first is not None and first.returncode == -11
        assert refusal(loop, worker, GOOD.replace("20", "21")) == ""  # a new child takes the next schema
        assert worker._child is not first
        assert "failed on it" in refusal(loop, worker, CRASHES_LLAMA_CPP)  # remembered: no second crash
        assert worker.restarts == 1
    finally:
        loop.run_until_complete(worker.close())


def test_a_schema_that_overruns_its_time_is_refused_and_its_child_killed(loop: asyncio.AbstractEventLoop) -> None:
    worker = GrammarWorker("llama.cpp", str(embedded_model_path()), compile_seconds=1.0, limits=NO_BOUNDS)
    try:
        assert refusal(loop, worker, GOOD) == ""  # started (the vocabulary loaded) before the clock matters
        assert "took longer than 1s" in refusal(loop, worker, SLOW)
        assert worker.restarts == 1 and worker._child is None
        assert refusal(loop, worker, GOOD) == ""
    finally:
        loop.run_until_complete(worker.close())


@pytest.mark.parametrize(("schema", "named"), [
    pytest.param({"type": "string", "maxLength": 30000}, "schema.maxLength is 30000", id="maxLength"),
    pytest.param({"type": "array", "items": {"type": "integer"}, "maxItems": 30000}, "schema.maxItems", id="maxItems"),
    pytest.param({"type": "string", "minLength": 30_000_000}, "schema.minLength", id="minLength"),
    pytest.param({"type": "string", "pattern": "^(a{1000}){1000}$"}, "repetitions in all", id="nested quantifiers"),
    pytest.param({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(500)}},
                 "500 optional properties", id="optional properties"),
    pytest.param({"type": "string", "pattern": "^" + "(" * 200 + "a" + ")" * 200 + "$"}, "groups", id="deep pattern"),
])
def test_the_bounds_refuse_before_any_child_starts(loop: asyncio.AbstractEventLoop, schema: object,
                                                   named: str) -> None:
    worker = GrammarWorker("llama.cpp", str(embedded_model_path()))
    try:
        assert named in refusal(loop, worker, json.dumps(schema))
        assert worker._child is None  # refused on the bounds alone
    finally:
        loop.run_until_complete(worker.close())
