"""A bad eviction setting in a request is named as the request names it (``h2o.budget``), with the
range it must be in: the same check as the library's and the command line's, in its own words."""

import re

import pytest
from fastapi.testclient import TestClient

from h2okv.serve import create_app
from h2okv.serve.api.limits import ServerLimits
from h2okv.serve.engine import EngineOptions
from h2okv.tools.tiny_chat import tiny_chat_model

NAME = "tiny"
RULE = "must be a fraction of the prompt in (0, 1] (e.g. 0.2) or a whole number of slots >= 2 for h2o"


@pytest.fixture(scope="module")
def http():
    model, tok = tiny_chat_model(layers=1, max_positions=64)
    app = create_app(model, tok, model_name=NAME, options=EngineOptions(prefill_chunk=16),
                     limits=ServerLimits(max_context=64))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


@pytest.mark.parametrize("h2o, param, message", [
    # a string was "Input should be a valid integer", though a fraction is valid too
    ({"budget": "20%"}, "h2o.budget", f"h2o.budget {RULE} (e.g. 256), got '20%'"),
    ({"budget": True}, "h2o.budget", f"h2o.budget {RULE} (e.g. 256), got True"),
    ({"budget": 1.5}, "h2o.budget", f"h2o.budget {RULE} (e.g. 256), got 1.5"),
    ({"budget": 1}, "h2o.budget", f"h2o.budget {RULE} (e.g. 256), got 1"),  # h2o needs a heavy and a recent slot
    ({"budget": 0.2, "heavy": 4}, "h2o", "give either h2o.budget or h2o.heavy, not both"),
    ({"heavy": 0, "recent": 4}, "h2o", "each of h2o.heavy and h2o.recent, got 0 and 4"),
    ({"budget": 0.2, "recent_share": 0.0}, "h2o.recent_share", "h2o.recent_share 0.0 leaves h2o no recent slots"),
    ({"policy": "full", "budget": 0.2}, "h2o.budget", "policy 'full' keeps every token; do not give it h2o.budget"),
])
def test_budget_errors_name_the_request_fields(http, h2o, param, message):
    r = http.post("/v1/completions", json={"model": NAME, "prompt": "hello", "max_tokens": 2, "h2o": h2o})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert message in error["message"]
    assert not re.search(r"\w=|--\w", error["message"])  # no Python keywords (budget=), no flags (--budget)


def test_a_valid_budget_still_serves(http):
    r = http.post("/v1/completions", json={"model": NAME, "prompt": "hello", "max_tokens": 2, "h2o": {"budget": 0.5}})
    assert r.status_code == 200, r.text
