"""The grammar compiler's own process (`python -m tally_runtime.grammar_child <backend> [model path]`), run by
grammar.py: it compiles JSON schemas with the engine's grammar backend, one at a time, apart from the serving
process, so a schema that crashes the backend (llama.cpp's parser recursing past its stack) or takes its memory
kills only this process.

Protocol: one JSON object a line. It answers `{"ready": true}` once loaded; then, to each `{"schema": "<JSON
text>"}`, `{"ok": true}` or `{"error": "<why the backend refused it>"}`. Its address space is bounded
(RLIMIT_AS, the first argument after the backend) before it loads anything.
"""

from __future__ import annotations

import json
import re
import resource
import sys
from collections.abc import Callable

XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+: ")  # "[22:46:54] /project/cpp/json_schema_converter.cc:4175: "


def llama_cpp_compiler(model_path: str) -> Callable[[str], None]:
    """llama-cpp-python's converter, then llama.cpp's grammar parser over the model's vocabulary."""
    from llama_cpp import Llama, llama_cpp

    from tally_runtime.engine.llamacpp import gbnf

    vocab = Llama(model_path=model_path, vocab_only=True, verbose=False)._model.vocab

    def compile_schema(schema: str) -> None:
        grammar = gbnf(schema)
        sampler = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
        if not sampler:
            raise ValueError("llama.cpp could not parse the grammar it made of the schema")
        llama_cpp.llama_sampler_free(sampler)

    return compile_schema


def xgrammar_compiler() -> Callable[[str], None]:
    """What SGLang's scheduler does with a json_schema under its default backend."""
    import xgrammar

    def compile_schema(schema: str) -> None:
        try:
            xgrammar.Grammar.from_json_schema(schema)
        except Exception as err:  # xgrammar raises RuntimeError prefixed with a time and its source file
            raise ValueError(XGRAMMAR_PREFIX.sub("", str(err)).strip()) from None

    return compile_schema


def main(argv: list[str]) -> None:
    backend, memory_bytes, *rest = argv
    limit = int(memory_bytes)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    compile_schema = llama_cpp_compiler(rest[0]) if backend == "llama.cpp" else xgrammar_compiler()
    out = sys.stdout
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        try:
            compile_schema(json.loads(line)["schema"])
            answer: dict[str, object] = {"ok": True}
        except MemoryError:
            answer = {"error": "compiling it needs more memory than the grammar compiler may use"}
        except Exception as err:  # the converter raises whatever it meets (KeyError, TypeError, RecursionError...)
            answer = {"error": f"{type(err).__name__}: {err}"[:500] if not isinstance(err, ValueError)
                      else str(err)[:500]}
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
