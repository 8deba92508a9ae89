"""The one exception type users see for bad settings or unsupported models.

The CLI and the server turn it into a one-line message (exit code 2 / HTTP 4xx); a traceback is
reserved for bugs.

One errors module per layer: this one (the library and the CLI), ``serve/errors.py`` (the
engine's ``ServeError``, by kind, with no HTTP in it) and ``serve/api/errors.py`` (HTTP's
``APIError`` and the app's handlers, which need fastapi).
"""


class H2OError(ValueError):
    """Bad eviction settings, an unsupported model, or other invalid user input."""


def print_error(message) -> None:
    """The one-line form every command gives a user error: ``h2okv: error: <message>`` on stderr."""
    import sys

    print(f"h2okv: error: {message}", file=sys.stderr)


def first_line(exc: BaseException) -> str:
    """An exception's message cut to its first line, for our one-line errors: messages from
    transformers, huggingface_hub and datasets run to several lines, and a KeyError's comes quoted.
    The type's name when there is no message."""
    text = str(exc).strip().strip('"')
    return text.splitlines()[0] if text else type(exc).__name__
