"""``h2okv serve`` over HTTP with the official ``openai`` client: a real uvicorn server on 127.0.0.1
(random free port) in front of a tiny random model with a byte-level tokenizer."""

import asyncio
import threading
import time

import httpx
import openai
import pytest
import torch

from h2okv import H2OCache
from h2okv.bench.serve import scrape
from h2okv.core.budget import DEFAULT_BUDGET_FLOOR
from h2okv.core.compat import cache_arg
from h2okv.serve import EvictionDefaults, create_app, running_server
from h2okv.serve.engine import EngineOptions
from h2okv.serve.sampling import INVALID
from h2okv.tools.tiny_chat import tiny_chat_model

NAME = "tiny"
LIMIT = 1024  # the tiny model's context length
# a request that must still be running when the test acts on it asks for this many tokens, under
# rolling positions (which lift the context bound): no machine decodes it in a test's lifetime (the
# context's 1,014 tokens take 2-3 s on a 2-core machine: one a few times faster ends them early)
NEVER_ENDS = 10**7


@pytest.fixture(scope="module")
def model_tok():
    return tiny_chat_model(layers=2, max_positions=LIMIT, initializer_range=0.3)


@pytest.fixture(scope="module")
def server(model_tok):
    model, tok = model_tok
    app = create_app(model, tok, model_name=NAME, options=EngineOptions(prefill_chunk=32, max_batch=32))
    with running_server(app) as url:
        yield url


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=30)


def greedy_alone(model, ids, steps, policy="h2o", **budget):
    cache = H2OCache(model, policy=policy, chunk_size=32, **budget)
    out = model.generate(torch.tensor([ids]), **cache_arg(cache), max_new_tokens=steps, min_new_tokens=steps,
                         do_sample=False, pad_token_id=257)
    return out[0, len(ids):].tolist()


def test_models_health_metrics(client, server):
    assert [m.id for m in client.models.list()] == [NAME]
    assert httpx.get(server + "/health").json() == {"status": "ok"}
    metrics = scrape(server)
    assert "h2okv_kv_bytes_in_use" in metrics and "h2okv_generated_tokens_total" in metrics


def test_completion_equals_generation_alone(client, model_tok):
    """Greedy text through the server = the model's own generate with an H2O cache of the budget the
    server resolved: 10% + 10% of the prompt, raised to the budget floor for this short prompt, so
    the answer is also the full cache's."""
    model, tok = model_tok
    text = "The quick brown fox jumps over the lazy dog, then runs far away into the forest at dusk."
    ids = tok(text)["input_ids"]
    r = client.completions.create(model=NAME, prompt=text, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 12, len(ids) + 12)
    h2o = r.model_extra["h2o"]
    half = DEFAULT_BUDGET_FLOOR // 2
    assert len(ids) // 5 < DEFAULT_BUDGET_FLOOR  # 20% of the prompt is below the floor
    assert (h2o["policy"], h2o["heavy"], h2o["recent"]) == ("h2o", half, half)
    expected = greedy_alone(model, ids, 12, heavy=half, recent=half)
    assert choice.text == tok.decode(expected, skip_special_tokens=True)
    assert expected == greedy_alone(model, ids, 12, policy="full")


def test_per_request_recipe_and_budget(client, model_tok):
    model, tok = model_tok
    text = "y" * 300  # 300 byte tokens: a fraction above the floor
    ids = tok(text)["input_ids"]
    r = client.completions.create(model=NAME, prompt=text, max_tokens=6, temperature=0,
                                  extra_body={"h2o": {"recipe": "bounded", "budget": 0.5}, "ignore_eos": True})
    h2o = r.model_extra["h2o"]
    # 50% of the prompt, the recipe's recent share (0.078) of it recent
    assert h2o["policy"] == "snapkv:window=32,kernel=31,pool=max,words=1"
    assert (h2o["heavy"], h2o["recent"]) == (int(0.5 * 0.922 * len(ids)), int(0.5 * 0.078 * len(ids)))
    expected = greedy_alone(model, ids, 6, policy=h2o["policy"], heavy=h2o["heavy"], recent=h2o["recent"])
    assert r.choices[0].text == tok.decode(expected, skip_special_tokens=True)
    slots = client.completions.create(model=NAME, prompt=text, max_tokens=2, temperature=0,
                                      extra_body={"h2o": {"budget": 40, "recent_share": 0.25}})
    assert (slots.model_extra["h2o"]["heavy"], slots.model_extra["h2o"]["recent"]) == (30, 10)


