"""The FastAPI application: OpenAI-compatible routes in front of one ``Engine``.

Requests are validated and tokenised here (so bad input never reaches the engine thread), turned
into ``n`` ``GenerationRequest``s (one per choice) with the eviction budget resolved to absolute
slots, and submitted. Responses are JSON or server-sent events in OpenAI's chunk format.

With an API key every route but ``/health`` (liveness probes carry no secrets) needs
``Authorization: Bearer <key>``, ``/metrics`` included: Prometheus sends the key with its
``authorization`` scrape setting.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from h2okv.core import BudgetSpec
from h2okv.errors import H2OError
from h2okv.policies import make_policy
from h2okv.serve.engine import Engine, Event, GenerationRequest, Handle
from h2okv.serve.formatting import CompletionLogprobs, chat_logprobs, merge_completion_logprobs
from h2okv.serve.metrics import ServeMetrics
from h2okv.serve.schemas import APIError, ChatCompletionRequest, CompletionRequest, H2OSettings

log = logging.getLogger("h2okv.serve")

CHAT_DEFAULT_MAX_TOKENS = 256  # when a chat request gives none (completions default to 16, as OpenAI's)


@dataclass(frozen=True)
class EvictionDefaults:
    """The server's eviction settings (``--policy``, ``--heavy``...), which a request may override."""

    policy: str = "h2o"
    heavy: int | None = None
    recent: int | None = None
    heavy_ratio: float | None = None
    recent_ratio: float | None = None

    def describe(self) -> dict:
        return {"policy": self.policy, **self.budget()}

    def budget(self) -> dict:
        return {"heavy": self.heavy, "recent": self.recent, "heavy_ratio": self.heavy_ratio,
                "recent_ratio": self.recent_ratio}

    def validate(self) -> None:
        BudgetSpec.build(make_policy(self.policy), **self.budget())

    def resolve(self, override: H2OSettings | None, prompt_len: int) -> tuple[str, int | None, int | None]:
        """(policy, heavy, recent) slots for one request; raises ``H2OError`` for bad settings."""
        name = override.policy if override is not None and override.policy is not None else self.policy
        policy = make_policy(name)
        if override is not None and override.budget_given():
            budget = override.model_dump(exclude={"policy"})
        elif policy.evicts and make_policy(self.policy).evicts:
            budget = self.budget()
        else:  # switching to/from "full": the server's budget does not carry over
            budget = dict.fromkeys(("heavy", "recent", "heavy_ratio", "recent_ratio"))
        spec = BudgetSpec.build(policy, **budget)
        if not policy.evicts:
            return policy.name, None, None
        heavy, recent = spec.resolve(prompt_len)
        return policy.name, heavy, recent


class RequireAPIKey:
    """ASGI middleware: every HTTP route but ``/health`` needs ``Authorization: Bearer <key>``.
    (Plain ASGI rather than ``@app.middleware``: it must not wrap streaming bodies or disconnects.)"""

    def __init__(self, app, api_key: str, on_refused=None):
        self.app = app
        self.expected = api_key.encode()
        self.on_refused = on_refused or (lambda: None)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected):
            return await self.app(scope, receive, send)
        self.on_refused()
        given = "a wrong API key" if token.strip() else "no API key"
        error = APIError(401, f"this server needs an API key (Authorization: Bearer ...); the request gave {given}",
                         code="invalid_api_key")
        await JSONResponse(error.body(), status_code=401)(scope, receive, send)


def model_context_limit(model) -> int:
    config = model.config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 1 << 30


