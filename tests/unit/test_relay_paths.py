"""The relay's fast paths give the same bytes and series as the plain ones they stand in for."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from tally_runtime import sse
from tally_runtime.engine.base import Delta, FinishReason, SamplingParams, TokenLogprob
from tally_runtime.metrics import TOKEN_BUCKETS, TokenHistogram
from tally_runtime.prepare import CHAT, COMPLETIONS, Endpoint, Job
from tally_runtime.render import EventRenderer
from tally_runtime.streaming import ResponseHeader
from tally_runtime.usage import ChoiceUsage

TEXTS = ["", " tok", "naïve 日本語 🎉", 'quote " and \\ backslash', "new\nline\ttab\r", "\x00\x1f\u2028", "data: x\n\n"]


def test_text_template_equals_dumping_the_dict() -> None:
    header = ResponseHeader("cmpl-1", 7, 'model "quoted" \\ 🎉')
    template = sse.text_template(header.envelope("text_completion", [{"index": 3, "text": sse.TEXT_MARK}], None))
    assert template is not None
    for text in TEXTS:
        assert template(text) == sse.event(header.envelope("text_completion", [{"index": 3, "text": text}], None))


def test_text_template_refuses_a_payload_without_exactly_one_mark() -> None:
    assert sse.text_template({"text": "plain"}) is None
    assert sse.text_template({"a": sse.TEXT_MARK, "b": sse.TEXT_MARK}) is None


def job(endpoint: Endpoint, n: int = 2, echo: bool = False, continuous: bool = False) -> Job:
    return Job(endpoint=endpoint, header=ResponseHeader("id-1", 1, "m"), prompts=((1, 2),), prompt_texts=("Hi",),
               n=n, sampling=SamplingParams(max_tokens=8), echo=echo, stream=True, include_usage=False,
               continuous_usage=continuous)


def deltas(rng: random.Random) -> list[tuple[int, Delta]]:
    out = []
    for step in range(40):
        index = rng.randrange(2)
        logprobs = (TokenLogprob("a", -0.5, (("a", -0.5),)),) if rng.random() < 0.1 else None
        finish = FinishReason.LENGTH if step >= 38 else None
        out.append((index, Delta(text=rng.choice(TEXTS), token_ids=(5,), logprobs=logprobs, prompt_tokens=2,
                                 completion_tokens=step, finish_reason=finish)))
    return out


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
@pytest.mark.parametrize(("echo", "continuous"), [(False, False), (True, False), (False, True)])
def test_event_renderer_equals_the_dict_path(endpoint: Endpoint, echo: bool, continuous: bool) -> None:
    """Every event, fast or not, is byte-for-byte what dumping the chunk dicts gives."""
    the_job = job(endpoint, echo=echo and endpoint == COMPLETIONS, continuous=continuous)
    usage = [ChoiceUsage(i, 0, 2) for i in range(2)]
    fast, plain = EventRenderer(the_job, usage), EventRenderer(the_job, usage)
    fast_out: list[bytes] = []
    plain_out: list[bytes] = []
    for index, delta in deltas(random.Random(endpoint.name + str(echo) + str(continuous))):
        usage[index].observe(delta)
        fast(fast_out, index, delta)
        plain_out.extend(sse.event(event) for event in plain._dicts(index, delta))
    assert fast_out == plain_out
    assert bool(fast.templates) is not continuous  # the fast path was taken, except with running usage


def test_token_histogram_exposes_what_prometheus_histogram_does() -> None:
    theirs_registry, ours_registry = CollectorRegistry(), CollectorRegistry()
    theirs = Histogram("x_seconds", "doc", buckets=TOKEN_BUCKETS, registry=theirs_registry)
    ours = TokenHistogram("x_seconds", "doc", TOKEN_BUCKETS, registry=ours_registry)
    rng = random.Random(1)
    values = [*TOKEN_BUCKETS, 0.0, 1e-9, 99.0] + [rng.random() / 10 for _ in range(200)]
    for value in values:
        theirs.observe(value)
        ours.observe(value)
    for _ in range(5):  # one call for five equal tokens
        theirs.observe(0.02)
    ours.observe(0.02, 5)

    def samples(registry: CollectorRegistry) -> dict[str, float]:
        lines = generate_latest(registry).decode().splitlines()
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines
                if not line.startswith("#") and "_created" not in line}

    expected, got = samples(theirs_registry), samples(ours_registry)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value), key
    assert got['x_seconds_bucket{le="0.02"}'] > got['x_seconds_bucket{le="0.01"}']
