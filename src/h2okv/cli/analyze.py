"""``h2okv analyze``: per-layer attention sparsity and the power law of accumulated attention, the
two observations behind H2O, measured on a model and a text (see ``h2okv.eval.analysis``)."""

from __future__ import annotations

import time

from h2okv.cli.args import add_model_args, add_text_args, examples, positive_int, text_from_args
from h2okv.errors import H2OError

DEFAULT_PLOT = "results/sparsity.png"
DEFAULT_POWERLAW_PLOT = "results/powerlaw.png"


EXAMPLES = examples(
    "h2okv analyze --tokens 2048 --json analyze.json",
)


def register(sub) -> None:
    p = sub.add_parser("analyze", help="attention sparsity per layer and the power law of accumulated attention",
                       epilog=EXAMPLES)
    add_model_args(p)
    add_text_args(p)
    p.add_argument("--tokens", type=positive_int, default=2048, help="tokens of the text to analyse (default: 2048)")
    p.add_argument("--threshold", type=float, default=0.01, help="sparse = below this fraction of the row max (default: 0.01)")
    p.add_argument("--json", default=None, help="write one row per layer as JSON to this file")
    p.add_argument("--plot", default=DEFAULT_PLOT, help=f"sparsity-per-layer PNG (default: {DEFAULT_PLOT})")
    p.add_argument("--powerlaw-plot", default=DEFAULT_POWERLAW_PLOT,
                   help=f"log-log accumulated attention vs rank PNG (default: {DEFAULT_POWERLAW_PLOT})")
    p.set_defaults(func=run)


def run(args) -> int:
    from tqdm.auto import tqdm

    from h2okv.core.attention import attention_modules
    from h2okv.eval.analysis import layer_stats, plot_powerlaw, plot_sparsity, record_attention
    from h2okv.eval.output import check_output_paths, format_table, write_json
    from h2okv.eval.text import text_segments
    from h2okv.models import load_model

    if not 0.0 < args.threshold < 1.0:
        raise H2OError(f"--threshold must be in (0, 1), got {args.threshold}")
    check_output_paths(args.json, args.plot)
    check_output_paths(None, args.powerlaw_plot)
    text, label = text_from_args(args)
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    ids = text_segments(tokenizer, text, args.tokens)
    start = time.perf_counter()
    n_layers = len(list(attention_modules(model)))
    with tqdm(total=n_layers, desc="analyze", unit="layer") as bar:
        recorder = record_attention(model, ids, args.threshold, progress=bar)
    rows = layer_stats(recorder)
    seconds = time.perf_counter() - start

    print(f"Attention of {type(model).__name__} on {args.tokens} tokens of {label}")
    headers = ["layer", "sparsity", "least sparse head", "most sparse head", "power-law slope", "R^2", "top 10% share", "top 20% share"]
    print(format_table(headers, [[r.layer, f"{r.sparsity:.1%}", f"{r.min_head_sparsity:.1%}", f"{r.max_head_sparsity:.1%}",
                                  round(r.powerlaw_slope, 3), round(r.powerlaw_r2, 3), f"{r.top10_share:.1%}",
                                  f"{r.top20_share:.1%}"] for r in rows]))
    mean = sum(r.sparsity for r in rows) / len(rows)
    above = sum(r.sparsity > 0.95 for r in rows)
    print(f"mean sparsity {mean:.1%} (threshold {args.threshold:g} x row max); {above}/{len(rows)} layers above 95%; {seconds:.1f} s")
    if args.json:
        write_json([vars(r) for r in rows], args.json)
        print(f"wrote {args.json}")
    name = args.model or "SmolLM2-135M-Instruct"
    if args.plot:
        print(f"wrote {plot_sparsity(rows, args.plot, f'Attention sparsity per layer, {name}, {args.tokens} tokens of {label}', args.threshold)}")
    if args.powerlaw_plot:
        print(f"wrote {plot_powerlaw(recorder, rows, args.powerlaw_plot, f'Accumulated attention vs rank, {name}, {label}')}")
    return 0
