"""Property-based fuzz of the request schema (hypothesis): whatever the body, the server never answers
5xx, and every error is a 4xx in OpenAI's format. In-process (ASGI test client), tiny model, short
context so that valid requests finish fast."""

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from h2okv.serve import create_app
from h2okv.tools.tiny_chat import tiny_chat_model

NAME = "tiny"

junk = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.floats(allow_nan=False, allow_infinity=False),
                 st.text(max_size=12), st.lists(st.integers(-3, 300), max_size=4), st.dictionaries(
                     st.text(max_size=5), st.integers(), max_size=2))
small_int = st.integers(-3, 20)
prompt = st.one_of(st.text(max_size=40), st.lists(st.integers(-2, 400), max_size=12),
                   st.lists(st.text(max_size=10), max_size=3), st.lists(st.lists(st.integers(0, 300), max_size=4),
                                                                      max_size=2), junk)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", 3]),
                                 "content": st.one_of(st.text(max_size=20), junk)})
h2o = st.one_of(junk, st.fixed_dictionaries({}, optional={
    "policy": st.sampled_from(["h2o", "full", "local", "sink", "random", "nope", 7]),
    "heavy": small_int, "recent": small_int,
    "heavy_ratio": st.floats(-0.5, 1.5), "recent_ratio": st.floats(-0.5, 1.5), "budget": small_int}))
common = {
    "model": st.one_of(st.just(NAME), junk),
    "max_tokens": st.one_of(small_int, st.integers(50, 1 << 80), junk),
    "temperature": st.one_of(st.floats(-1, 3), junk), "top_p": st.one_of(st.floats(-0.5, 1.5), junk),
    "n": st.one_of(st.integers(-1, 3), junk), "stream": st.one_of(st.booleans(), junk),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), junk),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=6), junk),
    "seed": st.one_of(st.integers(-(1 << 65), 1 << 65), junk), "logprobs": st.one_of(small_int, junk),
    "h2o": h2o, "ignore_eos": st.one_of(st.booleans(), junk), "echo": junk, "best_of": junk,
    "presence_penalty": junk, "logit_bias": junk, "top_logprobs": st.one_of(small_int, junk),
}
completion = st.fixed_dictionaries({}, optional={**common, "prompt": prompt})
chat = st.fixed_dictionaries({}, optional={
    **common, "messages": st.one_of(st.lists(message, max_size=3), junk),
    "max_completion_tokens": st.one_of(small_int, junk), "tools": junk, "response_format": junk})


@pytest.fixture(scope="module")
def http():
    model, tok = tiny_chat_model(layers=1, max_positions=64)
    app = create_app(model, tok, model_name=NAME, prefill_chunk=16, max_context=64)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def check(response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    elif "text/event-stream" not in response.headers.get("content-type", ""):
        assert response.json()["choices"]


fuzz = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@fuzz
@given(body=completion)
def test_completions_never_5xx(http, body):
    check(http.post("/v1/completions", json=body))


@fuzz
@given(body=chat)
def test_chat_never_5xx(http, body):
    check(http.post("/v1/chat/completions", json=body))


# JSON encoders refuse NaN and infinities, but Python's parser (the server's) accepts them
NON_FINITE = [b'{"model": "tiny", "prompt": "x", "temperature": NaN}', b'{"model": "tiny", "prompt": "x", "top_p": Infinity}',
              b'{"model": "tiny", "prompt": "x", "max_tokens": -Infinity}', b'{"model": NaN, "messages": []}',
              b'{"model": "tiny", "prompt": "x", "h2o": {"heavy_ratio": NaN, "recent_ratio": 0.1}}']


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.one_of(st.sampled_from(NON_FINITE), st.binary(max_size=60), st.text(max_size=60).map(str.encode),
                     st.binary(max_size=20).map(lambda b: b'{"model": "tiny", "prompt": "' + b + b'"}')),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_raw_bodies_never_5xx(http, raw, path):
    """Malformed JSON, invalid UTF-8 inside strings, arbitrary bytes."""
    response = http.post(path, content=raw, headers={"content-type": "application/json"})
    check(response)
    try:
        json.loads(raw)
    except ValueError:
        assert response.status_code == 400
