"""The request path shared by ``/v1/completions`` and ``/v1/chat/completions``:

1. ``prepare``: validate the body, tokenise it (``tokenize``, the one place input meets the
   tokenizer), check the lengths against the model's context, resolve the eviction budget, and fan
   out into ``n`` ``GenerationRequest``s (one per choice; seeded choices get seed, seed+1, ...).
   It runs in a worker thread: its work grows with the input (a 4 MB prompt takes seconds to
   tokenise), and on the event loop it would stall ``/health`` and every running stream. The
   threads are a small pool of its own (``PREPARE_THREADS``): tokenising is one at a time anyway,
   and every thread that allocates gets a malloc arena of its own, which the server's RSS keeps.
   It tokenises with a copy of the tokenizer under a lock of its own, so the engine's detokenising
   (under ``engine.tokenizer_lock``) never waits on a long prompt either. A prompt the tokenizer
   cannot take is the client's fault (400), never a 500;
2. submit them to the engine, all or none;
3. answer: server-sent events of all choices merged (``sse.py``), or wait for every choice and
   assemble one response.

The two endpoints differ only in what OpenAI's formats make them differ in: how the prompt is
given (text or token ids; chat messages through the chat template), the default ``max_tokens``,
and the shape of a choice (``Completions`` and ``Chat`` below). Validation raises ``APIError``;
the engine raises ``ServeError``s, which ``errors.py`` maps to statuses.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import Request

from h2okv.chat import history_length
from h2okv.errors import H2OError
from h2okv.policies import make_policy, policy_class
from h2okv.recipes import expand
from h2okv.serve.api.errors import APIError
from h2okv.serve.api.formatting import CompletionLogprobs, chat_logprobs, merge_completion_logprobs
from h2okv.serve.api.sampling_defaults import SamplingDefaults
from h2okv.serve.api.schemas import ChatCompletionRequest, CompletionRequest
from h2okv.serve.api.sse import sse_response
from h2okv.serve.engine import Engine
from h2okv.serve.errors import ServeError
from h2okv.serve.eviction import EvictionDefaults
from h2okv.serve.types import Event, GenerationRequest, Handle
from h2okv.vocabulary import SettingError, as_field
from h2okv.window import context_window

PREPARE_THREADS = 2
DISCONNECT_POLL_S = 0.25  # how often a waiting non-streamed request checks that its client is still there


def model_context_limit(model) -> int:
    return context_window(model.config) or 1 << 30


class Completions:
    """``/v1/completions``: a prompt of text or token ids; choices carry ``text``."""

    object = chunk_object = "text_completion"
    id_prefix = "cmpl"
    prompt_param = "prompt"
    default_max_tokens = 16  # as OpenAI's

    def __init__(self, token_text):
        self.logprobs = CompletionLogprobs(token_text)  # keeps the choice's running text offset

    @staticmethod
    def max_tokens(body: CompletionRequest) -> int | None:
        return body.max_tokens

    def delta(self, event: Event, first: bool, finish: str | None) -> dict | None:
        lp = None if event.logprobs is None else self.logprobs.format(event.logprobs)
        if not (event.text or first or finish or (lp and lp["tokens"])):
            return None
        return {"text": event.text, "logprobs": lp, "finish_reason": finish}

    def whole(self, events: list[Event], wants_logprobs: bool) -> dict:
        lp = merge_completion_logprobs([self.logprobs.format(e.logprobs) for e in events]) if wants_logprobs else None
        return {"text": "".join(e.text for e in events), "logprobs": lp, "finish_reason": events[-1].finish_reason}


class Chat:
    """``/v1/chat/completions``: messages through the chat template; choices carry a message."""

    object, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl"
    prompt_param = "messages"
    default_max_tokens = 256  # when a chat request gives none

    def __init__(self, token_text):
        self.token_text = token_text

    @staticmethod
    def max_tokens(body: ChatCompletionRequest) -> int | None:
        return body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens

    def delta(self, event: Event, first: bool, finish: str | None) -> dict | None:
        lp = None if event.logprobs is None else chat_logprobs(event.logprobs, self.token_text)
        if not (event.text or first or finish or (lp and lp["content"])):
            return None
        delta = {"role": "assistant", "content": event.text} if first else (
            {"content": event.text} if event.text else {})
        return {"delta": delta, "logprobs": lp, "finish_reason": finish}

    def whole(self, events: list[Event], wants_logprobs: bool) -> dict:
        lp = chat_logprobs([e for ev in events for e in ev.logprobs], self.token_text) if wants_logprobs else None
        return {"message": {"role": "assistant", "content": "".join(e.text for e in events)}, "logprobs": lp,
                "finish_reason": events[-1].finish_reason}


@dataclass(frozen=True)
class Limits:
    context: int  # tokens of prompt + completion the model takes
    prompt: int  # the longest prompt accepted
    request_timeout: float | None = None  # seconds; then a request ends with finish_reason "timeout"
    max_n: int = 8  # choices per request (--max-n): each is a running sequence, one slot of --max-batch
    rolling: bool = False  # --positions rolling: an evicting request is not bound by the context


class Serving:
    """One server's request path: ``await serving.respond(body, request)`` answers either endpoint."""

    def __init__(self, engine: Engine, tokenizer, model_name: str, eviction: EvictionDefaults, limits: Limits,
                 count_error, sampling: SamplingDefaults):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.eviction, self.limits = eviction, limits
        self.sampling = sampling  # for requests that give no temperature / top_p (create_app resolves it)
        self.count_error = count_error  # count_error(status): an error answer, for /metrics
        self.vocab = len(tokenizer)
        self.encoder = copy.deepcopy(tokenizer)  # prompts are tokenised with this one, off the engine's lock
        self.encoder_lock = threading.Lock()  # HF fast tokenizers are not safe to share across threads
        self.workers = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="h2okv-prepare")

    async def respond(self, body: CompletionRequest | ChatCompletionRequest, request: Request):
        endpoint = Chat if isinstance(body, ChatCompletionRequest) else Completions
        gens = await asyncio.get_running_loop().run_in_executor(self.workers, self.prepare, body, endpoint)
        handles = self.engine.submit_many(gens, asyncio.get_running_loop())
        envelope = {"id": f"{endpoint.id_prefix}-{uuid.uuid4().hex}", "object": endpoint.object,
                    "created": int(time.time()), "model": self.model_name}
        choices = [endpoint(self.token_text) for _ in handles]
        if body.stream:
            chunk = {**envelope, "object": endpoint.chunk_object}

            def make_chunk(index: int, event: Event, first: bool, finish: str | None) -> dict | None:
                delta = choices[index].delta(event, first, finish)
                return None if delta is None else {**chunk, "choices": [{"index": index, **delta}]}

            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return sse_response(handles, make_chunk, lambda dones: {**chunk, "choices": [], "usage": usage_of(dones)},
                                include_usage, self.error_body)
        results = await collect_all(handles, request)
        return {**envelope,
                "choices": [{"index": i, **choices[i].whole(events, gens[i].top_logprobs is not None)}
                            for i, events in enumerate(results)],
                "usage": usage_of([events[-1] for events in results]), "h2o": self.budget_info(gens[0])}

    # -- validation and tokenisation -------------------------------------------------------------
    def prepare(self, body, endpoint) -> list[GenerationRequest]:
        """The ``n`` generation requests of one API call; raises ``APIError`` for a bad request."""
        if body.model != self.model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        body.check_supported()
        if body.n > self.limits.max_n:
            raise APIError(400, f"n={body.n} is more than this server's --max-n {self.limits.max_n}", param="n")
        stops = body.stop_list()
        self.check_budget(body)
        prompt_ids = self.tokenize(body)
        max_tokens = self.check_lengths(len(prompt_ids), endpoint.max_tokens(body), endpoint, self.rolls(body))
        try:
            policy, heavy, recent = self.eviction.resolve(
                len(prompt_ids), policy=body.h2o.policy if body.h2o else None,
                budget=body.h2o.budget_fields() if body.h2o else None, recipe=body.h2o.recipe if body.h2o else None)
        except SettingError as exc:  # the settings named as the request's fields (h2o.budget)
            named = [as_field(name) for name in exc.names]
            raise APIError(400, exc.said(as_field), param=named[0] if len(named) == 1 else "h2o") from None
        except (H2OError, ValueError, OverflowError) as exc:
            raise APIError(400, f"h2o: {exc}", param="h2o") from None
        return [GenerationRequest(
            prompt_ids=prompt_ids, max_tokens=max_tokens, policy=policy, heavy=heavy, recent=recent,
            temperature=self.sampling.temperature if body.temperature is None else body.temperature,
            top_p=self.sampling.top_p if body.top_p is None else body.top_p, stops=stops,
            seed=None if body.seed is None else (body.seed + i) % (1 << 63), ignore_eos=body.ignore_eos,
            top_logprobs=body.top_logprobs_wanted(), timeout=self.limits.request_timeout,
            budget_label=budget_label(body), cache_prefix=self.cacheable_prefix(body, prompt_ids, policy),
        ) for i in range(body.n)]

    def check_budget(self, body) -> None:
        """Budgets in slots are at most the context length: no sequence holds more tokens, and
        larger numbers (1e30) would only overflow the cache's integer tensors."""
        for name in ("heavy", "recent", "budget"):
            value = getattr(body.h2o, name, None) if body.h2o else None
            if name == "budget" and (isinstance(value, bool) or not isinstance(value, (int, float))
                                     or isinstance(value, float) and value <= 1):
                continue  # a fraction of the prompt, or no number: resolve() says what a budget may be
            if value is not None and not 0 <= value <= self.limits.context:
                raise APIError(400, f"h2o.{name}={value} must be in [0, {self.limits.context}] (the model's "
                               f"context length)", param=f"h2o.{name}")

    def rolls(self, body) -> bool:
        """Does this request roll its positions past the context (``--positions rolling`` and a
        policy that evicts)? A bad policy name is not ours to report here (``resolve`` does)."""
        if not self.limits.rolling:
            return False
        try:
            h2o = body.h2o
            asked = expand(h2o.recipe if h2o else None, policy=h2o.policy if h2o else None)  # its policy over the recipe's
            return make_policy(asked.get("policy") or self.eviction.policy).evicts
        except (H2OError, ValueError):
            return False

    def check_lengths(self, prompt_len: int, max_tokens: int | None, endpoint, rolls: bool = False) -> int:
        """``max_tokens`` (the endpoint's default when None) once prompt and completion fit the model;
        ``rolls``: the request's positions roll, so only the prompt limit holds."""
        where, limit = endpoint.prompt_param, self.limits.context
        if not prompt_len:
            raise APIError(400, "the prompt is empty", param=where)
        if prompt_len > self.limits.prompt:
            raise APIError(400, f"the prompt has {prompt_len} tokens; this server accepts at most "
                           f"{self.limits.prompt}", param=where, code="context_length_exceeded")
        if rolls:
            return endpoint.default_max_tokens if max_tokens is None else max_tokens
        if prompt_len >= limit:
            raise APIError(400, f"the prompt has {prompt_len} tokens; the model's context length is {limit} "
                           f"(longer prompts need --positions rolling and an evicting policy)", param=where,
                           code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = max(1, min(endpoint.default_max_tokens, limit - prompt_len))
        if max_tokens > limit:
            raise APIError(400, f"max_tokens={max_tokens} exceeds the model's context length {limit}",
                           param="max_tokens")
        if prompt_len + max_tokens > limit:
            raise APIError(400, f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the "
                           f"model's context length {limit}", param="max_tokens", code="context_length_exceeded")
        return max_tokens

    def tokenize(self, body) -> list[int]:
        """The prompt's token ids: chat messages through the chat template, a completion's text
        through the tokenizer, token ids as given (checked against the vocabulary)."""
        if isinstance(body, ChatCompletionRequest):
            if not body.messages:
                raise APIError(400, "messages must not be empty", param="messages")
            if not getattr(self.tokenizer, "chat_template", None):
                raise APIError(400, f"the model {self.model_name!r} has no chat template; use /v1/completions")
            messages = chat_messages(body)
            return self._encode("messages", lambda tok: tok.apply_chat_template(
                messages, add_generation_prompt=True, return_dict=True)["input_ids"])
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, f"only one prompt per request is supported (got {len(prompt)})", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self._encode("prompt", lambda tok: tok(prompt)["input_ids"]) if prompt else []
        if any(not 0 <= t < self.vocab for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {self.vocab})", param="prompt")
        return list(prompt)

    def cacheable_prefix(self, body, prompt_ids: list[int], policy: str) -> int | None:
        """Where the prefix store keeps a state of this prompt, and what a policy ranked by
        reconstruction ranks before the rest is read (None: nowhere, or neither applies):
        ``h2o.cache_prefix`` tokens for a completion; for a chat, every message before the last user
        message as the template renders them, when the prompt starts with exactly those tokens."""
        if self.engine.prefixes is None and not policy_class(policy).ranks_by_reconstruction:
            return None
        if isinstance(body, ChatCompletionRequest):
            with self.encoder_lock:
                return history_length(self.encoder, chat_messages(body), prompt_ids)
        given = body.h2o.cache_prefix if body.h2o else None
        if given is not None and not 0 < given < len(prompt_ids):
            raise APIError(400, f"h2o.cache_prefix={given} must be in [1, {len(prompt_ids) - 1}] (the prompt has "
                           f"{len(prompt_ids)} tokens)", param="h2o.cache_prefix")
        return given

    def _encode(self, param: str, encode) -> list[int]:
        """``encode(tokenizer)``'s ids; the tokenizer refusing the input is a 400 on ``param``."""
        try:
            with self.encoder_lock:
                return list(encode(self.encoder))
        except (TypeError, ValueError, RuntimeError) as exc:
            raise APIError(400, f"{param} cannot be tokenised: {type(exc).__name__}: {exc}", param=param) from None

    # -- answers -----------------------------------------------------------------------------------
    def model_list(self) -> dict:
        """``/v1/models``: the one model, with the server's eviction and scheduling settings."""
        e = self.engine
        settings = {**self.eviction.describe(), "kv_memory": e.options.kv_memory, "max_batch": e.options.max_batch,
                    "prefill_chunk": e.options.prefill_chunk, "schedule": e.options.schedule,
                    "step_tokens": e.options.step_tokens,
                    "max_context": self.limits.context, "max_prompt_tokens": self.limits.prompt,
                    "request_timeout": self.limits.request_timeout, "max_n": self.limits.max_n,
                    **self.sampling.describe()}
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "h2okv", "h2o": settings}]}

    def token_text(self, token: int) -> str:
        return self.engine.decode([token])

    def budget_info(self, gen: GenerationRequest) -> dict:
        return {"policy": gen.policy, "heavy": gen.heavy, "recent": gen.recent,
                "kv_slots": self.engine.reservation(gen).slots}

    def error_body(self, error: ServeError) -> dict:
        """A failed choice's error, as a streamed event (counted like an error answer)."""
        api_error = APIError.from_serve_error(error)
        self.count_error(api_error.status)
        return api_error.body()


