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

from h2okv.eval import offline
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


def compare_speed(tasks: list[str], *, model: str | None, policy: str, budget: float, limit: int,
                  num_fewshot: int, batch_size: int, hf_batch_size: int, threads: int) -> dict:
    """``{"tasks": {task: {hf/h2okv seconds, ratios, metrics}}, "total": {...}}``; a line per task."""
    import torch
    from lm_eval.models.huggingface import HFLM

    from h2okv.core.budget import fraction_keywords
    from h2okv.eval.lm_eval_model import H2OLM

    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    torch.set_num_threads(threads)
    offline.install()
    manager = task_manager_for(tasks, [])
    budget_args = fraction_keywords(policy, budget)
    ours = H2OLM(pretrained=model or "", policy=policy, batch_size=batch_size, device="cpu", **budget_args)
    hf = HFLM(pretrained=hf_source(model), device="cpu", dtype="float32", batch_size=hf_batch_size)
    rows = {}
    for task in tasks:
        hf_wall, hf_s, hf_metrics = timed_evaluate(hf, task, manager, num_fewshot, limit)
        ours_wall, ours_s, ours_metrics = timed_evaluate(ours, task, manager, num_fewshot, limit)
        rows[task] = {"hf_seconds": round(hf_wall, 2), "h2okv_seconds": round(ours_wall, 2),
                      "ratio": round(ours_wall / hf_wall, 3), "hf_scoring_seconds": round(hf_s, 2),
                      "h2okv_scoring_seconds": round(ours_s, 2), "scoring_ratio": round(ours_s / hf_s, 3),
                      "hf": hf_metrics, "h2okv": ours_metrics}
        print(f"{task}: simple_evaluate hf {hf_wall:.1f} s, h2okv[{policy}@{budget:g}] {ours_wall:.1f} s "
              f"(ratio {ours_wall / hf_wall:.2f}x); inside loglikelihood {hf_s:.1f} s vs {ours_s:.1f} s "
              f"(ratio {ours_s / hf_s:.2f}x)")
    total = {key: round(sum(r[key] for r in rows.values()), 2)
             for key in ("hf_seconds", "h2okv_seconds", "hf_scoring_seconds", "h2okv_scoring_seconds")}
    total["ratio"] = round(total["h2okv_seconds"] / total["hf_seconds"], 3)
    total["scoring_ratio"] = round(total["h2okv_scoring_seconds"] / total["hf_scoring_seconds"], 3)
    return {"tasks": rows, "total": total}
