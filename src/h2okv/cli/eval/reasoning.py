"""``h2okv eval reasoning``: GSM8K / MATH-500 step by step under every policy and KV budget
(``h2okv.eval.reasoning``)."""

from __future__ import annotations

from h2okv.cli.args import (
    add_budget_shape_args,
    add_cache_args,
    add_model_args,
    add_threads_arg,
    apply_threads,
    examples,
    parse_kv_budgets,
    parse_policies,
    positive_int,
)
from h2okv.errors import H2OError
from h2okv.recipes import recipe_help
from h2okv.settings import CODING_FIELDS, DEFAULT_KV_GROUP

DEFAULT_POLICIES = "full,h2o,h2o-mean,tova,snapkv,h2o-sink,sink,local"
DEFAULT_BUDGETS = "64,128,256,512"


EXAMPLES = examples(
    "h2okv eval reasoning --model qwen2.5-0.5b --recipe generation --budgets 256 --limit 300 --json gsm8k-gen.json",
)


def register(kinds) -> None:
    p = kinds.add_parser("reasoning", help="step-by-step math (GSM8K, MATH-500) generated under a KV budget", epilog=EXAMPLES)
    add_model_args(p)
    p.add_argument("--task", choices=("gsm8k", "math500"), default="gsm8k", help="problem set (default: gsm8k)")
    p.add_argument("--prompt", choices=("chat", "fewshot"), default="chat",
                   help="chat: 0-shot in the model's chat template, final answer in \\boxed{}; fewshot: the "
                        "request file's own few-shot prompt as plain text (default: chat)")
    p.add_argument("--limit", type=positive_int, default=None, help="number of problems (default: all)")
    p.add_argument("--offset", type=int, default=0, help="first problem (0-based; pieces take consecutive ranges)")
    p.add_argument("--policies", default=None, help=f"comma-separated (default: {DEFAULT_POLICIES}; full with --recipe)")
    p.add_argument("--recipe", default=None, metavar="NAME",
                   help=f"run the recipe's policy with its settings (recent share, prefill, positions) beside "
                        f"--policies: {recipe_help()}")
    p.add_argument("--budgets", default=DEFAULT_BUDGETS,
                   help="KV budgets: integers are slots per layer and KV head (--recent-share of them recent, "
                        "the rest heavy hitters), "
                        f"numbers with a point are fractions of the prompt (default: {DEFAULT_BUDGETS})")
    add_budget_shape_args(p, prefill=False)  # --recent-share: a piece's rows name a share other than 0.5
    p.add_argument("--protect-prompt", action="store_true",
                   help="keep each prompt whole: the budget applies to the answer (rows say protect-prompt; "
                        "the KV reported counts the prompt too)")
    add_cache_args(p, list(CODING_FIELDS))  # every row's slots quantized, full's too (quantization alone)
    p.add_argument("--max-new-tokens", type=positive_int, default=512, help="(default: 512)")
    p.add_argument("--batch-size", type=positive_int, default=50,
                   help="problems per batch, left-padded; each row evicts and stops on its own, so the answers "
                        "do not depend on it and a piece may resume at another; a CPU step is bound by reading "
                        "the weights, so a larger batch is cheaper a token (default: 50)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random policy")
    add_threads_arg(p)
    p.add_argument("--json", default=None, help="the piece: every graded problem, rewritten after each batch")
    p.add_argument("--resume", action="store_true", help="go on from the --json piece: skip the problems it holds")
    p.add_argument("--plot", default=None, help="accuracy vs budget PNG of this run")
    p.add_argument("--keep-text", action="store_true", help="keep each generated answer's text in the piece")
    p.add_argument("--export-prompts", default=None, metavar="FILE",
                   help="run nothing: write the problems' prompt token ids, gold answers, stop tokens and setup "
                        "for tools/peer/run_kvpress.py (kvpress's DecodingPress on the same prompts)")
    p.set_defaults(func=run)


