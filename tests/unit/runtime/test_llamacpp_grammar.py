"""The grammar the CPU engine samples a `json_schema` under keeps JSON strings JSON: llama-cpp-python's
converter lets a string hold raw control characters, and a model that wrote a newline inside a name broke the
client's parse. Checked with llama.cpp's own grammar sampler over the embedded model's vocabulary."""

from __future__ import annotations

import ctypes
import json
import math
from collections.abc import Iterator, Sequence

import pytest
from llama_cpp import Llama, llama_cpp
from llama_cpp.llama_grammar import json_schema_to_gbnf

from tally_runtime.engine.llamacpp import embedded_model_path, gbnf

SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})
CANDIDATES = ["\n", "\t", "c", '"']


@pytest.fixture(scope="module")
def vocab_model() -> Iterator[Llama]:
    model = Llama(str(embedded_model_path()), vocab_only=True, verbose=False)
    yield model
    model.close()


def allowed_next(model: Llama, grammar: str, written: str, candidates: Sequence[str]) -> list[str]:
    """Which one-token candidates llama.cpp's grammar sampler still allows after `written`."""
    sampler = llama_cpp.llama_sampler_init_grammar(model._model.vocab, grammar.encode(), b"root")
    assert sampler, "llama.cpp could not parse the grammar"
    try:
        for token in model.tokenize(written.encode(), add_bos=False, special=False):
            llama_cpp.llama_sampler_accept(sampler, token)
        ids = [model.tokenize(c.encode(), add_bos=False, special=False) for c in candidates]
        assert all(len(i) == 1 for i in ids), ids
        cells = (llama_cpp.llama_token_data * len(ids))(*(llama_cpp.llama_token_data(i[0], 0.0, 0.0) for i in ids))
        data = llama_cpp.llama_token_data_array(cells, len(ids), -1, False)
        llama_cpp.llama_sampler_apply(sampler, ctypes.byref(data))
        return [c for c, cell in zip(candidates, cells, strict=True) if cell.logit != -math.inf]
    finally:
        llama_cpp.llama_sampler_free(sampler)


def test_a_string_in_the_schema_refuses_raw_control_characters(vocab_model: Llama) -> None:
    assert allowed_next(vocab_model, gbnf(SCHEMA), '{"name":"Ab', CANDIDATES) == ["c", '"']


def test_the_converter_alone_would_allow_them(vocab_model: Llama) -> None:
    """The reason for the rule: if llama-cpp-python's converter is fixed, this fails and the rule can go."""
    loose = str(json_schema_to_gbnf(SCHEMA))
    assert allowed_next(vocab_model, loose, '{"name":"Ab', CANDIDATES) == CANDIDATES
