"""The runtime's errors, by kind: what went wrong, not which HTTP status says so.

The engine raises (``submit``) or reports (an ``Event`` of kind ``"error"``) a ``ServeError``; the
HTTP layer (``api/errors.py``) maps each kind to a status code and OpenAI's error type. Keeping
HTTP out of the runtime lets the engine be driven without a server (tests, ``serve-bench`` probes).
"""

from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    INVALID_REQUEST = "invalid_request"  # the request can never be served as given
    OVERLOADED = "overloaded"  # try again later: the waiting queue is full
    UNAVAILABLE = "unavailable"  # the engine is not running or is shutting down
    INTERNAL = "internal"  # this request failed on the engine's side


class ServeError(Exception):
    """One request's error. ``param``: the request field at fault; ``code``: a machine-readable
    reason (OpenAI's ``error.code``)."""

    def __init__(self, kind: ErrorKind, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.kind, self.message, self.param, self.code = kind, message, param, code
