"""``h2okv eval <kind>``: one module here per evaluation, each with ``register(kinds)`` (its
options) and a run function that imports and calls the library in ``h2okv.eval``."""

from __future__ import annotations

import importlib
import pkgutil


def register(sub) -> None:
    p = sub.add_parser("eval", help="accuracy evaluations (perplexity, tasks, summarization, retrieval, reasoning)")
    kinds = p.add_subparsers(dest="eval_kind", required=True, parser_class=type(p))
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):  # a kind's helpers, not a kind (as in cli/main.py)
            continue
        importlib.import_module(f"{__name__}.{info.name}").register(kinds)
