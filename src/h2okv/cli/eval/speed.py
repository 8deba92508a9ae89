"""``h2okv eval tasks-speed``: our scoring with eviction against lm-eval's ``hf`` model, in wall
time (``h2okv.eval.speed``)."""

from __future__ import annotations

from h2okv.cli.args import add_model_args, check_policy, examples, positive_int
from h2okv.errors import H2OError

EXAMPLES = examples(
    "h2okv eval tasks-speed --tasks copa,piqa --limit 100 --json speed.json",
)


def register(kinds) -> None:
    p = kinds.add_parser("tasks-speed", help="wall time of h2okv scoring with eviction vs lm-eval's own hf model", epilog=EXAMPLES)
    p.add_argument("--tasks", default="copa,piqa", help="comma-separated lm-eval tasks (default: copa,piqa)")
    p.add_argument("--limit", type=positive_int, default=100, help="items per task (default 100)")
    p.add_argument("--num-fewshot", type=int, default=5, help="few-shot examples (default 5, the paper's)")
    p.add_argument("--policy", default="h2o", help="the eviction policy h2okv scores with (default h2o)")
    p.add_argument("--budget", type=float, default=0.2, help="KV budget as a fraction of each context (default 0.2)")
    p.add_argument("--batch-size", type=positive_int, default=16, help="h2okv: distinct contexts per batch")
    p.add_argument("--hf-batch-size", type=positive_int, default=32, help="hf: sequences per batch (default 32)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads for both (default 1)")
    p.add_argument("--json", required=True, help="write the timings here")
    add_model_args(p, device=False)
    p.set_defaults(func=run)


def run(args) -> int:
    from h2okv.eval.output import write_json
    from h2okv.eval.speed import compare_speed

    policy = check_policy(args.policy)
    if not 0.0 < args.budget <= 1.0:
        raise H2OError(f"--budget must be in (0, 1], got {args.budget}")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    out = compare_speed(tasks, model=args.model, policy=policy, budget=args.budget, limit=args.limit,
                        num_fewshot=args.num_fewshot, batch_size=args.batch_size, hf_batch_size=args.hf_batch_size,
                        threads=args.threads)
    total = out["total"]
    print(f"all tasks: ratio {total['ratio']:.2f}x (simple_evaluate), {total['scoring_ratio']:.2f}x (loglikelihood)")
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    write_json({"settings": settings, **out}, args.json)
    print(f"wrote {args.json}")
    return 0
