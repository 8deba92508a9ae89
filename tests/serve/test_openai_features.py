"""The OpenAI API features clients rely on, through the official ``openai`` client: API key, logprobs,
``n``, ``seed``, ``stop``, ``max_completion_tokens``, usage in streams, the request timeout, the prompt
limit and the eviction settings in ``/v1/models``. Tiny random model, real uvicorn on 127.0.0.1."""

import math

import httpx
import openai
import pytest
import torch

from h2okv.bench.serve import scrape
from h2okv.serve import EvictionDefaults, create_app, running_server
from h2okv.serve.api.limits import ServerLimits
from h2okv.serve.engine import EngineOptions
from h2okv.tools.tiny_chat import tiny_chat_model

NAME = "tiny"
KEY = "sk-test-0123"
LIMIT = 1024


@pytest.fixture(scope="module")
def model_tok():
    return tiny_chat_model(layers=2, max_positions=LIMIT, initializer_range=0.3)


@pytest.fixture(scope="module")
def server(model_tok):
    model, tok = model_tok
    app = create_app(model, tok, model_name=NAME, api_key=KEY, eviction=EvictionDefaults.from_options(policy="h2o", heavy=8, recent=8),
                     options=EngineOptions(prefill_chunk=32), limits=ServerLimits(max_prompt_tokens=200))
    with running_server(app) as url:
        yield url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=30)


def test_api_key_is_required_except_on_health(server):
    for key in ("wrong", ""):
        bad = openai.OpenAI(base_url=server + "/v1", api_key=key or "x", max_retries=0, timeout=30)
        if not key:
            bad = openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0, timeout=30,
                                default_headers={"Authorization": ""})
        with pytest.raises(openai.AuthenticationError) as info:
            bad.completions.create(model=NAME, prompt="hi", max_tokens=2)
        assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    r = httpx.get(server + "/v1/models")
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(server + "/metrics").status_code == 401
    assert httpx.get(server + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(server + "/health").json() == {"status": "ok"}


def test_models_show_the_eviction_settings(client):
    (model,) = client.models.list().data
    settings = model.model_extra["h2o"]
    assert (settings["policy"], settings["heavy"], settings["recent"]) == ("h2o", 8, 8)
    assert settings["max_prompt_tokens"] == 200 and settings["schedule"] == "budget"


def test_completion_logprobs_match_the_model(client, model_tok):
    """The logprob of each chosen token and the top alternatives are the model's own log-softmax."""
    model, tok = model_tok
    r = client.completions.create(model=NAME, prompt="abcdefgh", max_tokens=5, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True, "h2o": {"policy": "full"}})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    ids = tok("abcdefgh")["input_ids"]
    logits = model(torch.tensor([ids])).logits[0, -1]
    expected = torch.log_softmax(logits.float(), -1)
    first = int(expected.argmax())
    assert lp.tokens[0] == tok.decode([first])
    assert math.isclose(lp.token_logprobs[0], float(expected[first]), abs_tol=1e-4)
    assert len(lp.top_logprobs[0]) <= 3 and max(lp.top_logprobs[0].values()) == pytest.approx(lp.token_logprobs[0])
    assert all(v <= 0 for v in lp.token_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_streamed_and_not(client):
    kwargs = dict(model=NAME, messages=[{"role": "user", "content": "hello"}], max_completion_tokens=6,
                  temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content
    assert len(content) == 6 == whole.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)  # greedy picks the top
    streamed = [c for chunk in client.chat.completions.create(stream=True, **kwargs)
                for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content])
    plain = client.chat.completions.create(**{**kwargs, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(**{**kwargs, "logprobs": False})


def test_n_choices_with_seeds(client):
    """``n`` choices: each its own sequence; seeded sampling reproduces each choice; usage counts the
    prompt once."""
    kwargs = dict(model=NAME, prompt="sample me", max_tokens=12, temperature=1.0, n=4, seed=7,
                  extra_body={"ignore_eos": True})
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # different seeds per choice
    assert a.usage.completion_tokens == 4 * 12 and a.usage.total_tokens == a.usage.prompt_tokens + 48
    single = client.completions.create(**{**kwargs, "n": 1, "seed": 7 + 2})
    assert single.choices[0].text == a.choices[2].text

    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    texts = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(4)}
    assert [texts[i] for i in range(4)] == [c.text for c in a.choices]
    finishes = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(f.index for f in finishes) == [0, 1, 2, 3]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 48
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_n_and_max_completion_tokens(client):
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], n=3,
                                       max_completion_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert len(r.choices) == 3 and len({c.message.content for c in r.choices}) == 1  # greedy: all equal
    assert all(c.finish_reason == "length" for c in r.choices) and r.usage.completion_tokens == 15


def test_stop_is_not_emitted_when_streaming(client):
    base = dict(model=NAME, prompt="stop test", max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**base).choices[0].text
    stop = full[10:13]
    pieces = [c.choices[0].text for c in client.completions.create(stream=True, stop=stop, **base) if c.choices]
    assert "".join(pieces) == full[: full.index(stop)]
    assert all(stop not in p for p in pieces)


def test_prompt_limit(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=NAME, prompt="y" * 201, max_tokens=2)
    assert info.value.body["code"] == "context_length_exceeded" and info.value.body["param"] == "prompt"
    assert client.completions.create(model=NAME, prompt="y" * 200, max_tokens=2).usage.prompt_tokens == 200


def test_request_timeout_ends_with_a_final_event(model_tok):
    """--request-timeout ends a request with what it generated so far. Whatever the machine's speed:
    the request asks for more tokens than any machine decodes before the timeout (rolling positions
    lift the context bound; the context's 1,014 tokens take 2-3 s on a 2-core machine, and one a
    few times faster ended them inside the 0.5 s timeout this test had), and the timeout leaves a
    loaded machine ample time for the first tokens (milliseconds of work)."""
    model, tok = model_tok
    app = create_app(model, tok, model_name=NAME, options=EngineOptions(prefill_chunk=32, positions="rolling"),
                     limits=ServerLimits(request_timeout=2.0))
    with running_server(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        never_ends = 10**7
        body = dict(model=NAME, prompt="go on", max_tokens=never_ends, temperature=0, extra_body={"ignore_eos": True})
        r = client.completions.create(**body)
        assert r.choices[0].finish_reason == "timeout" and 0 < r.usage.completion_tokens < never_ends
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **body))
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "timeout"
        assert 0 < chunks[-1].usage.completion_tokens < never_ends
        metrics = scrape(url)
        assert metrics["h2okv_kv_bytes_in_use"] == 0
    assert app.state.engine.stats.finished["timeout"] == 2


def test_latency_histograms_and_eviction_metrics(client, server):
    client.completions.create(model=NAME, prompt="z" * 60, max_tokens=10, temperature=0,
                              extra_body={"ignore_eos": True})
    text = httpx.get(server + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    samples = {}
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.labels:
                samples[s.name] = s.value
    for name in ("h2okv_time_to_first_token_seconds", "h2okv_inter_token_latency_seconds", "h2okv_queue_seconds"):
        assert samples[name + "_count"] >= 1 and samples[name + "_sum"] > 0
    assert samples["h2okv_inter_token_latency_seconds_count"] >= 9  # 10 tokens: 9 gaps (at least this request)
    # 60 prompt + 9 fed tokens against a 16-slot budget: at least 53 evicted
    assert samples["h2okv_evicted_tokens_total"] >= 53
    assert "h2okv_evictions_per_second" in samples and "h2okv_kv_bytes_reserved" in samples
