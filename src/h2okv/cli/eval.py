"""``h2okv eval <kind>``: each evaluation registers itself from ``h2okv.eval``."""

from __future__ import annotations

import importlib
import pkgutil


def register(sub) -> None:
    from h2okv import eval as eval_pkg

    p = sub.add_parser("eval", help="accuracy evaluations (perplexity, tasks, summarization, retrieval)")
    kinds = p.add_subparsers(dest="eval_kind", required=True, parser_class=type(p))
    for info in sorted(pkgutil.iter_modules(eval_pkg.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{eval_pkg.__name__}.{info.name}")
        if hasattr(module, "register_eval"):
            module.register_eval(kinds)
