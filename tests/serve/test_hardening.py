"""Issue 20: one request never hurts another. Each defect found by probing ``h2okv serve`` as an
attacker would, reproduced against a real server process (tiny checkpoint on disk, 127.0.0.1, the
probe's flags: an API key, 64M of KV memory, 16 in the batch, 32 in the queue, a 60 s timeout):

1. a lone surrogate in a prompt or a chat message -> 400 (was a 500 from the tokenizer);
2. a tiny valid temperature (1e-40) -> greedy, 200 (was a 500: inf/nan probabilities);
3. a huge per-request budget -> 400, and the requests prefilling beside it are unharmed (was a
   500 for all four);
4. a 20 MB body -> 413 at once while /health keeps answering (was ~20 s of a frozen server);
5. ``"h2o": {"policy": "snapkv:window=4"}`` -> the option applied and echoed (was dropped);

and the risks found with them: silent type coercion, ``n`` taking the whole batch, a duplicate
``Authorization`` header, over-long stop strings. Then a property-based fuzz of hostile bodies
against a real process: never a 5xx, and a healthy server holding no KV memory afterwards.
"""

import asyncio
import json
import os
import socket
import threading
import time

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM, AutoTokenizer

from h2okv import H2OCache
from h2okv.bench.serve import scrape
from h2okv.core.compat import cache_arg
from h2okv.tools.process import ServerProcess, save_tiny_model
from serve_requests import check, encode, mutated_bodies

NAME = "tiny"
KEY = "K"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 2048
# a safety net for a server's start (imports and a model load: seconds, but ~60 s were seen on a
# loaded 2-core machine, half the default 120 s)
STARTUP_S = 600
PROBE_FLAGS = ["--api-key", KEY, "--kv-memory", "64M", "--max-batch", "16", "--max-queue", "32",
               "--request-timeout", "60", "--chunk-size", "64", "--body-timeout", "3"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_chat"), layers=2, max_positions=CONTEXT)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with ServerProcess(["--model", str(checkpoint), "--served-model-name", NAME, "--log-level", "warning",
                        *PROBE_FLAGS], log_path=log) as process:
        process.wait_healthy(timeout=STARTUP_S)
        yield process.url


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, headers=AUTH, timeout=120) as client:
        yield client


def post(http, path: str, body: dict | bytes) -> httpx.Response:
    raw = body if isinstance(body, bytes) else encode(body)
    return http.post(path, content=raw, headers={"content-type": "application/json"})


def complete(http, prompt="hello", **fields) -> httpx.Response:
    return post(http, "/v1/completions", {"model": NAME, "prompt": prompt, "max_tokens": 4, **fields})


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def greedy_text(http, prompt: str, max_tokens: int = 8, **fields) -> str:
    r = complete(http, prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True, **fields)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


# -- 1. strings UTF-8 cannot encode ----------------------------------------------------------------------
SURROGATES = [  # (path, body without model)
    ("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 4}),
    ("/v1/completions", {"prompt": ["a\udfffb"], "max_tokens": 4}),
    ("/v1/completions", {"prompt": "ok", "max_tokens": 4, "stop": ["\ud800"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}], "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}],
                              "max_tokens": 4}),
]


@pytest.mark.parametrize("path,body", SURROGATES, ids=[f"{'chat' if 'chat' in p else 'completion'}-{i}" for i, (p, _) in enumerate(SURROGATES)])
def test_lone_surrogate_is_a_400(http, path, body):
    error = assert_openai_error(post(http, path, {"model": NAME, **body}), 400)
    assert error["type"] == "invalid_request_error" and "UTF-8" in error["message"]