def create_app(
    model,
    tokenizer,
    *,
    model_name: str = "smollm2",
    eviction: EvictionDefaults | None = None,
    kv_memory: int | None = None,
    max_batch: int = 32,
    max_queue: int = 256,
    prefill_chunk: int = 128,
    max_context: int | None = None,
    api_key: str | None = None,
    request_timeout: float | None = None,
    max_prompt_tokens: int | None = None,
    schedule: str = "budget",
    step_tokens: int = 512,
    executor=None,
) -> FastAPI:
    """An app serving ``model``/``tokenizer`` (injectable: tests pass tiny models). The engine thread
    starts and stops with the app's lifespan; ``app.state.engine`` and ``app.state.metrics`` are
    exposed for in-process callers (and ``serve.server`` drains the engine on SIGTERM). ``executor``:
    the engine's executor, when not a plain ``Executor`` of ``model`` (``serve --tp``: ``tp.Leader``)."""
    eviction = eviction or EvictionDefaults()
    eviction.validate()
    if request_timeout is not None and not request_timeout > 0:
        raise ValueError("request_timeout must be > 0")
    engine = Engine(model, tokenizer, kv_memory=kv_memory, max_batch=max_batch, max_queue=max_queue,
                    prefill_chunk=prefill_chunk, schedule=schedule, step_tokens=step_tokens, executor=executor)
    metrics = ServeMetrics(engine)
    engine.observer = metrics
    limit = max_context or model_context_limit(model)
    prompt_limit = min(limit - 1, max_prompt_tokens or limit)
    vocab = len(tokenizer)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop)

    app = FastAPI(title="h2okv", lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics

    # -- errors: always OpenAI's {"error": {...}} ----------------------------------------------
    def error_response(err: APIError) -> JSONResponse:
        metrics.http_errors.labels(str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"type": "", "loc": (), "msg": "invalid request"}
        if first["type"] == "json_invalid":
            detail = (first.get("ctx") or {}).get("error", "")
            return error_response(APIError(400, f"the request body is not valid JSON: {detail}".rstrip(": ")))
        param = ".".join(str(p) for p in first["loc"] if p != "body") or None
        message = f"{param}: {first['msg']}" if param else first["msg"]
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        log.exception("unexpected error")
        return error_response(APIError(500, f"internal error: {type(exc).__name__}", type="server_error"))

    if api_key:
        app.add_middleware(RequireAPIKey, api_key=api_key, on_refused=lambda: metrics.http_errors.labels("401").inc())

    # -- routes ----------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not engine.alive:
            raise APIError(503, "the engine is not running", type="server_error")
        if engine.stats.draining:
            raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        settings = {**eviction.describe(), "kv_memory": kv_memory, "max_batch": max_batch,
                    "prefill_chunk": prefill_chunk, "schedule": schedule, "step_tokens": step_tokens,
                    "max_context": limit, "max_prompt_tokens": prompt_limit, "request_timeout": request_timeout}
        return {"object": "list",
                "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "h2okv", "h2o": settings}]}

    def prepare(body, prompt_ids: list[int], max_tokens: int | None, default_max: int) -> list[GenerationRequest]:
        """The ``n`` generation requests of one API call (seeded choices get seeds seed, seed+1, ...)."""
        where = "prompt" if isinstance(body, CompletionRequest) else "messages"
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param=where)
        if len(prompt_ids) > prompt_limit:
            raise APIError(400, f"the prompt has {len(prompt_ids)} tokens; this server accepts at most {prompt_limit}",
                           param=where, code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = max(1, min(default_max, limit - len(prompt_ids)))
        if max_tokens > limit:
            raise APIError(400, f"max_tokens={max_tokens} exceeds the model's context length {limit}",
                           param="max_tokens")
        if len(prompt_ids) + max_tokens > limit:
            raise APIError(400, f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                           f"model's context length {limit}", param="max_tokens", code="context_length_exceeded")
        try:
            policy, heavy, recent = eviction.resolve(body.h2o, len(prompt_ids))
        except H2OError as exc:
            raise APIError(400, f"h2o: {exc}", param="h2o") from None
        stops = body.stop_list()
        return [GenerationRequest(
            prompt_ids=prompt_ids, max_tokens=max_tokens, policy=policy, heavy=heavy, recent=recent,
            temperature=body.temperature, top_p=body.top_p, stops=stops,
            seed=None if body.seed is None else (body.seed + i) % (1 << 63), ignore_eos=body.ignore_eos,
            top_logprobs=body.top_logprobs_wanted(), timeout=request_timeout,
        ) for i in range(body.n)]

    def check_model(body) -> None:
        if body.model != model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        body.check_supported()

    def encode_prompt(prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, f"only one prompt per request is supported (got {len(prompt)})", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            with engine.tokenizer_lock:
                return list(tokenizer(prompt)["input_ids"]) if prompt else []
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        return list(prompt)

    def encode_chat(body: ChatCompletionRequest) -> list[int]:
        if not body.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, f"the model {model_name!r} has no chat template; use /v1/completions")
        messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text()}
                    for m in body.messages]
        with engine.tokenizer_lock:
            enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
        return list(enc["input_ids"])

    def token_text(token: int) -> str:
        return engine.decode([token])

    def budget_info(gen: GenerationRequest) -> dict:
        return {"policy": gen.policy, "heavy": gen.heavy, "recent": gen.recent,
                "kv_slots": engine.reservation(gen).slots}

    def usage_of(dones: list[Event]) -> dict:
        prompt = dones[0].usage["prompt_tokens"]  # the choices share one prompt, counted once
        completion = sum(d.usage["completion_tokens"] for d in dones)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body)
        gens = prepare(body, encode_prompt(body.prompt), body.max_tokens, 16)
        handles = engine.submit_many(gens, asyncio.get_running_loop())
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        formatters = [CompletionLogprobs(token_text) for _ in handles]

        def chunk(index: int, text: str, finish: str | None, logprobs) -> dict:
            return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

        def stream_chunk(index: int, event: Event, first: bool, finish: str | None) -> dict | None:
            lp = None if event.logprobs is None else formatters[index].format(event.logprobs)
            if not (event.text or first or finish or (lp and lp["tokens"])):
                return None
            return chunk(index, event.text, finish, lp)

        if body.stream:
            return sse_response(handles, stream_chunk, body)
        results = await collect_all(handles, request)
        choices = []
        for i, (events, done) in enumerate(results):
            lp = None
            if gens[i].top_logprobs is not None:
                lp = merge_completion_logprobs([formatters[i].format(e.logprobs) for e in events])
            choices.append({"index": i, "text": "".join(e.text for e in events), "logprobs": lp,
                            "finish_reason": done.finish_reason})
        return {"id": rid, "object": "text_completion", "created": created, "model": model_name, "choices": choices,
                "usage": usage_of([done for _, done in results]), "h2o": budget_info(gens[0])}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        gens = prepare(body, encode_chat(body), max_tokens, CHAT_DEFAULT_MAX_TOKENS)
        handles = engine.submit_many(gens, asyncio.get_running_loop())
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def stream_chunk(index: int, event: Event, first: bool, finish: str | None) -> dict | None:
            lp = None if event.logprobs is None else chat_logprobs(event.logprobs, token_text)
            if not (event.text or first or finish or (lp and lp["content"])):
                return None
            delta = {"role": "assistant", "content": event.text} if first else (
                {"content": event.text} if event.text else {})
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                    "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

        if body.stream:
            return sse_response(handles, stream_chunk, body)
        results = await collect_all(handles, request)
        choices = []
        for i, (events, done) in enumerate(results):
            lp = None
            if gens[i].top_logprobs is not None:
                lp = chat_logprobs([e for ev in events for e in ev.logprobs], token_text)
            choices.append({"index": i, "message": {"role": "assistant", "content": "".join(e.text for e in events)},
                            "logprobs": lp, "finish_reason": done.finish_reason})
        return {"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": choices, "usage": usage_of([done for _, done in results]), "h2o": budget_info(gens[0])}

    async def collect_all(handles: list[Handle], request: Request) -> list[tuple[list[Event], Event]]:
        """Wait for every choice; a client that goes away cancels them all."""
        watcher = asyncio.create_task(watch_disconnect(handles, request))
        try:
            return list(await asyncio.gather(*(collect(h) for h in handles)))
        finally:
            watcher.cancel()
            for handle in handles:
                handle.cancel()

    async def collect(handle: Handle) -> tuple[list[Event], Event]:
        events = []
        while True:
            event = await handle.next()
            if event.kind == "error":
                raise event.error
            if event.kind == "cancelled":
                raise APIError(499, "the request was cancelled")
            events.append(event)
            if event.kind == "done":
                return events, event

    async def watch_disconnect(handles: list[Handle], request: Request) -> None:
        while not all(h.finished.is_set() for h in handles):
            if await request.is_disconnected():
                for handle in handles:
                    handle.cancel()
                return
            await asyncio.sleep(0.25)

    def sse_response(handles: list[Handle], make_chunk, body) -> StreamingResponse:
        """Server-sent events of all choices, interleaved as their tokens come; each choice ends with
        its ``finish_reason`` chunk, then (``include_usage``) one usage chunk, then ``[DONE]``."""
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def data(obj) -> str:
            if include_usage and "choices" in obj and "usage" not in obj:
                obj["usage"] = None
            return f"data: {json.dumps(obj)}\n\n"

        async def merged() -> AsyncIterator[tuple[int, Event]]:
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(index: int, handle: Handle) -> None:
                while True:
                    event = await handle.next()
                    await queue.put((index, event))
                    if event.final:
                        return

            pumps = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
            try:  # ends: every handle ends with one final event, which ends its pump
                while not (all(p.done() for p in pumps) and queue.empty()):
                    yield await queue.get()
            finally:
                for p in pumps:
                    p.cancel()

        async def events() -> AsyncIterator[str]:
            first = [True] * len(handles)
            dones: list[Event] = []
            try:
                async for index, event in merged():
                    if event.kind == "error":
                        metrics.http_errors.labels(str(event.error.status)).inc()
                        yield data(event.error.body())
                        return
                    if event.kind == "cancelled":
                        return
                    if event.kind == "done":
                        # the last text (with its logprobs), then the finish_reason on its own chunk
                        piece = make_chunk(index, event, first[index], None)
                        if piece is not None:
                            yield data(piece)
                        first[index] = False
                        yield data(make_chunk(index, Event("text"), False, event.finish_reason))
                        dones.append(event)
                        continue
                    piece = make_chunk(index, event, first[index], None)
                    if piece is not None:
                        yield data(piece)
                        first[index] = False
                if include_usage and dones:
                    last = make_chunk(0, Event("text"), False, "stop")
                    last["choices"], last["usage"] = [], usage_of(dones)
                    yield data(last)
                yield "data: [DONE]\n\n"
            finally:  # normal end, client gone (generator closed or cancelled): free the slots
                for handle in handles:
                    handle.cancel()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app
