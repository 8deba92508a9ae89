"""The optional extras of the distribution and the one-line error a command gives without its extra.

The core install (torch, transformers and what loading a model needs) runs ``H2OCache``, the
policies, ``load_model`` and ``generate``. The HTTP server and the evaluations import more; a
command that needs them says which extra to install instead of ending in an import traceback.
"""

from __future__ import annotations

import importlib.util
from contextlib import contextmanager

from h2okv.errors import H2OError, print_error

# top-level modules our code imports from each extra (pyproject.toml's [project.optional-dependencies])
MODULES: dict[str, tuple[str, ...]] = {
    "serve": ("fastapi", "uvicorn", "prometheus_client"),
    "eval": ("lm_eval", "rouge_score", "matplotlib", "psutil", "httpx"),
}

# the extras each `h2okv` subcommand needs, checked before any (slow) model load; a command not
# listed here that still reaches an extra's module gets the same error from `needed_by`
COMMANDS: dict[str, tuple[str, ...]] = {
    "serve": ("serve",),
    "serve-bench": ("serve", "eval"),  # the server under the load generator (httpx, lm-eval's stderr)
    "eval": ("eval",),
    "bench": ("eval",),  # RSS via psutil, plots
    "analyze": ("eval",),  # plots
}


class MissingExtra(H2OError):
    """A command needs an extra that is not installed."""


def missing(what: str, extra: str) -> MissingExtra:
    return MissingExtra(f"{what} needs the {extra} extra: pip install 'h2okv[{extra}]'")


def extra_of(module: str | None) -> str | None:
    """The extra that provides ``module`` (a dotted name), or None for a module of no extra."""
    top = (module or "").partition(".")[0]
    return next((extra for extra, modules in MODULES.items() if top in modules), None)


@contextmanager
def needed_by(what: str, *extras: str):
    """Run the block for ``what`` (a command's name), which needs ``extras``: raise ``MissingExtra``
    up front if one of them is not installed (``find_spec`` imports nothing), and for an import of
    any extra's module inside the block."""
    for extra in extras:
        if any(importlib.util.find_spec(module) is None for module in MODULES[extra]):
            raise missing(what, extra)
    try:
        yield
    except ModuleNotFoundError as exc:
        extra = extra_of(exc.name)
        if extra is None:  # not an extra's module: a broken install or a bug, keep the traceback
            raise
        raise missing(what, extra) from exc


def lm_eval_main() -> int:
    """``h2okv-lm-eval``: lm-eval's command line with the ``h2okv`` model type registered. A wrapper,
    because ``h2okv.eval.lm_eval_model`` imports lm-eval as it loads."""
    try:
        with needed_by("h2okv-lm-eval", "eval"):
            from h2okv.eval.lm_eval_model import main
    except MissingExtra as exc:
        print_error(exc)
        return 2
    return main()
