"""Property-based fuzz of the request schema (hypothesis): whatever the body, the server never answers
5xx, and every error is a 4xx in OpenAI's format. In-process (ASGI test client), tiny model, short
context so that valid requests finish fast."""

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from h2okv.serve import create_app
from h2okv.serve.api.limits import ServerLimits
from h2okv.serve.engine import EngineOptions
from h2okv.tools.tiny_chat import tiny_chat_model
from serve_requests import bodies, encode, mutated_bodies
from serve_requests import check as check_answer

NAME = "tiny"
completion, chat = bodies(NAME)


@pytest.fixture(scope="module")
def http():
    model, tok = tiny_chat_model(layers=1, max_positions=64)
    app = create_app(model, tok, model_name=NAME, options=EngineOptions(prefill_chunk=16),
                     limits=ServerLimits(max_context=64))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def check(response) -> None:
    check_answer(response.status_code, response.headers.get("content-type", ""), response.content)


fuzz = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@fuzz
@given(body=completion)
def test_completions_never_5xx(http, body):
    check(http.post("/v1/completions", json=body))


@fuzz
@given(body=chat)
def test_chat_never_5xx(http, body):
    check(http.post("/v1/chat/completions", json=body))


@fuzz
@given(body=mutated_bodies(NAME))
def test_hostile_bodies_never_5xx(http, body):
    """Extreme numbers, lone surrogates, wrong JSON types, huge budgets, tiny temperatures, long stops."""
    path, payload = body
    check(http.post(path, content=encode(payload), headers={"content-type": "application/json"}))


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
