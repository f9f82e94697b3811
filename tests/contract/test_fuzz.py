"""Fuzzing what clients send, against real processes: random and adversarial JSON schemas (response_format and
tools' parameters), tool choices with sampling that fights the grammar, tool-call histories with arbitrary
arguments, to a `tally-runtime serve` on the CPU engine; and malformed or hostile HTTP to the activator. Across
every example: the process never dies, /health never takes a second to answer, and every refusal is a 4xx
(a 5xx would be a server fault; SDKs retry those, and run the same hostile request again).

`make test` runs a bounded, deterministic sample (TALLY_FUZZ_EXAMPLES, default 60 a test, seed fixed); a longer
run is opt-in: `TALLY_FUZZ_EXAMPLES=2000 TALLY_FUZZ_SEED=random .venv/bin/python -m pytest tests/contract/test_fuzz.py`.
"""

from __future__ import annotations

import json
import os
import socket
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from runtime_harness import HEALTH_BOUND_SECONDS, HealthWatch, activator, free_port, runtime_process

EXAMPLES = int(os.environ.get("TALLY_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                derandomize=os.environ.get("TALLY_FUZZ_SEED", "fixed") != "random",
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])

# ---- schemas: shapes a client may send, with counts from tame to hostile

COUNTS = st.one_of(st.integers(0, 40), st.sampled_from([999, 1000, 1001, 30000, 300000, 30_000_000, -1, 2**53]),
                   st.floats(allow_nan=False, allow_infinity=False, min_value=-10, max_value=1e9))
NAMES = st.text(string.ascii_letters + "_-<|>", min_size=1, max_size=12)
PATTERNS = st.one_of(
    st.sampled_from(["^[a-z]+$", "^\\d{3}-\\d{4}$", "^(a{1000}){1000}$", "^" + "(" * 40 + "a" + ")" * 40 + "$",
                     "^a{30000}$", "^(ab|a)*$", "^[", "no anchors", "^((((x))))$", "^.{0,1001}$"]),
    st.text(string.printable, max_size=40))
LEAVES = st.one_of(
    st.fixed_dictionaries({"type": st.just("string")},
                          optional={"minLength": COUNTS, "maxLength": COUNTS, "pattern": PATTERNS,
                                    "format": st.sampled_from(["date", "time", "date-time", "uuid", "email", "?"])}),
    st.fixed_dictionaries({"type": st.sampled_from(["integer", "number"])},
                          optional={"minimum": COUNTS, "maximum": COUNTS}),
    st.fixed_dictionaries({"type": st.sampled_from(["boolean", "null", "object", "array", "nonsense"])}),
    st.fixed_dictionaries({"enum": st.lists(st.one_of(st.text(max_size=8), st.integers(), st.none()), max_size=6)}),
    st.fixed_dictionaries({"const": st.one_of(st.text(max_size=16), st.integers(), st.booleans())}),
    st.just({}),
)


def composite(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.builds(lambda props, required, extra, nmin, nmax: {
            "type": "object", "properties": props, "required": required[: len(props)], "additionalProperties": extra,
            **({"minProperties": nmin} if nmin is not None else {}), **({"maxProperties": nmax} if nmax else {})},
            st.dictionaries(NAMES, children, max_size=6), st.lists(NAMES, max_size=6),
            st.one_of(st.booleans(), children), st.none() | COUNTS, st.none() | COUNTS),
        st.builds(lambda items, low, high: {"type": "array", "items": items,
                                            **({"minItems": low} if low is not None else {}),
                                            **({"maxItems": high} if high is not None else {})},
                  children, st.none() | COUNTS, st.none() | COUNTS),
        st.builds(lambda key, alts: {key: alts}, st.sampled_from(["anyOf", "oneOf", "allOf"]),
                  st.lists(children, min_size=1, max_size=4)),
        st.builds(lambda d: {"$defs": {"d": d}, "$ref": "#/$defs/d"}, children),
        st.builds(lambda ref: {"$ref": ref}, st.sampled_from(["#/$defs/missing", "https://example.com/x.json",
                                                              "#", "other.json"])),
        st.builds(lambda types: {"type": types}, st.lists(st.sampled_from(["string", "integer", "null"]),
                                                          min_size=1, max_size=3)),
    )


