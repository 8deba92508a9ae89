"""``h2okv eval tasks``: lm-evaluation-harness tasks per eviction policy (``h2okv.eval.tasks``)."""

from __future__ import annotations

from h2okv.cli.args import add_model_args, apply_threads, check_policy, examples, positive_int
from h2okv.errors import H2OError
from h2okv.eval.tasks import SHAKESPEARE_TASK  # light: the module loads lm-eval only when it runs

EXAMPLES = examples(
    "h2okv eval tasks --tasks copa,piqa --budget 0.2 --json t.json",
)


def register(kinds) -> None:
    p = kinds.add_parser("tasks", help="lm-evaluation-harness tasks with each eviction policy (paper: copa, piqa, ...)", epilog=EXAMPLES)
    p.add_argument("--tasks", required=True,
                   help=f"comma-separated lm-eval task names; built-in offline task: {SHAKESPEARE_TASK}")
    p.add_argument("--policies", default="full,h2o,local", help="comma-separated (default: full,h2o,local)")
    p.add_argument("--budget", type=float, default=0.2,
                   help="KV budget as a fraction of each request's tokens, split half heavy / half recent (default 0.2)")
    p.add_argument("--limit", type=positive_int, default=None, help="first N documents of each task")
    p.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (paper: 5)")
    p.add_argument("--include-path", action="append", default=[], help="directory of extra task YAMLs (repeatable)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="requests scored together (default 8)")
    p.add_argument("--chunk-size", type=positive_int, default=1,
                   help="tokens read between evictions while scoring (default 1 = per-token Algorithm 1)")
    p.add_argument("--local-items", type=positive_int, default=160, help=f"items of {SHAKESPEARE_TASK} (default 160)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch CPU threads (1 is often fastest on a busy machine: per-token scoring is many small ops)")
    p.add_argument("--json", required=True, help="write the results here")
    add_model_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    import json
    import sys
    from pathlib import Path

    from h2okv.eval import offline
    from h2okv.eval.tasks import TasksSpec, format_table, run_tasks

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    policies = [check_policy(p.strip()) for p in args.policies.split(",") if p.strip()]
    if not tasks or not policies:
        raise H2OError("give at least one task and one policy")
    if not 0.0 < args.budget <= 1.0:
        raise H2OError(f"--budget must be in (0, 1], got {args.budget}")
    apply_threads(args.threads)
    spec = TasksSpec(
        tasks, policies, args.budget, model=args.model, limit=args.limit, num_fewshot=args.num_fewshot,
        include_paths=tuple(args.include_path), batch_size=args.batch_size, chunk_size=args.chunk_size,
        device=args.device, dtype=args.dtype,
    )
    results = run_tasks(spec, local_items=args.local_items)
    print(format_table(results))
    report = {
        "command": "h2okv " + " ".join(sys.argv[1:]) if sys.argv and "h2okv" in Path(sys.argv[0]).name else None,
        "settings": {k: v for k, v in vars(args).items() if k != "func"},
        "budget_meaning": "fraction of each multiple-choice context's tokens (read once, then branched per "
                          "continuation); half heavy, half recent",
        "offline_data": {t: offline.USED[t] for t in tasks if t in offline.USED},
        "results": results,
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {path}")
    return 0
