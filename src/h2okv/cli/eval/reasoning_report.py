"""``h2okv eval reasoning-report``: ``eval reasoning`` pieces merged into one table and one plot
(``h2okv.eval.reasoning_report``)."""

from __future__ import annotations

from h2okv.cli.args import examples
from h2okv.errors import H2OError

EXAMPLES = examples(
    "h2okv eval reasoning-report gsm8k-*.json --plot accuracy.png --markdown",
)


def register(kinds) -> None:
    p = kinds.add_parser("reasoning-report", help="merge `eval reasoning` JSON pieces into one table and plot", epilog=EXAMPLES)
    p.add_argument("pieces", nargs="+", help="JSON files written by `h2okv eval reasoning --json`")
    p.add_argument("--json", default=None, help="write the merged summaries here")
    p.add_argument("--plot", default=None, help="accuracy vs budget PNG (full as a horizontal band)")
    p.add_argument("--x", choices=("budget", "kv", "kv16"), default="budget",
                   help="the plot's x axis: the budget asked (default), the mean KV MiB held at the end of "
                        "the answers (budgets in slots, fractions and protected prompts on one axis, full as a point), "
                        "or kv16: that KV as a share of a full 16-bit cache (quantized and float slots on one axis)")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument("--common", action="store_true",
                   help="keep only the problems every (policy, budget) ran, so pieces of different lengths are "
                        "compared on the same problems (speeds still count every batch)")
    p.set_defaults(func=run)


def run(args) -> int:
    from h2okv.eval.output import check_output_paths, write_json
    from h2okv.eval.reasoning_report import (
        common_problems,
        markdown_table,
        merge,
        plot_accuracy,
        summarize,
        summary_table,
    )

    check_output_paths(args.json, args.plot)
    rows, batches = merge(args.pieces)
    if not rows:
        raise H2OError("the pieces hold no graded problems")
    if args.common:
        rows = common_problems(rows)
        if not rows:
            raise H2OError("--common: no problem was run by every policy and budget of the pieces")
    summaries = summarize(rows, batches)
    print(markdown_table(summaries) if args.markdown else summary_table(summaries))
    if args.json:
        write_json({"pieces": list(args.pieces), "summaries": summaries}, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {plot_accuracy(summaries, args.plot, args.x)}")
    return 0