# -- 2. tiny temperatures ------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1e-6])
def test_tiny_temperature_is_greedy(http, temperature):
    """Below vLLM's 1e-5 a temperature means greedy: the same text as temperature 0, streamed or not."""
    prompt = "tiny temperatures"
    expected = greedy_text(http, prompt, max_tokens=12)
    r = complete(http, prompt, max_tokens=12, temperature=temperature, ignore_eos=True, seed=3)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected
    streamed = complete(http, prompt, max_tokens=12, temperature=temperature, ignore_eos=True, stream=True)
    assert streamed.status_code == 200
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in streamed.text.splitlines()
             if line.startswith("data: {") and json.loads(line[6:])["choices"]]
    assert "".join(texts) == expected


@pytest.mark.parametrize("top_p", [5e-324, 1e-45])
def test_tiny_top_p_keeps_the_likeliest_token(http, top_p):
    """Found by the fuzz: a top_p that float32 rounds to 0 dropped every token (a 500); the
    likeliest one always stays, so it is greedy."""
    prompt = "tiny top_p"
    r = complete(http, prompt, max_tokens=8, temperature=0.8, top_p=top_p, ignore_eos=True)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy_text(http, prompt)


# -- 3. budgets and isolation -----------------------------------------------------------------------------
@pytest.mark.parametrize("h2o", [{"heavy": 10**30, "recent": 4}, {"heavy": 4, "recent": 10**30},
                                 {"heavy": CONTEXT + 1, "recent": 4}, {"heavy": 1 << 63, "recent": 1 << 63}],
                         ids=["heavy-1e30", "recent-1e30", "heavy-past-context", "int64-overflow"])
def test_budget_beyond_the_context_is_a_400(http, h2o):
    error = assert_openai_error(complete(http, h2o=h2o), 400)
    assert error["param"].startswith("h2o")


def test_budget_at_the_context_length_is_served(http):
    assert complete(http, h2o={"heavy": CONTEXT, "recent": 4}).status_code == 200


def test_a_failing_request_leaves_the_ones_prefilling_beside_it_unharmed(http, server):
    """Three ~600-token prompts prefill together (64-token chunks: ~10 shared forwards each) while
    requests built to fail mid-prefill arrive: the three answer 200 with the text each gives alone."""
    prompts = [f"isolation {i} " + "abcdefghij" * 60 for i in range(3)]
    alone = [greedy_text(http, p, max_tokens=8) for p in prompts]
    bad = [{"model": NAME, "prompt": "q" * 600, "max_tokens": 8, "h2o": {"heavy": 10**30, "recent": 4}},
           {"model": NAME, "prompt": "r" * 600, "max_tokens": 8, "h2o": {"heavy": 1 << 62, "recent": 1 << 62}},
           {"model": NAME, "prompt": "s" * 600, "max_tokens": 8, "temperature": 1e-40}]

    async def together():
        async with httpx.AsyncClient(base_url=server, headers=AUTH, timeout=120) as client:
            good = [client.post("/v1/completions", json={"model": NAME, "prompt": p, "max_tokens": 8, "temperature": 0,
                                                          "ignore_eos": True}) for p in prompts]

            async def poison(body, delay):
                await asyncio.sleep(delay)  # while the three are part-way through their prompts
                return await client.post("/v1/completions", content=encode(body),
                                         headers={"content-type": "application/json"})

            return await asyncio.gather(*good, *(poison(b, 0.05 * i) for i, b in enumerate(bad)))

    responses = asyncio.run(together())
    for r, expected in zip(responses[:3], alone, strict=True):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected
    for r in responses[3:]:
        assert r.status_code < 500, r.text


