"""``h2okv eval ppl``: streaming perplexity per policy and budget (``h2okv.eval.ppl``)."""

from __future__ import annotations

from h2okv.cli.args import (
    add_cache_args,
    add_model_args,
    add_text_args,
    add_threads_arg,
    add_tp_args,
    apply_threads,
    examples,
    parse_budgets,
    parse_policies,
    positive_int,
    text_from_args,
)
from h2okv.errors import H2OError
from h2okv.settings import DEFAULT_KV_GROUP, KV_BITS

DEFAULT_POLICIES = "full,h2o,local,sink,random"
DEFAULT_BUDGETS = "0.05,0.1,0.2,0.5"
DEFAULT_PLOT = "results/ppl_vs_budget.png"
STREAM_PLOT = "results/ppl_stream.png"  # stream mode's default: the grid's figure is another plot


EXAMPLES = examples(
    "h2okv eval ppl --tokens 2048 --policies full,h2o,local,sink,random --budgets 0.05,0.1,0.2,0.5 --json ppl.json",
    "h2okv eval ppl --window-tokens 2048 --slots 512,1024 --positions true,rolling --tokens 65536",
)


def register(kinds) -> None:
    p = kinds.add_parser("ppl", help="streaming perplexity with the cache evicting as the text is read", epilog=EXAMPLES)
    add_model_args(p)
    add_text_args(p)
    p.add_argument("--tokens", type=positive_int, default=1024, help="tokens per segment (default: 1024)")
    p.add_argument("--segments", type=positive_int, default=1, help="consecutive segments scored in one batch (default: 1)")
    p.add_argument("--policies", default=DEFAULT_POLICIES, help=f"comma-separated (default: {DEFAULT_POLICIES})")
    p.add_argument("--budgets", default=DEFAULT_BUDGETS, help=f"cache budgets as fractions of --tokens (default: {DEFAULT_BUDGETS})")
    p.add_argument("--seed", type=int, default=0, help="seed of the random policy")
    p.add_argument("--kv-bits", default=None, metavar="BITS",
                   help="comma-separated 8, 4, 2 or none: every row again with its slots quantized (full's too: "
                        "quantization alone); the reference stays the model's dtype (default: none)")
    p.add_argument("--key-bits", type=int, default=None, metavar="BITS",
                   help="the keys' bits in every quantized row (e.g. 8 with --kv-bits 4; default: each row's)")
    p.add_argument("--kv-group", type=positive_int, default=DEFAULT_KV_GROUP,
                   help=f"channels per scale of quantized slots (default: {DEFAULT_KV_GROUP})")
    p.add_argument("--float-window", type=int, default=0, metavar="TOKENS",
                   help="each quantized row's last TOKENS tokens also kept in float, coded once they age out (default: 0)")
    add_threads_arg(p)
    add_tp_args(p)
    add_cache_args(p, ["center_keys"])  # with --kv-bits: keys less their channel's turned mean
    p.add_argument("--window-tokens", type=positive_int, default=None,
                   help="stream mode: read --tokens in forward calls of this many tokens into one cache of --slots, "
                        "and report perplexity per window (far past the context window with --positions rolling)")
    p.add_argument("--slots", default=None, help="stream mode: comma-separated budgets in slots per layer/head (e.g. 512,1024)")
    p.add_argument("--positions", default="true",
                   help="stream mode: comma-separated position schemes: true, rolling, rolling:shift, rolling:order (default: true)")
    p.add_argument("--reference-context", type=int, default=None, metavar="N",
                   help="stream mode: add a yardstick run, each window read with full attention after the N tokens "
                        "before it (fresh per window; N + --window-tokens within the model's context), to tell the "
                        "text's own ups and downs from the cache's")
    p.add_argument("--json", default=None, help="write the rows as JSON to this file")
    p.add_argument("--plot", default=DEFAULT_PLOT, help=f"PNG of perplexity vs budget (default: {DEFAULT_PLOT})")
    p.set_defaults(func=run)