def usage_of(dones: list[Event]) -> dict:
    prompt = dones[0].usage["prompt_tokens"]  # the choices share one prompt, counted once
    completion = sum(d.usage["completion_tokens"] for d in dones)
    cached = min(d.usage.get("prompt_tokens_details", {}).get("cached_tokens", 0) for d in dones)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}  # OpenAI's: read from the prefix store


async def collect_all(handles: list[Handle], request: Request) -> list[list[Event]]:
    """Every choice's events, its final ``"done"`` last; a client that goes away cancels them all."""
    watcher = asyncio.create_task(watch_disconnect(handles, request))
    try:
        return list(await asyncio.gather(*(collect(h) for h in handles)))
    finally:
        watcher.cancel()
        for handle in handles:
            handle.cancel()


async def collect(handle: Handle) -> list[Event]:
    events = []
    while True:
        event = await handle.next()
        if event.kind == "error":
            raise event.error
        if event.kind == "cancelled":
            raise APIError(499, "the request was cancelled")
        events.append(event)
        if event.kind == "done":
            return events


async def watch_disconnect(handles: list[Handle], request: Request) -> None:
    while not all(h.finished.is_set() for h in handles):
        if await request.is_disconnected():
            for handle in handles:
                handle.cancel()
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


def chat_messages(body) -> list[dict]:
    """A chat request's messages as the chat template takes them (``developer`` is a system turn)."""
    return [{"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in body.messages]


def budget_label(body) -> str:
    """The request's budget as asked (its ``h2o`` fields and recipe; the server's defaults are the
    same for every request): what the prefix store compares, since a fraction resolves to other
    slot counts for a longer prompt."""
    h2o = body.h2o
    asked = {"budget": h2o.budget_fields() if h2o else None, "recipe": h2o.recipe if h2o else None}
    return json.dumps(asked, sort_keys=True, default=str)
