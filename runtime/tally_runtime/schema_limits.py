"""PURE: what a JSON schema may ask of a grammar backend, checked before any converter or compiler sees it.

A schema of a few bytes can ask for unbounded work. llama-cpp-python's converter writes `maxLength: N` (and
`maxItems`, a pattern's `{m,n}`) as N nested groups, and llama.cpp's grammar parser recurses once per group before
its own repetition guard refuses: 30,000 overflowed the stack and killed the process (every stream on the pod with
it); `minLength: 30000000` held the event loop 7 s at 1.2 GB; the converter's cost grows with the square of an
object's optional properties. `MAX_SCHEMA_BYTES` bounds a schema's text, not what it expands to: these bound that.

Limits are per backend (`LIMITS`): llama.cpp's guard refuses repetitions above about 1,000 anyway (measured:
1,000 compiles, 1,100 does not), so that is its bound; xgrammar (SGLang) compiles repetition ranges without
nesting and takes larger ones. A refusal names what was too much and where; the caller answers 400, billed nothing.
Compiling what passes still runs apart from the serving process, with a time and memory budget (grammar.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# Keywords whose value is a count the grammar repeats something by
REPEAT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
                   "minContains", "maxContains")
# Keywords whose value is data, not a schema: never walked (a `const` may well hold a key named maxLength)
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "example", "description", "title", "$comment"})
QUANTIFIER = re.compile(r"\{(\d*)(?:,(\d*))?\}")


@dataclass(frozen=True, slots=True)
class SchemaLimits:
    repeat: int = 1000  # any one count of REPEAT_KEYWORDS, or a pattern's {m,n}
    total_repeat: int = 20_000  # all of them together
    depth: int = 64  # JSON nesting of the schema document
    nodes: int = 10_000  # subschemas in all
    properties: int = 1000  # of one object
    optional_properties: int = 100  # of one object (llama-cpp-python's converter: cost is their square)
    pattern_chars: int = 1000  # one `pattern`
    pattern_depth: int = 32  # parentheses nested in one pattern (each is a nested group of the grammar)


LIMITS = {
    "llama.cpp": SchemaLimits(),
    "xgrammar": SchemaLimits(repeat=100_000, total_repeat=1_000_000, optional_properties=1000),
}


class SchemaTooComplex(ValueError):
    """The schema asks more of the grammar backend than it is allowed to; the message says what and where."""


def check_schema(schema: Any, limits: SchemaLimits) -> None:
    """Raise SchemaTooComplex when `schema` (parsed JSON) exceeds `limits`."""
    nodes = total = 0
    for path, node, depth in _walk(schema):
        if depth > limits.depth:
            raise SchemaTooComplex(f"nests deeper than {limits.depth} levels at {path}")
        if not isinstance(node, dict):
            continue
        nodes += 1
        if nodes > limits.nodes:
            raise SchemaTooComplex(f"has more than {limits.nodes} subschemas")
        for keyword in REPEAT_KEYWORDS:
            count = node.get(keyword)
            if isinstance(count, int | float) and not isinstance(count, bool):
                total += _bounded_count(count, limits, f"{path}.{keyword}")
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            total += _pattern_repeats(pattern, limits, f"{path}.pattern")
        _check_properties(node, limits, path)
        if total > limits.total_repeat:
            raise SchemaTooComplex(f"asks for {total} repetitions in all (lengths, item counts, pattern "
                                   f"quantifiers); at most {limits.total_repeat} are allowed")


def _walk(schema: Any) -> Iterator[tuple[str, Any, int]]:
    """Every value of the schema document with its path and depth, iteratively (no recursion to exhaust), without
    entering data keywords."""
    stack: list[tuple[str, Any, int]] = [("schema", schema, 0)]
    while stack:
        path, node, depth = stack.pop()
        yield path, node, depth
        if isinstance(node, dict):
            stack.extend((f"{path}.{key}", value, depth + 1) for key, value in node.items()
                         if key not in DATA_KEYWORDS and isinstance(value, dict | list))
        elif isinstance(node, list):
            stack.extend((f"{path}[{i}]", value, depth + 1) for i, value in enumerate(node)
                         if isinstance(value, dict | list))


def _bounded_count(count: float, limits: SchemaLimits, where: str) -> int:
    if count < 0 or count != int(count):
        raise SchemaTooComplex(f"{where} must be a whole number, not {count!r}")
    if count > limits.repeat:
        raise SchemaTooComplex(f"{where} is {int(count)}; this server's grammar backend allows at most "
                               f"{limits.repeat}")
    return int(count)


def _pattern_repeats(pattern: str, limits: SchemaLimits, where: str) -> int:
    """The repetitions a pattern's quantifiers ask for: sequential ones add (`\\d{3}-\\d{4}` is 7), nested ones
    multiply (`(a{100}){100}` is 10,100: the inner group repeated 100 times, and the outer)."""
    if len(pattern) > limits.pattern_chars:
        raise SchemaTooComplex(f"{where} is {len(pattern)} characters; at most {limits.pattern_chars} are allowed")
    groups: list[tuple[int, int]] = []
    opened: list[int] = []
    escaped = False
    for i, char in enumerate(pattern):
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == "(":
            opened.append(i)
            if len(opened) > limits.pattern_depth:
                raise SchemaTooComplex(f"{where} nests more than {limits.pattern_depth} groups")
        elif char == ")" and opened:
            groups.append((opened.pop(), i))
    counts = {m.start(): _bounded_count(max(int(m[1] or 0), int(m[2] or 0)), limits, f"{where} quantifier")
              for m in QUANTIFIER.finditer(pattern)}
    total = 0
    for at, count in counts.items():
        for start, end in groups:  # each enclosing group repeated by a quantifier of its own multiplies this one
            if start < at < end:
                count *= counts.get(end + 1, 1)
        total += count
    return total


def _check_properties(node: dict[str, Any], limits: SchemaLimits, path: str) -> None:
    properties = node.get("properties")
    if not isinstance(properties, dict):
        return
    if len(properties) > limits.properties:
        raise SchemaTooComplex(f"{path}.properties has {len(properties)} properties; at most {limits.properties} "
                               "are allowed")
    required = node.get("required")
    named = set(required) & set(properties) if isinstance(required, list) and all(
        isinstance(r, str) for r in required) else set()
    optional = len(properties) - len(named)
    if optional > limits.optional_properties:
        raise SchemaTooComplex(f"{path}.properties has {optional} optional properties; at most "
                               f"{limits.optional_properties} are allowed (list the others in `required`)")
