"""``h2okv bench --policies ...``: what each eviction policy costs, against baselines timed in the same run.

- decode: one prompt of ``context`` tokens per policy at the budget, then interleaved one-token
  steps (``Bench.decode``); each policy's median step over the ``reference`` step (a plain
  ``DynamicCache`` holding the same number of tokens, no bookkeeping), and the KV bytes each
  cache holds after its prompt. The budget's shape (``--recent-share``, ``--prefill``,
  ``--head-budgets``) applies to the studied policies' caches here.
- scoring: a teacher-forced pass over ``scoring_tokens`` tokens with per-token eviction
  (``chunk_size=1``, what ``eval ppl`` and log-likelihoods use) over a plain forward pass
  (``DynamicCache``, SDPA) of the same tokens, alternating so machine drift hits both alike.

A policy that ranks by reconstruction (``kvzip``) cannot evict per token: its cache reads the
prompt whole (late prefill) and ``h2okv.reconstruct`` ranks it before the decode steps, and its
scoring pass is that read plus the probe (what ranking a prompt costs it).
"""

from __future__ import annotations

import statistics
import time

import torch

from h2okv.bench.memory import cache_kv_bytes
from h2okv.bench.runner import Bench, BenchConfig
from h2okv.core.cache import H2OCache
from h2okv.core.compat import cache_arg
from h2okv.core.reconstruction import reconstruct
from h2okv.eval.scoring import make_cache
from h2okv.generation import new_cache
from h2okv.policies import policy_class


class PolicyBench(Bench):
    """``Bench`` whose evicting caches use any policy name (``reference`` and ``full`` stay plain);
    the studied policies' caches take ``shape`` (``new_cache``'s ``recent_share``, ``prefill``,
    ``head_budgets``), the warm-up's plain ``h2o`` does not."""

    def __init__(self, *args, shape: dict | None = None, shaped=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.shape, self.shaped = dict(shape or {}), set(shaped)

    def _new_cache(self, policy: str):
        if policy in ("full", "reference"):
            return new_cache(self.model, None)
        shape = dict(self.shape) if policy in self.shaped else {}
        if ranks_by_probe(policy):
            shape["prefill"] = "late"  # the probe ranks a prompt the cache holds whole
        return new_cache(self.model, policy, self.cfg.budget, self.cfg.chunk_size, **shape)

    def prefill(self, policy: str, context: int, memory: bool = False):
        pre = super().prefill(policy, context, memory)
        if ranks_by_probe(policy):
            reconstruct(self.model, pre.cache, self._prompt(policy, context), self.tokenizer)
        return pre


BASELINES = ("full", "reference", "plain")  # the rows that are no policy's cache


def ranks_by_probe(name: str) -> bool:
    """Whether row ``name`` is a policy that ``h2okv.reconstruct`` ranks (``kvzip``)."""
    return name not in BASELINES and policy_class(name).ranks_by_reconstruction


def decode_costs(model, tokenizer, policies: list[str], context: int, budget: float, steps: int, progress=None,
                 shape: dict | None = None) -> dict:
    cfg = BenchConfig(batches=[1], contexts=[context], memory_contexts=[], budget=budget, steps=steps)
    bench = PolicyBench(model, tokenizer, cfg, progress=progress, shape=shape, shaped=policies)
    names = [*policies, "reference"]
    bench.warm_up()
    prefilled = {}
    kv_bytes = {}
    for policy in names:
        pre = bench.prefill(policy, context)
        if isinstance(pre.cache, H2OCache):
            pre.kept_tokens = max(pre.cache.budget())
        kv_bytes[policy] = cache_kv_bytes(pre.cache)  # adaptive heads: the slots of each layer's largest head
        prefilled[policy] = pre
    stats = bench.decode(prefilled, dict.fromkeys(names, 1), steps)
    ref = stats["reference"]
    return {
        p: {**stats[p], "vs_reference_step": stats[p]["decode_step_ms"] / ref["decode_step_ms"],
            "vs_reference_step_cpu": stats[p]["decode_step_cpu_ms"] / ref["decode_step_cpu_ms"],
            "kept_tokens": prefilled[p].kept_tokens, "kv_bytes_after_prompt": kv_bytes[p]}
        for p in names
    }


def scoring_costs(model, ids: torch.Tensor, policies: list[str], budget: float, repeats: int = 1, progress=None,
                  tokenizer=None) -> dict:
    """Seconds of a per-token-eviction pass per policy and of a plain forward, and their ratio
    (for ``kvzip``: the prompt read whole and ranked by ``reconstruct``, with ``tokenizer``)."""
    def plain():
        model(ids, **cache_arg(new_cache(model, None)), use_cache=True)

    def scored(policy):
        if ranks_by_probe(policy):
            def probed():
                cache = new_cache(model, policy, budget, prefill="late")
                model(ids, **cache_arg(cache), use_cache=True)
                reconstruct(model, cache, ids, tokenizer)
            return probed

        def run():
            model(ids, **cache_arg(make_cache(model, policy, budget if policy_class(policy).evicts else None)),
                  use_cache=True)
        return run

    runs = {"plain": plain, **{p: scored(p) for p in policies}}
    times: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}  # process CPU time: robust to other jobs
    with torch.inference_mode():
        plain()  # warm-up: thread pools, allocator
        for r in range(repeats):
            order = list(runs)[r % len(runs):] + list(runs)[:r % len(runs)]
            for name in order:
                start, start_cpu = time.perf_counter(), time.process_time()
                runs[name]()
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
                if progress is not None:
                    progress.update(1)
    base, base_cpu = statistics.median(times["plain"]), statistics.median(cpu["plain"])
    return {name: {"seconds": statistics.median(t), "seconds_all": t, "vs_plain_forward": statistics.median(t) / base,
                   "cpu_seconds": statistics.median(cpu[name]),
                   "vs_plain_forward_cpu": statistics.median(cpu[name]) / base_cpu}
            for name, t in times.items()}


