"""Hypothesis strategies for request bodies of ``h2okv serve`` and the check every answer must pass
(a 2xx, or a 4xx in OpenAI's error format; never a 5xx). Shared by the in-process fuzz
(tests/serve/test_fuzz.py) and the one against a real server process (tests/serve/test_hardening.py).

``bodies(name, hostile=True)`` adds what an attacker sends: extreme numbers, odd unicode (lone
surrogates included: serialise with ``encode``, whose ``json.dumps`` escapes them), wrong JSON
types, huge budgets, tiny temperatures and long stop lists."""

from __future__ import annotations

import functools
import json

from hypothesis import strategies as st

junk = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70),
                 st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12),
                 st.lists(st.integers(-3, 300), max_size=4), st.dictionaries(st.text(max_size=5), st.integers(),
                                                                             max_size=2))
small_int = st.integers(-3, 20)

# -- what an attacker adds ------------------------------------------------------------------------------
odd_text = st.text(st.one_of(st.characters(), st.characters(categories=["Cs"]),  # lone surrogates
                             st.sampled_from(["\x00", "\ufeff", "\u202e", "\U0010ffff", "\ufffd"])), max_size=24)
extreme_int = st.one_of(st.sampled_from([0, -1, 1 << 31, 1 << 63, -(1 << 63), 1 << 64, 10**30, 10**300]),
                        st.integers(-(1 << 200), 1 << 200))
extreme_float = st.one_of(st.sampled_from([0.0, -0.0, 5e-324, 1e-40, 1e-6, 1e308, -1e308]),
                          st.floats(allow_nan=True, allow_infinity=True))  # NaN/Infinity: json.dumps writes them
wrong_type = st.one_of(st.integers(0, 5).map(str), st.sampled_from(["yes", "true", "1.5", "null"]), st.booleans(),
                       st.lists(st.integers(0, 3), max_size=2), st.just({}))
tiny_temperature = st.one_of(st.floats(0.0, 1e-3), st.sampled_from([5e-324, 1e-45, 1e-40, 1e-10, 1e-5]))
long_stop = st.one_of(st.lists(st.text(max_size=4), min_size=5, max_size=12),
                      st.integers(200, 4000).map(lambda n: "s" * n), st.lists(odd_text, max_size=4))


def _either(hostile: bool, plain, *extra):
    """``plain``, or (hostile) any of ``plain`` and the ``extra`` strategies."""
    return st.one_of(plain, *extra) if hostile else plain


def fields(name: str, hostile: bool = False) -> tuple[dict, dict]:
    """(completion fields, chat fields): a strategy per field of a request to a server of ``name``."""
    h = functools.partial(_either, hostile)
    text = h(st.text(max_size=40), odd_text)
    prompt = st.one_of(text, st.lists(st.integers(-2, 400), max_size=12), st.lists(h(st.text(max_size=10), odd_text),
                                                                                    max_size=3),
                       st.lists(st.lists(st.integers(0, 300), max_size=4), max_size=2), h(junk, wrong_type))
    budget_int = h(small_int, extreme_int, wrong_type)
    h2o = st.one_of(junk, st.fixed_dictionaries({}, optional={
        "policy": st.sampled_from(["h2o", "full", "local", "sink", "random", "nope", 7, "snapkv:window=4",
                                   "snapkv:window=0", "snapkv:window=x", "h2o:window=4", "tova", "snapkv:16"]),
        "heavy": budget_int, "recent": budget_int,
        "heavy_ratio": h(st.floats(-0.5, 1.5), extreme_float), "recent_ratio": h(st.floats(-0.5, 1.5), extreme_float),
        "budget": small_int}))
    part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": h(st.text(max_size=8),
                                                                                           odd_text)})
    message = st.fixed_dictionaries({
        "role": st.sampled_from(["user", "system", "assistant", "developer", "tool", 3]),
        "content": st.one_of(text, st.lists(part, max_size=2), h(junk, wrong_type))})
    common = {
        "model": st.one_of(st.just(name), junk),
        "max_tokens": st.one_of(small_int, st.integers(50, 1 << 80), h(junk, extreme_int, wrong_type)),
        "temperature": st.one_of(st.floats(-1, 3), h(junk, tiny_temperature, extreme_float, wrong_type)),
        "top_p": st.one_of(st.floats(-0.5, 1.5), h(junk, extreme_float, wrong_type)),
        "n": st.one_of(st.integers(-1, 3), h(junk, extreme_int, wrong_type)),
        "stream": st.one_of(st.booleans(), h(junk, wrong_type)),
        "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), junk),
        "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=6), h(junk, long_stop)),
        "seed": st.one_of(st.integers(-(1 << 65), 1 << 65), h(junk, extreme_int, wrong_type)),
        "logprobs": st.one_of(small_int, h(junk, wrong_type)),
        "h2o": h2o, "ignore_eos": st.one_of(st.booleans(), h(junk, wrong_type)), "echo": junk, "best_of": junk,
        "presence_penalty": junk, "logit_bias": junk, "top_logprobs": st.one_of(small_int, h(junk, wrong_type)),
        "user": h(junk, odd_text),
    }
    chat = {**common, "messages": st.one_of(st.lists(message, max_size=3), junk),
            "max_completion_tokens": st.one_of(small_int, h(junk, extreme_int, wrong_type)), "tools": junk,
            "response_format": junk}
    return {**common, "prompt": prompt}, chat