def _resumed(args, setup) -> dict | None:
    from dataclasses import asdict, replace
    from pathlib import Path

    from h2okv.eval.reasoning import Setup
    from h2okv.eval.reasoning_report import read_piece

    if not (args.resume and args.json and Path(args.json).is_file()):
        return None
    piece = read_piece(args.json)
    # a piece from before a field existed has its default; the batch size may differ (a row's answer
    # does not depend on its batch: tested), and every row keeps the one it ran in
    if replace(Setup(**piece["setup"]), batch_size=setup.batch_size) != setup:
        raise H2OError(f"--resume: {args.json} was run with {piece['setup']}, not {asdict(setup)}")
    return piece


def run(args) -> int:
    import time

    from h2okv.eval.output import check_output_paths, write_json
    from h2okv.eval.reasoning import Setup, reasoning_grid
    from h2okv.eval.reasoning_data import load_problems
    from h2okv.eval.reasoning_report import plot_accuracy, summarize, summary_table
    from h2okv.models import load_model
    from h2okv.recipes import recipe_runs

    recipe = recipe_runs([args.recipe])[0] if args.recipe else None  # (its policy, its keywords, its name)
    policies = parse_policies(args.policies or ("full" if recipe else DEFAULT_POLICIES))
    if recipe is not None:
        own, settings, name = recipe
        if args.recent_share not in (0.5, settings["recent_share"]):  # 0.5: the flag's default
            raise H2OError(f"--recent-share {args.recent_share:g} differs from recipe {name}'s "
                           f"{settings['recent_share']:g}: give one or the other")
        args.recent_share = settings["recent_share"]
        policies = list(dict.fromkeys([*policies, own]))
    budgets = parse_kv_budgets(args.budgets)
    if args.offset < 0:
        raise H2OError(f"--offset must be >= 0, got {args.offset}")
    if args.resume and not args.json:
        raise H2OError("--resume needs --json (the piece to go on from)")
    check_output_paths(args.json, args.plot)
    check_output_paths(args.export_prompts, None)
    problems = load_problems(args.task, args.limit, args.offset)
    apply_threads(args.threads)
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    setup = Setup(model=args.model or model.name_or_path, task=args.task, style=args.prompt,
                  max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed,
                  recent_share=args.recent_share,
                  recipe=args.recipe, protect_prompt=args.protect_prompt, kv_bits=args.kv_bits,
                  kv_group=args.kv_group or DEFAULT_KV_GROUP, key_bits=args.key_bits,
                  float_window=args.float_window or 0, center_keys=bool(args.center_keys))
    if args.export_prompts:
        return export(args, model, tokenizer, setup, problems, budgets)
    save = (lambda piece: write_json(piece, args.json)) if args.json else None
    start = time.perf_counter()
    piece = reasoning_grid(model, tokenizer, setup, problems, policies, budgets, piece=_resumed(args, setup), on_batch=save,
                           keep_text=args.keep_text)
    summaries = summarize(piece["rows"], [{**{k: setup.__dict__[k] for k in ("model", "task", "style")}, **b}
                                          for b in piece["batches"]])
    print(f"{args.task}, {args.prompt} prompts, problems {args.offset}..{args.offset + len(problems) - 1}, "
          f"greedy, up to {args.max_new_tokens} new tokens, batches of {args.batch_size}")
    print(summary_table(summaries))
    print(f"{time.perf_counter() - start:.1f} s")
    if args.json:
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {plot_accuracy(summaries, args.plot)}")
    return 0


def export(args, model, tokenizer, setup, problems, budgets) -> int:
    from h2okv.cli.eval._export import write_export
    from h2okv.eval.reasoning import export_prompts
    from h2okv.serve.outputs import eos_ids

    exported = export_prompts(model.name_or_path, tokenizer, setup, problems, budgets, eos_ids(model, tokenizer))
    return write_export(exported, args.export_prompts, f"{len(problems)} {args.task} prompts", "model_path")