# -- 4. bounded work: the body limit, tokenising off the event loop ----------------------------------------
class HealthPoller:
    """Polls /health every 0.2 s in a thread: ``answers`` (each a 200?) and the ``slowest`` answer's
    seconds. ``timeout`` is a safety net: a test bounds ``slowest`` against what it measures."""

    def __init__(self, url: str, timeout: float = 120.0):
        self.url, self.timeout = url, timeout
        self.answers: list[bool] = []
        self.slowest = 0.0
        self._stop = threading.Event()
        self._polled = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                answer = httpx.get(self.url + "/health", timeout=self.timeout).status_code == 200
            except httpx.HTTPError:
                answer = False
            self.slowest = max(self.slowest, time.monotonic() - started)
            with self._polled:
                self.answers.append(answer)
                self._polled.notify_all()
            time.sleep(0.2)

    def wait_polls(self, count: int, timeout: float = 60.0) -> bool:
        """Wait for ``count`` more polls to end: orders a test's steps against the poller's (a
        sleep instead may see none on a loaded machine). Two polls after a step include one that
        began after it."""
        with self._polled:
            target = len(self.answers) + count
            return self._polled.wait_for(lambda: len(self.answers) >= target, timeout)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)


def big_prompt_body(megabytes: float) -> bytes:
    return b'{"model": "tiny", "max_tokens": 3, "prompt": "' + b"ab" * int(megabytes * (1 << 19)) + b'"}'


def post_big(url: str, body, headers: dict | None = None) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    r = httpx.post(url + "/v1/completions", content=body, timeout=60,
                   headers={**AUTH, "content-type": "application/json", **(headers or {})})
    return r, time.monotonic() - started


def test_20mb_body_is_a_413_at_once_and_health_answers(server):
    """Refused on its Content-Length, before any of it is parsed (the message gives the declared
    size: the up-front check, not the count of a body read), while /health answers throughout."""
    body = big_prompt_body(20)
    with HealthPoller(server) as health:
        assert health.wait_polls(1)  # /health was polled before the body went out ...
        r, seconds = post_big(server, body)
        assert health.wait_polls(2)  # ... and after its answer
    error = assert_openai_error(r, 413)
    assert f"the request body is {len(body)} bytes" in error["message"], error
    # safety nets (the message says how it was refused): 0.3-0.9 s, and /health 0.3 s at the slowest,
    # on a loaded 2-core machine, where parsing the body took ~20 s
    assert seconds < 10, f"the 413 came after {seconds:.1f} s"
    assert health.answers and all(health.answers), health.answers
    assert health.slowest < 10, f"/health took {health.slowest:.1f} s"


def test_chunked_20mb_body_is_a_413(server):
    """No Content-Length to check up front (chunked transfer): the limit counts what arrives."""
    body = big_prompt_body(20)
    r, seconds = post_big(server, (body[i:i + (1 << 16)] for i in range(0, len(body), 1 << 16)))
    assert_openai_error(r, 413)
    assert seconds < 10, f"the 413 came after {seconds:.1f} s"


def test_body_under_the_limit_is_read(http):
    """The limit is on bytes, not on the framing: a small chunked body is served."""
    body = encode({"model": NAME, "prompt": "chunked", "max_tokens": 2})
    r = http.post("/v1/completions", content=iter([body[:10], body[10:]]), headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


def test_trickled_body_is_a_408_and_frees_the_connection(server):
    """A client that declares a body and never finishes it (a slow-body attack holding a connection
    and a file handle) gets 408 after --body-timeout (3 s here): the answer's code says the body
    timeout fired, and no sooner than its 3 s; the upper bound, 10 times that, is only a net for a
    timer that a loaded machine runs late."""
    host, port = server.removeprefix("http://").split(":")
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"".encode())
        answer = b""
        while piece := sock.recv(4096):  # the server closes the connection after its answer
            answer += piece
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    seconds = time.monotonic() - started
    assert b'"code":"request_timeout"' in answer
    assert 2.5 < seconds < 30, f"the 408 came after {seconds:.1f} s"


