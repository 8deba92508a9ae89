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
from h2okv.serve.api.limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, BodyLimit
from h2okv.serve.api.metrics import ServeMetrics
from h2okv.serve.api.sampling_defaults import SamplingDefaults
from h2okv.serve.api.schemas import ChatCompletionRequest, CompletionRequest
from h2okv.serve.api.serving import Limits, Serving, model_context_limit
from h2okv.serve.engine import Engine
from h2okv.serve.eviction import EvictionDefaults


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
    max_n: int = 8,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S,
    positions: str = "true",
    prefix_memory: int = 0,
    sampling: SamplingDefaults | None = None,
) -> FastAPI:
    """An app serving ``model``/``tokenizer`` (injectable: tests pass tiny models). The engine thread
    starts and stops with the app's lifespan; ``app.state.engine`` and ``app.state.metrics`` are
    exposed for in-process callers (and ``serve.api.server`` drains the engine on SIGTERM).
    ``executor``: the engine's executor, when not a plain ``Executor`` of ``model`` (``serve --tp``:
    ``tp.Leader``). ``max_n``: the most choices one request may ask for (each is a running sequence
    of the batch, as vLLM counts them; never more than ``max_batch``). ``positions="rolling"``: evicting
    requests roll their positions (``H2OCache(positions=...)``), so ``max_tokens`` and, read with
    eviction, prompts may exceed the context length (``--max-prompt-tokens``). ``sampling``: the
    temperature / top_p of requests that give none (default: the model's generation config, else
    OpenAI's 1 and 1; ``h2okv serve`` adds the built-in models' own)."""
    eviction = eviction or EvictionDefaults()
    eviction.validate()
    if request_timeout is not None and not request_timeout > 0:
        raise ValueError("request_timeout must be > 0")
    engine = Engine(model, tokenizer, kv_memory=kv_memory, max_batch=max_batch, max_queue=max_queue,
                    prefill_chunk=prefill_chunk, schedule=schedule, step_tokens=step_tokens, executor=executor,
                    prefill=eviction.prefill, positions=positions, prefix_memory=prefix_memory,
                    cache_options=eviction.cache_options())
    metrics = ServeMetrics(engine)
    engine.observer = metrics
    context = max_context or model_context_limit(model)
    rolling = parse_positions(positions) is not None
    if rolling:
        RopeRotation.from_model(model)  # a model that cannot roll fails at start, not per request
    prompt_limit = max_prompt_tokens or context - 1 if rolling else min(context - 1, max_prompt_tokens or context)
    limits = Limits(context, prompt_limit, request_timeout, min(max_n, max_batch), rolling)

    def count_error(status: int) -> None:
        metrics.http_errors.labels(str(status)).inc()

    sampling = sampling or SamplingDefaults.resolve(generation_config=getattr(model, "generation_config", None))
    serving = Serving(engine, tokenizer, model_name, eviction, limits, count_error, sampling)

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
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, read_timeout=body_timeout, on_refused=count_error)
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
