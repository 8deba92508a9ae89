"""A setting's name in the caller's vocabulary: one message, three ways to say the names in it.

The same budget check runs for the library, the command line and the server, but a user of each
knows a setting by a different name: ``budget=`` in Python, ``--budget`` on the command line,
``h2o.budget`` in a request. A check raises ``SettingError`` with the names as fields of its
message (``"{budget} must be ..."``, ``"{recipe:stream}"`` with a value), and each entry point
renders it in its own words (``error.said(as_flag)``); ``str(error)`` is the library's (``as_keyword``).

Torch-free: the command line imports it to print an error.
"""

from __future__ import annotations

import string
from functools import partial

from h2okv.errors import H2OError


def as_keyword(name: str, value: str = "") -> str:
    """Python: ``budget=``, ``recipe='stream'``, ``max_new_tokens=128``."""
    if not value:
        return f"{name}="
    return f"{name}={value}" if value.replace(".", "", 1).isdigit() else f"{name}={value!r}"


def as_flag(name: str, value: str = "") -> str:
    """The command line: ``--budget``, ``--recipe stream``."""
    flag = "--" + name.replace("_", "-")
    return f"{flag} {value}" if value else flag


def as_field(name: str, value: str = "") -> str:
    """A request body: ``h2o.budget``, ``h2o.recipe="stream"``."""
    return f'h2o.{name}="{value}"' if value else f"h2o.{name}"


class _Name:
    """A setting's name inside a message; ``{recipe:stream}`` hands ``stream`` to the vocabulary."""

    def __init__(self, name: str, vocabulary):
        self.name, self.vocabulary = name, vocabulary

    def __format__(self, value: str) -> str:
        return self.vocabulary(self.name, value)


class SettingError(H2OError):
    """A bad setting, its message naming settings as fields: ``SettingError("{budget} must be
    >= {least}", least=2)``; the fields not given as ``values`` are settings (``names``)."""

    def __init__(self, template: str, **values):
        self.template, self.values = template, values
        fields = (field for _, field, _, _ in string.Formatter().parse(template) if field)
        self.names = tuple(dict.fromkeys(f for f in fields if f not in values))
        super().__init__(self.said(as_keyword))

    def said(self, vocabulary) -> str:
        """The message with each setting named by ``vocabulary`` (``as_keyword``, ``as_flag``, ``as_field``)."""
        return self.template.format(**{name: _Name(name, vocabulary) for name in self.names}, **self.values)

    def __reduce__(self):  # pickled across processes (parallel runs) with its template, not its text
        return partial(SettingError, **self.values), (self.template,)


def said(error: BaseException, vocabulary) -> str:
    """Any error's one-line message, a ``SettingError``'s in ``vocabulary``."""
    return error.said(vocabulary) if isinstance(error, SettingError) else str(error)
