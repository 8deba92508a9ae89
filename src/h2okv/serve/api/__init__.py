"""The HTTP layer of ``h2okv serve``: an OpenAI-compatible API (FastAPI) in front of one ``Engine``.

``app.py`` (routes), ``serving.py`` (the request path both endpoints share), ``sse.py`` (streamed
answers), ``schemas.py`` (request bodies), ``formatting.py`` (logprobs formats), ``errors.py``
(OpenAI's error format; runtime error kinds -> status codes), ``auth.py`` (API key), ``metrics.py``
(Prometheus), ``server.py`` (uvicorn, SIGTERM drain). Nothing outside this package imports FastAPI.
"""
