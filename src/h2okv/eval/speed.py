"""``h2okv eval tasks-speed``: wall time of our scoring with eviction vs lm-eval's own ``hf`` model.

Both run ``lm_eval.simple_evaluate`` on the same tasks, few-shot setting and items (``--limit``,
lm-eval's fixed few-shot seed), in one process, one after the other per task, each with its model
already loaded (loading is excluded for both). ``hf`` is lm-eval's ``HFLM`` on the same weights
with a plain cache; ours is the ``h2okv`` model type with the given policy and budget (branch
scoring, per-token eviction). The ratio is ours / hf: the cost of evicting while reading.
"""

from __future__ import annotations

import logging
import time

from h2okv.cli.common import add_model_args, check_policy, positive_int
from h2okv.errors import H2OError
from h2okv.eval import offline
from h2okv.eval.plots import write_json
from h2okv.eval.tasks import metrics_of, task_manager_for


def hf_source(name: str | None) -> str:
    """What lm-eval's ``hf`` model can load: a directory (our converted GGUFs) or a hub id."""
    from h2okv.models import MODEL_ALIASES, alias_path, converted_source, default_model_source

    if name in (None, "", "smollm2"):
        return default_model_source()
    if name in MODEL_ALIASES:
        return converted_source(alias_path(name))
    return name


def timed_evaluate(lm, task: str, task_manager, num_fewshot, limit) -> tuple[float, float, dict]:
    """``(wall seconds of simple_evaluate, seconds inside lm.loglikelihood, metrics)``: the second
    leaves out what both sides share (building the task and its prompts, metrics)."""
    import lm_eval

    inner = [0.0]
    original = lm.loglikelihood

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            inner[0] += time.perf_counter() - start

    lm.loglikelihood = timed
    try:
        start = time.perf_counter()
        out = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=task_manager, num_fewshot=num_fewshot,
                                      limit=limit, bootstrap_iters=0)
        wall = time.perf_counter() - start
    finally:
        del lm.loglikelihood
    return wall, inner[0], metrics_of(out["results"][task])


def register_eval(kinds) -> None:
    p = kinds.add_parser("tasks-speed", help="wall time of h2okv scoring with eviction vs lm-eval's own hf model")
    p.add_argument("--tasks", default="copa,piqa", help="comma-separated lm-eval tasks (default: copa,piqa)")
    p.add_argument("--limit", type=positive_int, default=100, help="items per task (default 100)")
    p.add_argument("--num-fewshot", type=int, default=5)
    p.add_argument("--policy", default="h2o")
    p.add_argument("--budget", type=float, default=0.2, help="KV budget as a fraction of each context (default 0.2)")
    p.add_argument("--batch-size", type=positive_int, default=16, help="h2okv: distinct contexts per batch")
    p.add_argument("--hf-batch-size", type=positive_int, default=32, help="hf: sequences per batch (default 32)")
    p.add_argument("--threads", type=positive_int, default=1)
    p.add_argument("--json", required=True)
    add_model_args(p, device=False)
    p.set_defaults(func=run)


def run(args) -> int:
    import torch
    from lm_eval.models.huggingface import HFLM

    from h2okv.core import fraction_budget
    from h2okv.eval.lm_eval_model import H2OLM

    policy = check_policy(args.policy)
    if not 0.0 < args.budget <= 1.0:
        raise H2OError(f"--budget must be in (0, 1], got {args.budget}")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    torch.set_num_threads(args.threads)
    offline.install()
    manager = task_manager_for(tasks, [])
    budget = fraction_budget(policy, args.budget)
    ours = H2OLM(pretrained=args.model or "", policy=policy, batch_size=args.batch_size, device="cpu", **budget)
    hf = HFLM(pretrained=hf_source(args.model), device="cpu", dtype="float32", batch_size=args.hf_batch_size)
    rows = {}
    for task in tasks:
        hf_wall, hf_s, hf_metrics = timed_evaluate(hf, task, manager, args.num_fewshot, args.limit)
        ours_wall, ours_s, ours_metrics = timed_evaluate(ours, task, manager, args.num_fewshot, args.limit)
        rows[task] = {"hf_seconds": round(hf_wall, 2), "h2okv_seconds": round(ours_wall, 2),
                      "ratio": round(ours_wall / hf_wall, 3), "hf_scoring_seconds": round(hf_s, 2),
                      "h2okv_scoring_seconds": round(ours_s, 2), "scoring_ratio": round(ours_s / hf_s, 3),
                      "hf": hf_metrics, "h2okv": ours_metrics}
        print(f"{task}: simple_evaluate hf {hf_wall:.1f} s, h2okv[{policy}@{args.budget:g}] {ours_wall:.1f} s "
              f"(ratio {ours_wall / hf_wall:.2f}x); inside loglikelihood {hf_s:.1f} s vs {ours_s:.1f} s "
              f"(ratio {ours_s / hf_s:.2f}x)")
    total = {key: round(sum(r[key] for r in rows.values()), 2)
             for key in ("hf_seconds", "h2okv_seconds", "hf_scoring_seconds", "h2okv_scoring_seconds")}
    total["ratio"] = round(total["h2okv_seconds"] / total["hf_seconds"], 3)
    total["scoring_ratio"] = round(total["h2okv_scoring_seconds"] / total["hf_scoring_seconds"], 3)
    print(f"all tasks: ratio {total['ratio']:.2f}x (simple_evaluate), {total['scoring_ratio']:.2f}x (loglikelihood)")
    settings = {k: v for k, v in vars(args).items() if k != "func"}
    write_json({"settings": settings, "tasks": rows, "total": total}, args.json)
    print(f"wrote {args.json}")
    return 0