def parse_kv_bits(text: str | None) -> tuple:
    """``"none,8,4"`` -> ``(None, 8, 4)``; the float rows always come first."""
    if text is None:
        return (None,)
    chosen = []
    for part in text.split(","):
        part = part.strip().lower()
        if part == "none":
            chosen.append(None)
        elif part.isdigit() and int(part) in KV_BITS:
            chosen.append(int(part))
        else:
            raise H2OError(f"--kv-bits takes {', '.join(map(str, KV_BITS))} or none, comma-separated, got {part!r}")
    return tuple(dict.fromkeys([None, *chosen]))


def run(args) -> int:
    from h2okv.eval.output import check_output_paths
    from h2okv.parallel import launch

    # settings are checked here, before the model load and before any rank starts
    parse_policies(args.policies)
    parse_budgets(args.budgets)
    args.kv_bits_list = parse_kv_bits(args.kv_bits)
    if args.key_bits is not None and (args.key_bits not in KV_BITS or args.kv_bits_list == (None,)):
        raise H2OError(f"--key-bits takes {', '.join(map(str, KV_BITS))}, with --kv-bits")
    if args.center_keys and not any(bits is not None for bits in args.kv_bits_list):
        raise H2OError("--center-keys centers the keys of quantized slots: give --kv-bits too")
    if args.tokens < 2:
        raise H2OError("--tokens must be at least 2 (perplexity needs a token to predict)")
    check_output_paths(args.json, args.plot)
    if args.reference_context is not None and args.window_tokens is None:
        raise H2OError("--reference-context belongs to stream mode: give --window-tokens too")
    if args.window_tokens is not None:
        from h2okv.cli.eval._stream import check_stream_args

        check_stream_args(args)
    args.loaded_text = text_from_args(args)  # read once, before the model load (and before ranks start)
    launch.prepare(args)
    return launch.run(args, score_on_rank)


def score_on_rank(args) -> int:
    """Load, score, report: in this process, or on every rank of a ``--tp`` run (rank 0 reports)."""
    import time

    from h2okv.eval.output import format_table, write_json
    from h2okv.eval.ppl import plot_ppl, ppl_grid
    from h2okv.eval.text import text_segments
    from h2okv.models import load_model
    from h2okv.parallel.ranks import is_main_rank

    policies, budgets = parse_policies(args.policies), parse_budgets(args.budgets)
    text, label = args.loaded_text
    apply_threads(args.threads)
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype, tp=args.tp)
    if args.window_tokens is not None:
        from h2okv.cli.eval._stream import stream_on_rank

        if args.plot == DEFAULT_PLOT:
            args.plot = STREAM_PLOT
        return stream_on_rank(args, model, tokenizer)
    ids = text_segments(tokenizer, text, args.tokens, args.segments)
    start = time.perf_counter()
    rows, full_ppl = ppl_grid(model, ids, policies, budgets, seed=args.seed, progress=is_main_rank(),
                              kv_bits=args.kv_bits_list,
                              coding={"kv_group": args.kv_group, "key_bits": args.key_bits,
                                      "float_window": args.float_window, "center_keys": args.center_keys})
    total = time.perf_counter() - start
    if not is_main_rank():
        return 0

    print(f"Streaming perplexity, {args.segments} x {args.tokens} tokens of {label} (eviction after every token)")
    headers = ["policy", "budget", "slots", "ppl", "x full", "ppl after fill", "x full"]
    table = [[r.label, r.budget, r.slots, r.ppl, r.ppl_ratio_to_full, r.ppl_after_fill, r.after_fill_ratio_to_full] for r in rows]
    print(format_table(headers, table))
    print(f"full-cache perplexity {full_ppl:.3f}; {len(rows)} rows in {total:.1f} s")
    if args.json:
        write_json([vars(r) for r in rows], args.json)
        print(f"wrote {args.json}")
    if args.plot:
        title = f"Streaming perplexity, {args.segments}x{args.tokens} tokens of {label}"
        print(f"wrote {plot_ppl(rows, full_ppl, args.plot, title)}")
    return 0
