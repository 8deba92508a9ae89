"""The request body limit, enforced before anything parses the body.

``BodyLimit`` is plain ASGI middleware in front of the app: a request whose ``Content-Length`` is
over ``max_bytes`` gets a 413 and a body without a length (chunked transfer) is read chunk by chunk
and answered 413 as soon as the count passes ``max_bytes``; nothing of such a body is kept or
parsed. What the client still sends is read and dropped first, up to ``DRAIN_BYTES`` (as nginx's
lingering close): a server that closes a socket with unread data makes the kernel reset the
connection, and the client may then lose the 413 it was sent. A body that takes more than ``read_timeout`` seconds to arrive (a client trickling
it, holding a connection and a file handle) gets a 408. Otherwise the whole body, at most
``max_bytes``, is handed to the app as one message, and the app's later ``receive()`` calls (a
disconnect) go to the client's connection as before.

The default, 4 MiB, holds the longest prompt any current model takes with room to spare: 128k
tokens are about 0.5 MB of text, 3 MB if every character is sent JSON-escaped (``\\uXXXX``), and
a prompt of token ids about 1 MB. Anything bigger is not a prompt this server could run.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from h2okv.serve.api.errors import APIError

DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_BODY_TIMEOUT_S = 30.0
DRAIN_BYTES = 64 << 20  # past this, an over-long body is cut off (the client may see a reset)


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask of a server: ``h2okv serve``'s flags of the same names
    (``create_app`` resolves the context and prompt limits against the model)."""

    max_context: int | None = None  # tokens of prompt + completion; None: the model's own limit
    max_prompt_tokens: int | None = None  # the longest prompt; None: what the context leaves
    request_timeout: float | None = None  # seconds; then a request ends with finish_reason "timeout"
    max_n: int = 8  # choices per request (each a running sequence; never more than max_batch)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S  # seconds for a request body to arrive


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES, read_timeout: float = DEFAULT_BODY_TIMEOUT_S,
                 on_refused=None):
        self.app = app
        self.max_bytes, self.read_timeout = max_bytes, read_timeout
        self.on_refused = on_refused or (lambda status: None)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._drain(receive)
            return await self._refuse(scope, receive, send, self._too_large(int(declared)))
        try:
            body, disconnected = await asyncio.wait_for(self._read(receive), self.read_timeout)
        except BodyTooLarge:
            await self._drain(receive)
            return await self._refuse(scope, receive, send, self._too_large(None))
        except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11 on
            error = APIError(408, f"the request body did not arrive within {self.read_timeout:g} s",
                             code="request_timeout")
            return await self._refuse(scope, receive, send, error)
        if disconnected:
            return None  # the client left before its body was complete: no one to answer
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _read(self, receive) -> tuple[bytes, bool]:
        """The whole body (raises ``BodyTooLarge`` past the limit), and whether the client left."""
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", True
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise BodyTooLarge
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts), False

    async def _drain(self, receive) -> None:
        """Read and drop the rest of a refused body (bounded in bytes and time)."""
        async def drop():
            dropped = 0
            while dropped <= DRAIN_BYTES:
                message = await receive()
                dropped += len(message.get("body", b""))
                if message["type"] == "http.disconnect" or not message.get("more_body", False):
                    return

        try:
            await asyncio.wait_for(drop(), self.read_timeout)
        except asyncio.TimeoutError:
            pass

    def _too_large(self, declared: int | None) -> APIError:
        size = f"{declared} bytes" if declared is not None else "more than that"
        return APIError(413, f"the request body is {size}; this server accepts at most {self.max_bytes} bytes "
                        f"(--max-body-bytes)", code="request_too_large")

    async def _refuse(self, scope, receive, send, error: APIError) -> None:
        self.on_refused(error.status)
        # the client may still be sending: close the connection rather than read the rest
        response = JSONResponse(error.body(), status_code=error.status, headers={"Connection": "close"})
        await response(scope, receive, send)
