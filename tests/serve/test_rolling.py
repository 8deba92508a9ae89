"""``h2okv serve --positions rolling``: ``max_tokens`` and prompts read with eviction may exceed the
model's context (64 positions here); without rolling they are refused."""

import httpx
import pytest
import torch

from h2okv import H2OCache
from h2okv.core.compat import cache_arg
from h2okv.errors import H2OError
from h2okv.serve import EvictionDefaults, create_app, running_server
from h2okv.serve.api.limits import ServerLimits
from h2okv.serve.engine import EngineOptions
from h2okv.tools.tiny import tiny_model
from h2okv.tools.tiny_chat import tiny_chat_model

NAME = "tiny"
LIMIT = 64
EVICTION = EvictionDefaults.from_options(policy="h2o", heavy=8, recent=8)


@pytest.fixture(scope="module")
def model_tok():
    return tiny_chat_model(layers=2, max_positions=LIMIT, initializer_range=0.3)


def serve(model_tok, positions, **limits):
    model, tok = model_tok
    app = create_app(model, tok, model_name=NAME, eviction=EVICTION,
                     options=EngineOptions(prefill_chunk=16, max_batch=4, positions=positions),
                     limits=ServerLimits(**limits))
    return running_server(app)


def complete(url, **body):
    return httpx.post(url + "/v1/completions", json={"model": NAME, "temperature": 0, "ignore_eos": True, **body},
                      timeout=60)


def test_rolling_server_generates_past_the_context_as_generate_alone_does(model_tok):
    model, tok = model_tok
    prompt = "to be or not"
    with serve(model_tok, "rolling") as url:
        r = complete(url, prompt=prompt, max_tokens=3 * LIMIT)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3 * LIMIT
    ids = tok(prompt)["input_ids"]
    cache = H2OCache(model, "h2o", heavy=8, recent=8, chunk_size=16, positions="rolling")
    out = model.generate(torch.tensor([ids]), **cache_arg(cache), max_new_tokens=3 * LIMIT,
                         min_new_tokens=3 * LIMIT, do_sample=False, pad_token_id=tok.pad_token_id)
    assert r.json()["choices"][0]["text"] == tok.decode(out[0, len(ids):], skip_special_tokens=True)


def test_rolling_server_reads_a_prompt_longer_than_the_context_with_eviction(model_tok):
    with serve(model_tok, "rolling", max_prompt_tokens=4 * LIMIT) as url:
        r = complete(url, prompt="a b c d " * 20, max_tokens=8)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] > LIMIT
        # a request that keeps every token cannot roll: the context binds it
        full = complete(url, prompt="a b c d " * 20, max_tokens=8, h2o={"policy": "full"})
        assert full.status_code == 400 and "context" in full.json()["error"]["message"]


def test_without_rolling_max_tokens_past_the_context_is_refused(model_tok):
    with serve(model_tok, "true") as url:
        r = complete(url, prompt="to be or not", max_tokens=3 * LIMIT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_a_model_that_cannot_roll_fails_at_start():
    _, tok = tiny_chat_model(layers=1, max_positions=LIMIT)
    with pytest.raises(H2OError, match="no rotary"):
        create_app(tiny_model("opt", vocab_size=len(tok)), tok, model_name=NAME,
                   options=EngineOptions(positions="rolling"))
