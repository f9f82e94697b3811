"""`response_format` as the engines get it: the schema text, bounded; SGLang's sampling parameter."""

from __future__ import annotations

import json

import pytest

from tally_runtime.engine.base import SamplingParams
from tally_runtime.engine.sglang import sampling_params
from tally_runtime.grammar_child import XGRAMMAR_PREFIX
from tally_runtime.protocol import MAX_SCHEMA_BYTES, ApiError, ChatCompletionRequest, validated


def request(response_format: object) -> ChatCompletionRequest:
    return validated(ChatCompletionRequest, {"messages": [{"role": "user", "content": "Hi"}],
                                             "response_format": response_format})


def test_each_type_becomes_the_schema_the_engine_is_constrained_to() -> None:
    assert request({"type": "text"}).response_format.schema_text() is None  # type: ignore[union-attr]
    assert json.loads(request({"type": "json_object"}).response_format.schema_text() or "") == {"type": "object"}  # type: ignore[union-attr]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    given = request({"type": "json_schema", "json_schema": {"name": "a_1", "schema": schema, "strict": True}})
    assert json.loads(given.response_format.schema_text() or "") == schema  # type: ignore[union-attr]
    huge = request({"type": "json_schema", "json_schema": {"name": "big", "schema": {
        "type": "object", "description": "x" * MAX_SCHEMA_BYTES}}})
    with pytest.raises(ValueError, match="bytes"):
        huge.response_format.schema_text()  # type: ignore[union-attr]
    with pytest.raises(ApiError) as bad_name:
        request({"type": "json_schema", "json_schema": {"name": "no spaces", "schema": {}}})
    assert bad_name.value.param == "response_format.json_schema.name"


def test_sglang_gets_the_schema_as_its_json_schema_sampling_parameter() -> None:
    assert "json_schema" not in sampling_params(SamplingParams(max_tokens=4))
    assert sampling_params(SamplingParams(max_tokens=4, json_schema='{"type": "object"}'))["json_schema"] == \
        '{"type": "object"}'
    assert XGRAMMAR_PREFIX.sub("", '[22:46:54] /project/cpp/json_schema_converter.cc:4175: Unsupported type "x"') \
        == 'Unsupported type "x"'
