"""API keys: with one, every route but ``/health`` (liveness probes carry no secrets) needs
``Authorization: Bearer <key>``, ``/metrics`` included (Prometheus sends the key with its
``authorization`` scrape setting)."""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from h2okv.serve.api.errors import APIError


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
        # more than one Authorization header is refused: which one counts would depend on the
        # framework (last-wins), and a proxy in front may have checked another than the one we read
        headers = [value for name, value in scope["headers"] if name.lower() == b"authorization"]
        scheme, _, token = (headers[0] if len(headers) == 1 else b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected):
            return await self.app(scope, receive, send)
        self.on_refused()
        given = ("several Authorization headers" if len(headers) > 1 else
                 "a wrong API key" if token.strip() else "no API key")
        error = APIError(401, f"this server needs an API key (Authorization: Bearer ...); the request gave {given}",
                         code="invalid_api_key")
        await JSONResponse(error.body(), status_code=401)(scope, receive, send)
