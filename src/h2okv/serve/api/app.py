"""The FastAPI application: OpenAI-compatible routes in front of one ``Engine``.

``create_app`` wires the engine, the metrics and the request path together; ``add_routes``
declares the routes; nothing else lives here. A completion or chat request goes through
``serving.py`` (validation, tokenisation, the fan-out for ``n``, the answer); errors leave in
OpenAI's format (``errors.py``); an API key guards every route but ``/health`` (``auth.py``);
request bodies are bounded in size and read time before anything parses them (``limits.py``).
"""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import FastAPI, Request
from fastapi.responses import Response

from h2okv.core.positions import parse_positions
from h2okv.core.rope import RopeRotation
from h2okv.serve.api.auth import RequireAPIKey
from h2okv.serve.api.errors import APIError, install_error_handlers
from h2okv.serve.api.limits import BodyLimit, ServerLimits
from h2okv.serve.api.metrics import ServeMetrics
from h2okv.serve.api.sampling_defaults import SamplingDefaults
from h2okv.serve.api.schemas import ChatCompletionRequest, CompletionRequest
from h2okv.serve.api.serving import Limits, Serving, model_context_limit
from h2okv.serve.engine import Engine, EngineOptions
from h2okv.serve.eviction import EvictionDefaults


def create_app(
    model,
    tokenizer,
    *,
    model_name: str = "smollm2",
    eviction: EvictionDefaults | None = None,
    options: EngineOptions | None = None,
    limits: ServerLimits | None = None,
    api_key: str | None = None,
    executor=None,
    sampling: SamplingDefaults | None = None,
) -> FastAPI:
    """An app serving ``model``/``tokenizer`` (injectable: tests pass tiny models). The engine thread
    starts and stops with the app's lifespan; ``app.state.engine`` and ``app.state.metrics`` are
    exposed for in-process callers (and ``serve.api.server`` drains the engine on SIGTERM).
    ``options``: how the engine batches and schedules (``EngineOptions``); its prefill mode and cache
    keywords are ``eviction``'s. ``limits``: what a request may ask (``ServerLimits``; ``max_n``, the
    most choices one request may ask for, is never more than ``max_batch``: each is a running
    sequence of the batch, as vLLM counts them). ``executor``: the engine's executor, when not a
    plain ``Executor`` of ``model`` (``serve --tp``: ``tp.Leader``). ``options.positions="rolling"``:
    evicting requests roll their positions (``H2OCache(positions=...)``), so ``max_tokens`` and, read
    with eviction, prompts may exceed the context length (``max_prompt_tokens``). ``sampling``: the
    temperature / top_p of requests that give none (default: the model's generation config, else
    OpenAI's 1 and 1; ``h2okv serve`` adds the built-in models' own)."""
    eviction = eviction or EvictionDefaults()  # checked when built (CacheSettings)
    options, limits = options or EngineOptions(), limits or ServerLimits()
    if limits.request_timeout is not None and not limits.request_timeout > 0:
        raise ValueError("request_timeout must be > 0")
    engine = Engine(model, tokenizer, options, prefill=eviction.prefill, cache_options=eviction.cache_options(),
                    executor=executor)
    metrics = ServeMetrics(engine)
    engine.observer = metrics
    context = limits.max_context or model_context_limit(model)
    rolling = parse_positions(options.positions) is not None
    if rolling:
        RopeRotation.from_model(model)  # a model that cannot roll fails at start, not per request
    prompts = limits.max_prompt_tokens
    prompt_limit = prompts or context - 1 if rolling else min(context - 1, prompts or context)
    request_limits = Limits(context, prompt_limit, limits.request_timeout, min(limits.max_n, options.max_batch),
                            rolling)

    def count_error(status: int) -> None:
        metrics.http_errors.labels(str(status)).inc()

    sampling = sampling or SamplingDefaults.resolve(generation_config=getattr(model, "generation_config", None))
    serving = Serving(engine, tokenizer, model_name, eviction, request_limits, count_error, sampling)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop)
            serving.workers.shutdown(wait=False)

    app = FastAPI(title="h2okv", lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics
    install_error_handlers(app, count_error)
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes, read_timeout=limits.body_timeout,
                       on_refused=count_error)
    if api_key:  # added last, so it runs first: no body is read for a request without the key
        app.add_middleware(RequireAPIKey, api_key=api_key, on_refused=lambda: count_error(401))

    add_routes(app, engine, metrics, serving)
    return app


def add_routes(app: FastAPI, engine: Engine, metrics: ServeMetrics, serving: Serving) -> None:
    """The routes: health, Prometheus metrics, the model list and the two generation endpoints."""

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
        return serving.model_list()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await serving.respond(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await serving.respond(body, request)