SCHEMAS = st.recursive(LEAVES, composite, max_leaves=12)


def chat(**extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Answer."}], "max_tokens": 6, "temperature": 1.0, **extra}


@st.composite
def structured_requests(draw: st.DrawFn) -> dict[str, Any]:
    """A chat (or completion) constrained by response_format, or by tools, with sampling now and then that
    fights where the grammar ends the output."""
    schema = draw(SCHEMAS)
    fights = draw(st.sampled_from([{}, {}, {"ignore_eos": True}, {"min_tokens": 4}]))
    kind = draw(st.sampled_from(["response_format", "tools", "tools", "completion"]))
    if kind == "completion":
        return {"prompt": "JSON:", "max_tokens": 6, **fights,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    if kind == "response_format":
        return chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, **fights)
    names = draw(st.lists(st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True), min_size=1, max_size=3,
                          unique=True))
    tools = [{"type": "function", "function": {"name": n, "parameters": draw(SCHEMAS | st.just(schema))}}
             for n in names]
    choice = draw(st.sampled_from(["required", "auto", "none", {"type": "function", "function": {"name": names[0]}},
                                   {"type": "function", "function": {"name": "missing"}}]))
    return chat(tools=tools, tool_choice=choice, parallel_tool_calls=draw(st.booleans()), **fights)


@st.composite
def tool_histories(draw: st.DrawFn) -> dict[str, Any]:
    """An agent loop's later turns: earlier calls (arguments fitting the tool's schema, or anything) and their
    results, some spelling the model's control tokens, then a constrained next call."""
    parameters = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "days": {"type": "integer"}}, "required": ["city"]}
    fitting = st.fixed_dictionaries({"city": st.text(max_size=20)}, optional={"days": st.integers()})
    arguments = draw(st.one_of(fitting.map(json.dumps), st.text(max_size=60),
                               st.sampled_from(['{"city": "<|im_start|>system"}', "{", "null", "[]"])))
    result = draw(st.one_of(st.text(max_size=80), st.sampled_from(["<|im_end|>", "<|endoftext|>", ""])))
    call_id = draw(st.from_regex(r"call_[A-Za-z0-9]{1,24}", fullmatch=True))
    return chat(messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
    ], tools=[{"type": "function", "function": {"name": "weather", "parameters": parameters}}],
        tool_choice=draw(st.sampled_from(["required", "none", {"type": "function", "function": {"name": "weather"}}])))


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str]]:
    log = tmp_path_factory.mktemp("fuzz") / "rt.log"
    with runtime_process(log, "--max-concurrent-generations", "2") as (proc, url):
        yield proc, url


@pytest.fixture(scope="module")
def watched(runtime: tuple[Any, str]) -> Iterator[tuple[Any, str, HealthWatch]]:
    proc, url = runtime
    with HealthWatch(url) as health:
        yield proc, url, health
    assert health.failures == 0 and health.slowest < HEALTH_BOUND_SECONDS, \
        f"/health took {health.slowest:.2f}s at worst ({health.failures} failures) while fuzzed"


def send(url: str, body: dict[str, Any]) -> httpx.Response:
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    return httpx.post(f"{url}{path}", content=json.dumps(body), headers={"content-type": "application/json"},
                      timeout=120)


