"""``h2okv eval <kind>``: one module here per evaluation, each with ``register(kinds)`` (its
options) and a run function that imports and calls the library in ``h2okv.eval``."""

from __future__ import annotations

import importlib
import pkgutil

from h2okv.cli.args import examples, sort_subcommands

EXAMPLES = examples(
    "h2okv eval ppl --budgets 0.05,0.1,0.2,0.5",
    "h2okv eval retrieval --recipe bounded --budgets 0.2",
)


def register(sub) -> None:
    p = sub.add_parser("eval", help="accuracy evaluations (perplexity, tasks, summarization, retrieval, reasoning)",
                       epilog=EXAMPLES)
    kinds = p.add_subparsers(dest="eval_kind", required=True, parser_class=type(p))
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):  # a kind's helpers, not a kind (as in cli/main.py)
            continue
        importlib.import_module(f"{__name__}.{info.name}").register(kinds)
    sort_subcommands(kinds)  # by command name (modules are named otherwise: speed is tasks-speed)
