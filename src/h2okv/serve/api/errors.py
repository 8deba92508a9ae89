"""Errors over HTTP, in OpenAI's format (``{"error": {"message", "type", "param", "code"}}``): the
``APIError`` the HTTP layer raises, the status each runtime ``ErrorKind`` maps to, and the app's
exception handlers (every error answer is counted in ``h2okv_http_errors_total``)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from h2okv.serve.errors import ErrorKind, ServeError

log = logging.getLogger("h2okv.serve")

# the runtime's error kinds as (HTTP status, OpenAI error type)
STATUS_OF_KIND = {
    ErrorKind.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorKind.OVERLOADED: (429, "rate_limit_error"),
    ErrorKind.UNAVAILABLE: (503, "server_error"),
    ErrorKind.INTERNAL: (500, "server_error"),
}


class APIError(Exception):
    """An error the client caused (4xx) or one request's failure (5xx), in OpenAI's format."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def from_serve_error(cls, error: ServeError) -> APIError:
        status, type_ = STATUS_OF_KIND[error.kind]
        return cls(status, error.message, type=type_, param=error.param, code=error.code)


def install_error_handlers(app: FastAPI, count_error) -> None:
    """Every error leaves as OpenAI's ``{"error": {...}}``; ``count_error(status)`` counts it."""

    def error_response(err: APIError) -> JSONResponse:
        count_error(err.status)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(ServeError)
    async def on_serve_error(request: Request, exc: ServeError):
        return error_response(APIError.from_serve_error(exc))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return error_response(validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        log.exception("unexpected error")
        return error_response(APIError(500, f"internal error: {type(exc).__name__}", type="server_error"))


def validation_error(errors) -> APIError:
    """The 400 for pydantic's errors: the most telling one (a failed check of ours, such as a lone
    surrogate, over the type mismatches a union collects from its other members), with the field
    path as ``param`` (union members' type tags such as ``list[int]`` left out)."""
    errors = list(errors) or [{"type": "", "loc": (), "msg": "invalid request"}]
    first = next((e for e in errors if e["type"] == "value_error"), errors[0])
    if first["type"] == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON: {detail}".rstrip(": "))
    param = ".".join(str(p) for p in first["loc"] if p != "body" and not _type_tag(p)) or None
    message = f"{param}: {first['msg']}" if param else first["msg"]
    return APIError(400, message, param=param)


def _type_tag(part) -> bool:
    """A union member's tag in an error location (``str``, ``list[int]``, ``function-after[...]``)."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "list", "dict"))
