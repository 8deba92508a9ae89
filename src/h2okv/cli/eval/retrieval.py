"""``h2okv eval retrieval``: passkey retrieval per policy, budget, context and depth
(``h2okv.eval.retrieval``)."""

from __future__ import annotations

from h2okv.cli.args import (
    add_budget_shape_args,
    add_model_args,
    add_recipe_arg,
    add_threads_arg,
    apply_threads,
    examples,
    int_list,
    parse_budgets,
    parse_policies,
    positive_int,
    shape_from_args,
)
from h2okv.errors import H2OError

DEFAULT_POLICIES = "full,h2o,local,sink,random"
DEFAULT_BUDGETS = "0.2,0.5"
DEFAULT_CONTEXTS = "512,1024"
DEFAULT_DEPTHS = "0,0.5,1"
DEFAULT_PLOT = "results/retrieval_heatmap.png"


EXAMPLES = examples(
    "h2okv eval retrieval --recipe bounded --budgets 0.2 --json retrieval.json",
    "h2okv eval retrieval --contexts 512,1024 --budgets 0.2,0.5 --json retrieval.json",
)


def register(kinds) -> None:
    p = kinds.add_parser("retrieval", help="passkey retrieval (needle in a haystack) under eviction", epilog=EXAMPLES)
    add_model_args(p)
    p.add_argument("--policies", default=None, help=f"comma-separated (default: {DEFAULT_POLICIES}; full with --recipe)")
    add_recipe_arg(p, grid=True)
    p.add_argument("--budgets", default=DEFAULT_BUDGETS, help=f"cache budgets as fractions of the prompt (default: {DEFAULT_BUDGETS})")
    p.add_argument("--contexts", type=int_list, default=DEFAULT_CONTEXTS, help=f"prompt lengths in tokens (default: {DEFAULT_CONTEXTS})")
    p.add_argument("--depths", default=DEFAULT_DEPTHS, help=f"needle depths, 0 = start, 1 = end (default: {DEFAULT_DEPTHS})")
    p.add_argument("--trials", type=positive_int, default=2, help="passkeys per cell (default: 2)")
    p.add_argument("--haystack", default="filler", help="filler (repeated sentences) or shakespeare:NAME (default: filler)")
    p.add_argument("--chunk-size", type=positive_int, default=None,
                   help="prefill chunk; 1 = evict after every prompt token (default: the cache's default chunk)")
    add_budget_shape_args(p, layers=True)
    p.add_argument("--max-new-tokens", type=positive_int, default=8,
                   help="tokens generated per answer (default: 8; a passkey is a few tokens)")
    p.add_argument("--seed", type=int, default=0, help="seed of the passkeys, haystack offsets and random policy")
    add_threads_arg(p)
    p.add_argument("--json", default=None, help="write one row per cell as JSON to this file")
    p.add_argument("--plot", default=DEFAULT_PLOT, help=f"heat-map PNG (default: {DEFAULT_PLOT})")
    p.add_argument("--export-prompts", default=None, metavar="FILE",
                   help="write the grid's prompts (token ids, passkeys, model folder) as JSON for "
                        "tools/peer/run_kvpress.py, and run nothing")
    p.set_defaults(func=run)


def parse_depths(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise H2OError(f"--depths must be comma-separated fractions, got {text!r}") from None
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise H2OError(f"--depths must be fractions in [0, 1], got {text!r}")
    return sorted(set(values))


def run(args) -> int:
    import time

    from h2okv.core.cache import DEFAULT_CHUNK
    from h2okv.eval.output import check_output_paths, write_json
    from h2okv.eval.retrieval import RetrievalSpec, plot_heatmap, policy_shape, retrieval_grid, summary_table
    from h2okv.generation import new_cache
    from h2okv.models import load_model
    from h2okv.recipes import parse_recipes, recipe_runs

    recipes = parse_recipes(args.recipe)
    policies = parse_policies(args.policies or ("full" if recipes else DEFAULT_POLICIES), reconstruction=True)
    budgets = parse_budgets(args.budgets)
    contexts = sorted(set(args.contexts))
    depths = parse_depths(args.depths)
    if args.haystack != "filler" and not args.haystack.startswith("shakespeare:"):
        raise H2OError(f"--haystack must be 'filler' or shakespeare:NAME, got {args.haystack!r}")
    check_output_paths(args.json, args.plot)
    check_output_paths(args.export_prompts, None)
    chunk = args.chunk_size or DEFAULT_CHUNK
    spec = RetrievalSpec(policies, budgets, contexts, depths, args.trials, args.haystack, chunk, args.max_new_tokens,
                         args.seed, recipes=recipes, **shape_from_args(args))
    apply_threads(args.threads)
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    if args.export_prompts:
        return export(args, model, tokenizer, spec)

    # a shape a policy cannot take (--head-budgets adaptive) fails now, not mid-grid
    for policy, shape, _ in [(p, policy_shape(p, spec.shape), None) for p in policies] + recipe_runs(recipes):
        new_cache(model, policy, budgets[0], chunk_size=chunk, **shape)
    start = time.perf_counter()
    cells = retrieval_grid(model, tokenizer, spec)
    seconds = time.perf_counter() - start
    late = [p for p in policies if policy_shape(p, {}).get("prefill") == "late"]  # read whole whatever --prefill says
    prefill = args.prefill + (f" ({', '.join(late)}: late)" if late and args.prefill != "late" else "")
    print(f"Passkey retrieval, {args.haystack} haystack, chunk {chunk}, {args.trials} trials per cell; --policies "
          f"runs: prefill {prefill}, recent share {args.recent_share:g}, {args.head_budgets} head budgets")
    for _, settings, name in recipe_runs(recipes):
        print(f"recipe {name}: {', '.join(f'{k}={v}' for k, v in settings.items())}")
    print(summary_table(cells))
    print(f"{len(cells)} cells in {seconds:.1f} s")
    if args.json:
        write_json([vars(c) for c in cells], args.json)
        print(f"wrote {args.json}")
    if args.plot:
        title = f"Passkey accuracy ({args.haystack} haystack, {args.prefill} prefill, chunk {chunk}, {args.trials} trials/cell)"
        print(f"wrote {plot_heatmap(cells, args.plot, title)}")
    return 0


def export(args, model, tokenizer, spec) -> int:
    from h2okv.cli.eval._export import write_export
    from h2okv.eval.retrieval import export_prompts

    exported = export_prompts(model.name_or_path, tokenizer, spec)
    return write_export(exported, args.export_prompts, f"{len(exported['prompts'])} prompts")