def test_chat_completion_uses_the_chat_template(client, model_tok):
    _, tok = model_tok
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0)
    templated = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(templated)
    assert 1 <= r.usage.completion_tokens <= 5
    assert r.choices[0].finish_reason in ("stop", "length")


def test_streaming_matches_non_streaming(client):
    kwargs = dict(model=NAME, prompt="Once upon a time", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.id == chunks[0].id for c in chunks)


def test_chat_streaming(client):
    stream = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_stop_sequence_ends_generation(client):
    first = client.completions.create(model=NAME, prompt="abc", max_tokens=30, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    stop = first[5:7]  # a piece from the middle of what greedy decoding produces
    r = client.completions.create(model=NAME, prompt="abc", max_tokens=30, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == first[: first.index(stop)]
    assert r.usage.completion_tokens < 30


def test_per_request_eviction_override(client, model_tok):
    model, tok = model_tok
    text = "x" * 20 + "some longer prompt so that a small window really evicts tokens" * 2
    ids = tok(text)["input_ids"]
    results = {}
    for override in ({"policy": "local", "heavy": 0, "recent": 6}, {"policy": "full"},
                     {"heavy_ratio": 0.05, "recent_ratio": 0.05}):
        r = client.completions.create(model=NAME, prompt=text, max_tokens=10, temperature=0,
                                      extra_body={"h2o": override, "ignore_eos": True})
        results[str(override)] = r
    local = results[str({"policy": "local", "heavy": 0, "recent": 6})]
    assert local.model_extra["h2o"] == {"policy": "local", "heavy": 0, "recent": 6, "kv_slots": 7}
    expected = greedy_alone(model, ids, 10, policy="local", heavy=0, recent=6)
    assert local.choices[0].text == tok.decode(expected, skip_special_tokens=True)
    full = results[str({"policy": "full"})]
    assert full.model_extra["h2o"]["kv_slots"] == len(ids) + 10 and full.model_extra["h2o"]["heavy"] is None
    ratio = results[str({"heavy_ratio": 0.05, "recent_ratio": 0.05})].model_extra["h2o"]
    assert int(0.1 * len(ids)) < DEFAULT_BUDGET_FLOOR  # a short prompt: its 10% is raised to the floor
    assert (ratio["policy"], ratio["heavy"], ratio["recent"]) == ("h2o", DEFAULT_BUDGET_FLOOR // 2, DEFAULT_BUDGET_FLOOR // 2)


BAD_REQUESTS = [  # (body changes, status, param)
    ({"model": "gpt-4"}, 404, "model"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": -3}, 400, "max_tokens"),
    ({"max_tokens": LIMIT + 1}, 400, "max_tokens"),
    ({"max_tokens": LIMIT - 2}, 400, "max_tokens"),  # prompt + max_tokens beyond the context
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": [100000]}, 400, "prompt"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"n": 0}, 400, "n"),
    ({"n": 17}, 400, "n"),
    ({"logprobs": 21}, 400, "logprobs"),
    ({"logprobs": -1}, 400, "logprobs"),
    ({"seed": 1 << 64}, 400, "seed"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options"),  # without stream=true
    ({"temperature": 3}, 400, "temperature"),
    ({"h2o": {"policy": "nope"}}, 400, "h2o"),
    ({"h2o": {"heavy": 0, "recent": 4}}, 400, "h2o"),
    ({"h2o": {"heavy_ratio": 1.5, "recent_ratio": 0.1}}, 400, "h2o.heavy_ratio"),
    ({"h2o": {"heavy": 4, "recent": 4, "heavy_ratio": 0.1}}, 400, "h2o"),
    ({"h2o": {"policy": "full", "heavy": 4, "recent": 4}}, 400, "h2o"),
    ({"h2o": {"budgett": 4}}, 400, "h2o.budgett"),
    ({"h2o": {"budget": 1.5}}, 400, "h2o.budget"),
    ({"h2o": {"budget": 0.2, "heavy": 4}}, 400, "h2o"),
    ({"h2o": {"budget": LIMIT + 1}}, 400, "h2o.budget"),
    ({"h2o": {"recipe": "fastest"}}, 400, "h2o"),
    ({"h2o": {"recipe": "bounded", "budget": "0.2"}}, 400, "h2o.budget"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
]


@pytest.mark.parametrize("change,status,param", BAD_REQUESTS, ids=[str(c[0]) for c in BAD_REQUESTS])
def test_bad_requests_get_openai_errors(server, change, status, param):
    body = {"model": NAME, "prompt": "hello world", "max_tokens": 4, **change}
    r = httpx.post(server + "/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]


def test_openai_client_raises_the_right_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="h2o"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       extra_body={"h2o": {"policy": "h2o", "heavy": 5, "recent": 0}})
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=NAME, messages=[], max_tokens=2)


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b""])
def test_malformed_bodies(server, client, raw):
    r = httpx.post(server + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    # and the server keeps serving
    assert client.completions.create(model=NAME, prompt="ok", max_tokens=2).usage.completion_tokens >= 1


def test_failure_in_one_request_is_a_500(client, monkeypatch):
    import h2okv.serve.outputs as outputs_module

    real = outputs_module.sample_batch

    def poisoned(logits, temperatures, top_ps, generators):  # a temperature-0.5 row samples NaN
        tokens = real(logits, temperatures, top_ps, generators)
        return [INVALID if t == 0.5 else token for t, token in zip(temperatures, tokens, strict=True)]

    monkeypatch.setattr(outputs_module, "sample_batch", poisoned)
    with pytest.raises(openai.InternalServerError, match="nan"):
        client.completions.create(model=NAME, prompt="x", max_tokens=3, temperature=0.5)
    with pytest.raises(openai.APIError, match="nan"):
        list(client.completions.create(model=NAME, prompt="x", max_tokens=3, temperature=0.5, stream=True))
    assert client.completions.create(model=NAME, prompt="x", max_tokens=3, temperature=0).choices[0].text is not None


def wait_for(url, predicate, timeout=60.0):  # a safety net: the state comes within an engine step
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = scrape(url)
        if predicate(metrics):
            return metrics
        time.sleep(0.02)
    raise AssertionError(f"metrics never reached the expected state: {metrics}")


def test_queue_limit_and_disconnect(model_tok):
    """One running, one waiting, the next gets 429; a client that goes away frees its slots and the
    waiting request runs."""
    model, tok = model_tok
    app = create_app(model, tok, model_name=NAME,
                     options=EngineOptions(max_batch=1, max_queue=1, prefill_chunk=32, positions="rolling"))
    with running_server(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        # runs until its client leaves: the queue stays full for the 429, however fast the machine
        long = client.completions.create(model=NAME, prompt="long", max_tokens=NEVER_ENDS, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
        next(iter(long))  # it is running
        waiting = {}
        thread = threading.Thread(target=lambda: waiting.update(
            r=client.completions.create(model=NAME, prompt="wait", max_tokens=3, temperature=0)))
        thread.start()
        wait_for(url, lambda m: m["h2okv_requests_waiting"] == 1 and m["h2okv_requests_running"] == 1)
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model=NAME, prompt="third", max_tokens=3)
        assert info.value.body["code"] == "queue_full"
        long.close()  # the client disconnects mid-stream
        thread.join(60)  # a safety net, above the client's 30 s timeout
        assert waiting["r"].usage.completion_tokens >= 1
        after = wait_for(url, lambda m: m["h2okv_requests_running"] == 0 and m["h2okv_kv_bytes_in_use"] == 0)
        assert after["h2okv_generated_tokens_total"] < NEVER_ENDS  # the long one really stopped early
        finished = httpx.get(url + "/metrics").text
        assert 'h2okv_requests_finished_total{outcome="cancelled"} 1.0' in finished


def test_load_32_concurrent_streams(model_tok):
    """32 concurrent streaming clients against a KV limit that fits only some at once: every stream
    is complete and well formed, and afterwards no KV memory is held."""
    model, tok = model_tok
    eviction = EvictionDefaults.from_options(policy="h2o", heavy=8, recent=8)
    probe = create_app(model, tok, model_name=NAME).state.engine.slot_bytes
    kv_memory = 12 * 17 * probe  # 12 requests of 16 + 1 slots, less one prefill chunk's overshoot
    app = create_app(model, tok, model_name=NAME, eviction=eviction,
                     options=EngineOptions(kv_memory=kv_memory, max_batch=64, prefill_chunk=32))

    async def one(aclient, i):
        stream = await aclient.completions.create(model=NAME, prompt=f"request number {i} " * 3, max_tokens=8,
                                                  temperature=0.7, seed=i, stream=True,
                                                  stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])
        assert chunks[-1].usage is not None and 1 <= chunks[-1].usage.completion_tokens <= 8
        return chunks[-1].usage.completion_tokens

    async def main(url):
        aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        return await asyncio.wait_for(asyncio.gather(*(one(aclient, i) for i in range(32))), timeout=120)

    with running_server(app) as url:
        tokens = asyncio.run(main(url))
        after = wait_for(url, lambda m: m["h2okv_requests_running"] == 0)
    assert len(tokens) == 32
    assert after["h2okv_kv_bytes_in_use"] == 0 and after["h2okv_requests_waiting"] == 0
    assert after["h2okv_generated_tokens_total"] == sum(tokens)
    assert 1 < after["h2okv_batch_size_max"] < 32  # batched, and held back by the KV limit
    assert after["h2okv_kv_bytes_peak"] <= kv_memory


def test_non_streaming_client_that_gives_up_is_cancelled(model_tok):
    model, tok = model_tok
    app = create_app(model, tok, model_name=NAME, options=EngineOptions(prefill_chunk=32, positions="rolling"))
    with running_server(app) as url:
        # no machine answers it within the client's 0.3 s (the context's 1,014 tokens could be)
        body = {"model": NAME, "prompt": "go", "max_tokens": NEVER_ENDS, "temperature": 0, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
        after = wait_for(url, lambda m: m["h2okv_requests_running"] == 0)
        assert after["h2okv_kv_bytes_in_use"] == 0
        assert after["h2okv_generated_tokens_total"] < NEVER_ENDS
        assert 'h2okv_requests_finished_total{outcome="cancelled"} 1.0' in httpx.get(url + "/metrics").text


def test_runtime_error_kinds_map_to_statuses():
    """The runtime says what went wrong; the HTTP layer alone says which status that is."""
    from h2okv.serve.api.errors import APIError
    from h2okv.serve.errors import ErrorKind, ServeError

    want = {ErrorKind.INVALID_REQUEST: (400, "invalid_request_error"), ErrorKind.OVERLOADED: (429, "rate_limit_error"),
            ErrorKind.UNAVAILABLE: (503, "server_error"), ErrorKind.INTERNAL: (500, "server_error")}
    for kind, (status, type_) in want.items():
        error = APIError.from_serve_error(ServeError(kind, "why", param="max_tokens", code="some_code"))
        assert (error.status, error.type) == (status, type_)
        assert error.body() == {"error": {"message": "why", "type": type_, "param": "max_tokens", "code": "some_code"}}
    assert set(want) == set(ErrorKind)