@pytest.fixture(scope="module")
def rolling_server(checkpoint, tmp_path_factory):
    """The probe's server with rolling positions: an evicting request's max_tokens is not bound by
    the context, so a stream can outlast whatever a test waits for, on any machine. Without the
    probe's --request-timeout (60 s): on a loaded machine the 3 MB prompt below took longer than
    that to tokenise, and the stream it must outlast was ended by the server's clock, not the test."""
    at = PROBE_FLAGS.index("--request-timeout")
    flags = PROBE_FLAGS[:at] + PROBE_FLAGS[at + 2:]
    log = tmp_path_factory.mktemp("rolling_server") / "server.log"
    with ServerProcess(["--model", str(checkpoint), "--served-model-name", NAME, "--log-level", "warning",
                        *flags, "--positions", "rolling"], log_path=log) as process:
        process.wait_healthy(timeout=STARTUP_S)
        yield process.url


def test_long_prompt_under_the_body_limit_stalls_no_one(rolling_server):
    """A 3 MB prompt (under the body limit, far over the context) is tokenised off the event loop:
    /health answers throughout, a stream running all the while keeps its pace, and the answer is a
    400. Independent of the machine's speed: the prompt goes out once the stream runs, and the
    stream (10**7 tokens) runs until the answer has come, so it spans all of the tokenising (a
    400-token stream started 1 s before the prompt ended ~0.2 s into its ~7 s on a 2-core machine,
    and before it on a faster one). A stall is measured against the tokenising itself: on the event
    loop, or behind a lock the engine needs, a poll or the stream would wait for nearly all of it;
    here neither waits for half of it. (The fixed 2 s this test had was within 15% of a loaded
    2-core machine's slowest poll, and of its slowest gap between two events.)"""
    server = rolling_server
    gaps: list[float] = []
    running, answered, left = threading.Event(), threading.Event(), threading.Event()

    def stream():
        body = {"model": NAME, "prompt": "steady", "max_tokens": 10**7, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", server + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
            last = time.monotonic()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
                    running.set()
                    if answered.is_set():
                        left.set()
                        return  # leaving the stream: the server cancels the rest

    streamer = threading.Thread(target=stream)
    with HealthPoller(server) as health, httpx.Client(base_url=server, headers=AUTH, timeout=300) as http:
        streamer.start()
        assert running.wait(120)
        started = time.monotonic()
        r = post(http, "/v1/completions", big_prompt_body(3))
        seconds = time.monotonic() - started
        answered.set()
        streamer.join(120)
    assert left.is_set(), "the stream ended before the 3 MB prompt was answered"
    assert_openai_error(r, 400, "prompt")
    assert health.answers and all(health.answers), health.answers
    assert health.slowest < seconds / 2, f"/health took {health.slowest:.1f} s during {seconds:.1f} s of tokenising"
    during = gaps[1:]  # (the first is the stream's start)
    assert len(during) > 100 and max(during) < seconds / 2, \
        f"the stream waited {max(during):.1f} s between two events during {seconds:.1f} s of tokenising"


# -- 5. policy options --------------------------------------------------------------------------------------
def greedy_in_one_call(model, ids: list[int], policy: str, steps: int, chunk: int = 64, **budget) -> list[int]:
    """What the server computes for a question-aware policy (snapkv ranks a call before chunking
    it): the prompt in one forward, which the cache evicts ``chunk`` tokens at a time with the
    call's last window ranking every token first, then greedy decode steps at their true positions."""
    cache = H2OCache(model, policy=policy, chunk_size=chunk, **budget)
    out = []
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids]), **cache_arg(cache), use_cache=True).logits[0, -1]
        for position in range(len(ids), len(ids) + steps):
            out.append(int(logits.argmax()))
            logits = model(input_ids=torch.tensor([[out[-1]]]), position_ids=torch.tensor([[position]]),
                           **cache_arg(cache), use_cache=True).logits[0, -1]
    return out