def bodies(name: str, hostile: bool = False) -> tuple[st.SearchStrategy, st.SearchStrategy]:
    """(completion bodies, chat bodies): any subset of the fields, each any of its values."""
    completion, chat = fields(name, hostile)
    return st.fixed_dictionaries({}, optional=completion), st.fixed_dictionaries({}, optional=chat)


def hostile_fields(name: str) -> tuple[dict, dict]:
    """(completion fields, chat fields): only what an attacker would send, one strategy per field."""
    surrogate_text = st.tuples(st.text(max_size=6), st.characters(categories=["Cs"]), st.text(max_size=6)).map("".join)
    message = st.fixed_dictionaries({"role": st.just("user"), "content": st.one_of(
        surrogate_text, odd_text, wrong_type, st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                               "text": surrogate_text}), max_size=2))})
    h2o = st.fixed_dictionaries({"heavy": st.one_of(extreme_int, wrong_type)}, optional={
        "recent": st.one_of(extreme_int, wrong_type), "policy": st.sampled_from(
            ["snapkv:window=4", "snapkv:window=0", "snapkv:window=x", "h2o:window=4", "snapkv:16", "tova"]),
        "heavy_ratio": extreme_float})
    common = {
        "max_tokens": st.one_of(extreme_int, wrong_type), "temperature": st.one_of(tiny_temperature, extreme_float,
                                                                                  wrong_type),
        "top_p": st.one_of(extreme_float, wrong_type), "n": st.one_of(extreme_int, wrong_type),
        "stream": wrong_type, "stop": long_stop, "seed": st.one_of(extreme_int, wrong_type),
        "h2o": st.one_of(h2o, wrong_type), "ignore_eos": wrong_type, "user": odd_text,
        "stream_options": st.one_of(wrong_type, st.fixed_dictionaries({"include_usage": wrong_type})),
    }
    completion = {**common, "logprobs": st.one_of(wrong_type, extreme_int),
                  "prompt": st.one_of(surrogate_text, odd_text, st.lists(surrogate_text, min_size=1, max_size=1),
                                      st.lists(extreme_int, min_size=1, max_size=3), wrong_type)}
    chat = {**common, "logprobs": st.one_of(st.integers(0, 3), st.just("true")),
            "top_logprobs": st.one_of(extreme_int, wrong_type),
            "messages": st.lists(message, min_size=1, max_size=2),
            "max_completion_tokens": st.one_of(extreme_int, wrong_type)}
    return completion, chat


def mutated_bodies(name: str) -> st.SearchStrategy:
    """``(path, body)``: a valid short request with one or two fields replaced by hostile values, so
    that most bodies pass the other checks and the hostile value reaches tokenising, budgets, sampling."""
    completion, chat = hostile_fields(name)
    valid = {"model": name, "max_tokens": 4, "temperature": 0.7, "ignore_eos": True}

    def mutate(path: str, base: dict, strategies: dict) -> st.SearchStrategy:
        # the fields whose values reach the tokenizer, the budget arithmetic and sampling, more often
        likely = [k for k in ("prompt", "messages", "temperature", "h2o") if k in strategies] * 3
        keys = st.lists(st.sampled_from(sorted(strategies) + likely), min_size=1, max_size=2, unique=True)
        changes = keys.flatmap(lambda ks: st.fixed_dictionaries({k: strategies[k] for k in ks}))
        return changes.map(lambda c: (path, {**base, **c}))

    return st.one_of(mutate("/v1/completions", {**valid, "prompt": "hello"}, completion),
                     mutate("/v1/chat/completions", {**valid, "messages": [{"role": "user", "content": "hi"}]}, chat))


def encode(body) -> bytes:
    """JSON as a client could send it: lone surrogates as ``\\ud800`` escapes, NaN/Infinity as Python
    writes them (its parser, the server's, reads them back)."""
    return json.dumps(body).encode()


def check(status: int, content_type: str, payload: bytes) -> None:
    """A 2xx with choices (or an event stream), or a 4xx whose body is OpenAI's error object."""
    assert status < 500, payload[:500]
    if status >= 400:
        error = json.loads(payload)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    elif "text/event-stream" in content_type:
        events = [line[6:] for line in payload.decode().split("\n") if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", payload[-500:]
        assert not any('"error"' in e and "error" in json.loads(e) for e in events[:-1]), payload[-500:]
    else:
        assert json.loads(payload)["choices"]
