"""``h2okv eval tasks-report``: ``eval tasks`` / ``eval summarize`` JSON pieces merged into the
paper's table and figures (``h2okv.eval.tasks_report``)."""

from __future__ import annotations

from h2okv.cli.args import examples
from h2okv.errors import H2OError

EXAMPLES = examples(
    "h2okv eval tasks-report t1.json t2.json --json merged.json --png acc_vs_budget.png --markdown",
)


def register(kinds) -> None:
    p = kinds.add_parser("tasks-report", help="merge `eval tasks` JSON pieces into the paper's table and figure", epilog=EXAMPLES)
    p.add_argument("pieces", nargs="+", help="JSON files written by `h2okv eval tasks` or `h2okv eval summarize`")
    p.add_argument("--json", default=None, help="write the merged rows here")
    p.add_argument("--png", default=None, help="accuracy vs KV budget figure (one panel per task)")
    p.add_argument("--rouge-png", default=None, help="ROUGE bars of the summarization pieces at --table-budget")
    p.add_argument("--figure-model", default=None, help="model of the figure (default: the one with most rows)")
    p.add_argument("--metric", default="acc", help="metric of the figure (default acc)")
    p.add_argument("--markdown", action="store_true", help="print the paper's table as Markdown")
    p.add_argument("--table-budget", type=float, default=0.2, help="budget of the table (default 0.2)")
    p.set_defaults(func=run)


def run(args) -> int:
    from h2okv.eval.output import write_json
    from h2okv.eval.tasks_report import markdown_table, merge, plot_budget_sweep, plot_summaries

    rows = merge(args.pieces)
    if not rows:
        raise H2OError("the pieces hold no results")
    if args.json:
        write_json({"pieces": list(args.pieces), "rows": rows}, args.json)
        print(f"wrote {args.json}")
    if args.png:
        print(f"wrote {plot_budget_sweep(rows, args.png, metric=args.metric, model=args.figure_model)}")
    if args.rouge_png:
        print(f"wrote {plot_summaries(rows, args.rouge_png, args.table_budget)}")
    if args.markdown or not (args.json or args.png or args.rouge_png):
        print(markdown_table(rows, args.table_budget))
    return 0