def test_policy_options_are_applied_and_echoed(http, checkpoint):
    """``snapkv:window=4`` reaches the cache (the server's text is the model's own with that cache,
    and differs from the default window's) and the response says so."""
    prompt = "options matter: " + "the observation window decides which tokens stay " * 2  # 116 tokens: 64 + 52
    budget = {"heavy": 8, "recent": 8}
    texts = {}
    for policy in ("snapkv:window=4", "snapkv"):
        r = complete(http, prompt, max_tokens=10, temperature=0, ignore_eos=True, h2o={"policy": policy, **budget})
        assert r.status_code == 200, r.text
        texts[policy] = r.json()["choices"][0]["text"]
        echoed = r.json()["h2o"]["policy"]
    assert echoed == "snapkv:window=32,kernel=7"
    assert r.json()["h2o"]["policy"] == echoed
    r = complete(http, prompt, max_tokens=1, h2o={"policy": "snapkv:window=4", **budget})
    assert r.json()["h2o"]["policy"] == "snapkv:window=4,kernel=7"  # the canonical spec, defaults included
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(checkpoint)
    ids = tok(prompt)["input_ids"]
    assert len(ids) > 64  # more than one of the cache's 64-token chunks: the window ranks what the first evicts
    expected = tok.decode(greedy_in_one_call(model, ids, "snapkv:window=4", 10, **budget), skip_special_tokens=True)
    assert texts["snapkv:window=4"] == expected
    assert texts["snapkv:window=4"] != texts["snapkv"], "the test prompt must tell the windows apart"


@pytest.mark.parametrize("policy", ["snapkv:window=x", "snapkv:window=0", "h2o:window=4", "snapkv:size=4"])
def test_bad_policy_options_are_a_400(http, policy):
    assert_openai_error(complete(http, h2o={"policy": policy}), 400, "h2o")


# -- strict JSON types, as OpenAI's API has them -----------------------------------------------------------
WRONG_TYPES = [  # (path, field, value)
    ("/v1/completions", "max_tokens", "3"), ("/v1/completions", "n", "2"), ("/v1/completions", "stream", "yes"),
    ("/v1/completions", "logprobs", True), ("/v1/completions", "temperature", "0.5"),
    ("/v1/completions", "seed", "7"), ("/v1/completions", "ignore_eos", 1), ("/v1/completions", "max_tokens", 3.0),
    ("/v1/completions", "top_p", "1"), ("/v1/chat/completions", "logprobs", 1),
    ("/v1/chat/completions", "max_completion_tokens", "3"), ("/v1/chat/completions", "n", True),
    ("/v1/completions", "h2o", {"heavy": "4", "recent": 4}), ("/v1/completions", "stream_options", {"include_usage": 1}),
]


@pytest.mark.parametrize("path,field,value", WRONG_TYPES, ids=[f"{f}={v!r}" for _, f, v in WRONG_TYPES])
def test_wrong_json_types_are_a_400(http, path, field, value):
    base = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    body = {"model": NAME, "max_tokens": 2, **base, field: value}
    if field == "stream_options":
        body["stream"] = True
    error = assert_openai_error(post(http, path, body), 400)
    assert error["param"].split(".")[0] == field


def test_json_numbers_of_either_kind_are_accepted_for_floats(http):
    """Strict types, not pedantic ones: ``temperature: 1`` is a number, as in OpenAI's API."""
    assert complete(http, temperature=1, top_p=1).status_code == 200


# -- fair sharing: n ---------------------------------------------------------------------------------------
def test_n_is_capped_so_one_request_cannot_take_the_batch(http):
    """--max-n defaults to 8: an n=16 request may not take all 16 slots of --max-batch 16."""
    assert_openai_error(complete(http, n=16), 400, "n")
    assert complete(http, n=8).status_code == 200


def requests_running(http) -> float:
    text = http.get("/metrics").text
    return next(s.value for family in text_string_to_metric_families(text) for s in family.samples
                if s.name == "h2okv_requests_running")