def markdown(result: dict) -> str:
    d, s = result["decode"], result["scoring"]
    shape = ", ".join(f"{k} {v}" for k, v in (result.get("shape") or {}).items())
    lines = [
        f"Decode step, context {result['context']}, budget {result['budget']:g}{', ' + shape if shape else ''}, "
        f"batch 1, {result['steps']} interleaved steps (median):",
        "",
        "| policy | kept tokens | KV MiB after the prompt | KV MiB after the steps | step ms | step CPU ms "
        "| / reference step | / reference (CPU) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    mib = lambda v: "" if v is None else f"{v / 2**20:.2f}"  # noqa: E731
    for p, r in d.items():
        # after the steps: uneven head budgets decode flat, each head holding its own slots only
        name = f"{p} (read late, ranked by reconstruct)" if ranks_by_probe(p) else p
        lines.append(f"| {name} | {r['kept_tokens']} | {mib(r.get('kv_bytes_after_prompt'))} | {mib(r.get('kv_bytes'))} | "
                     f"{r['decode_step_ms']:.2f} | {r['decode_step_cpu_ms']:.2f} | "
                     f"{r['vs_reference_step']:.3f} | {r['vs_reference_step_cpu']:.3f} |")
    lines += [
        "",
        f"Per-token scoring (chunk_size=1) over {result['scoring_tokens']} tokens, budget {result['budget']:g}:",
        "",
        "| pass | seconds | CPU seconds | / plain forward | / plain forward (CPU) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for p, r in s.items():
        name = f"{p} (late read + reconstruct)" if ranks_by_probe(p) else p
        lines.append(f"| {name} | {r['seconds']:.2f} | {r['cpu_seconds']:.2f} | {r['vs_plain_forward']:.3f} | "
                     f"{r['vs_plain_forward_cpu']:.3f} |")
    return "\n".join(lines) + "\n"