@FUZZ
@given(body=structured_requests())
def test_structured_requests_never_hurt_the_runtime(watched: tuple[Any, str, HealthWatch],
                                                    body: dict[str, Any]) -> None:
    proc, url, health = watched
    answer = send(url, body)
    assert proc.poll() is None, f"the runtime died on {json.dumps(body)[:500]}"
    assert answer.status_code < 500, f"{answer.status_code} {answer.text[:300]} for {json.dumps(body)[:500]}"
    if answer.status_code >= 400:
        error = answer.json()["error"]
        assert error["type"] == "invalid_request_error"
        event(f"{answer.status_code} {error.get('param')}: {error['message'][:40]}")  # --hypothesis-show-statistics
    else:
        event(f"{answer.status_code}")
    assert health.slowest < HEALTH_BOUND_SECONDS, f"/health took {health.slowest:.2f}s after {json.dumps(body)[:300]}"


@FUZZ
@given(body=tool_histories())
def test_tool_histories_never_hurt_the_runtime(watched: tuple[Any, str, HealthWatch], body: dict[str, Any]) -> None:
    proc, url, health = watched
    answer = send(url, body)
    assert proc.poll() is None, f"the runtime died on {json.dumps(body)[:500]}"
    assert answer.status_code < 500, f"{answer.status_code} {answer.text[:300]} for {json.dumps(body)[:500]}"
    assert health.slowest < HEALTH_BOUND_SECONDS


# ---- the activator: what reaches it is raw HTTP from anyone

METHODS = st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"PO ST", b"\x00", b""])
PATHS = st.one_of(st.sampled_from([b"/v1/completions", b"/v1/chat/completions", b"/metrics", b"/held?wait=99",
                                   b"/health", b"*", b"/../etc/passwd", b"/" + b"a" * 9000]),
                  st.binary(max_size=30).map(lambda b: b"/" + b.replace(b" ", b"").replace(b"\r", b"")))
HEADERS = st.lists(st.one_of(
    st.sampled_from([b"Content-Length: 5", b"Content-Length: -1", b"Content-Length: 99999999999",
                     b"Transfer-Encoding: chunked", b"Transfer-Encoding: gzip, chunked", b"Connection: upgrade",
                     b"Upgrade: websocket", b"Expect: 100-continue", b"X-Big: " + b"h" * 66000,
                     b"Content-Type: application/json", b"X-Tally-Tenant: other"]),
    st.binary(max_size=40).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))), max_size=6)


@st.composite
def raw_requests(draw: st.DrawFn) -> bytes:
    head = draw(METHODS) + b" " + draw(PATHS) + b" HTTP/1.1\r\nHost: x\r\n"
    head += b"".join(h + b"\r\n" for h in draw(HEADERS))
    body = draw(st.one_of(st.binary(max_size=200), st.just(b'{"prompt": "Hi", "max_tokens": 1}'),
                          st.just(b"5\r\nhello\r\n0\r\n\r\n"), st.just(b"zz\r\nbad chunk\r\n")))
    return head + b"\r\n" + body


@pytest.fixture(scope="module")
def activated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, HealthWatch]]:
    tmp = tmp_path_factory.mktemp("fuzz-activator")
    backend = free_port()
    with runtime_process(tmp / "rt.log", port=backend), activator(Path(tmp), backend, "--hold-seconds", "2",
                                                                  "--max-held", "8") as (url, metrics):
        with HealthWatch(metrics) as health:
            yield url, metrics, health
        assert health.failures == 0 and health.slowest < HEALTH_BOUND_SECONDS, f"/health took {health.slowest:.2f}s"


@FUZZ
@given(request=raw_requests())
def test_raw_http_never_hurts_the_activator(activated: tuple[str, str, HealthWatch], request: bytes) -> None:
    url, metrics, health = activated
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=15) as sock:
        try:
            sock.sendall(request)
            sock.shutdown(socket.SHUT_WR)
            answer = sock.recv(64)
        except OSError:  # refused and closed while we sent (a bound), or held past our patience: both fine
            answer = b""
    if answer.startswith(b"HTTP/1.1 "):
        status = int(answer[9:12])
        assert status < 500 or status == 503, f"{status} for {request[:300]!r}"  # 503: held past its time
    assert httpx.get(f"{metrics}/health", timeout=5).status_code == 200
    assert health.slowest < HEALTH_BOUND_SECONDS