def test_n_sequences_leave_room_for_others(http, server):
    """Each of the n choices is a running sequence (as vLLM counts them): an n=8 request generating
    for long leaves half the batch, and a short request beside it is served while the eight still
    run (with no room it would wait for them to end). What happened, not how long it took: the
    eight have streamed a token before the short request goes out, they ask for all the context
    they can (~2,000 steps, the short one needs ~3), and they are still running after its answer."""
    body = {"model": NAME, "prompt": "long", "n": 8, "max_tokens": CONTEXT - 16, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, headers=AUTH, timeout=120) as long_one:
        assert long_one.status_code == 200
        lines = long_one.iter_lines()  # held: an iterator dropped mid-stream closes the connection
        next(line for line in lines if line.startswith("data: "))  # the eight run
        assert complete(http, "short", max_tokens=2).status_code == 200
        assert requests_running(http) >= 8  # the eight did not end before the short one did
    # leaving the stream cancels the eight


# -- duplicate Authorization headers -----------------------------------------------------------------------
@pytest.mark.parametrize("values", [("Bearer wrong", f"Bearer {KEY}"), (f"Bearer {KEY}", "Bearer wrong"),
                                    (f"Bearer {KEY}", f"Bearer {KEY}")], ids=["wrong-then-right", "right-then-wrong",
                                                                              "twice-right"])
def test_two_authorization_headers_are_refused(server, values):
    headers = [("Authorization", v) for v in values] + [("content-type", "application/json")]
    r = httpx.post(server + "/v1/completions", content=encode({"model": NAME, "prompt": "x", "max_tokens": 2}),
                   headers=headers, timeout=30)
    error = assert_openai_error(r, 401)
    assert error["code"] == "invalid_api_key"


# -- stop strings ----------------------------------------------------------------------------------------
def test_stop_strings_are_bounded_in_count_and_length(http):
    assert_openai_error(complete(http, stop=["a", "b", "c", "d", "e"]), 400, "stop")
    assert_openai_error(complete(http, stop="s" * 257), 400, "stop")
    assert_openai_error(complete(http, stop=["ok", "s" * (1 << 20)]), 400, "stop")
    assert complete(http, stop=["s" * 256, "a", "b", "c"]).status_code == 200


# -- property-based fuzz against a real process ---------------------------------------------------------
FUZZ_EXAMPLES = int(os.environ.get("H2OKV_FUZZ_EXAMPLES", "150"))  # `make soak` runs many more


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    """A short context (64 positions), so that the valid requests among the hostile ones end fast."""
    path = save_tiny_model(tmp_path_factory.mktemp("tiny_fuzz"), layers=1, max_positions=64)
    log = tmp_path_factory.mktemp("fuzz_server") / "server.log"
    with ServerProcess(["--model", str(path), "--served-model-name", NAME, "--log-level", "warning",
                        "--chunk-size", "16", "--max-batch", "16"], log_path=log) as process:
        process.wait_healthy(timeout=STARTUP_S)
        with httpx.Client(base_url=process.url, timeout=60) as client:
            yield client


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=mutated_bodies(NAME))
def test_fuzz_hostile_bodies_never_5xx(fuzz_server, request):
    path, body = request
    r = fuzz_server.post(path, content=encode(body), headers={"content-type": "application/json"})
    check(r.status_code, r.headers.get("content-type", ""), r.content)


def test_fuzzed_server_is_healthy_and_holds_no_kv(fuzz_server):
    url = str(fuzz_server.base_url).rstrip("/")
    assert fuzz_server.get("/health").status_code == 200
    deadline = time.monotonic() + 30
    metrics = scrape(url)
    while (metrics["h2okv_requests_running"] or metrics["h2okv_kv_bytes_in_use"]) and time.monotonic() < deadline:
        time.sleep(0.2)
        metrics = scrape(url)
    assert metrics["h2okv_kv_bytes_in_use"] == 0 and metrics["h2okv_requests_running"] == 0
    statuses = [line for line in fuzz_server.get("/metrics").text.splitlines()
                if line.startswith('h2okv_http_errors_total{status="5')]
    assert statuses == [], statuses
