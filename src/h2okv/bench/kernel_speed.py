"""``h2okv bench --kernels eager,native,triton``: each kernel path (``h2okv.core.kernels``) against
baselines timed in the same run.

- decode: per (context, batch), one h2o cache per path (prefilled under that path) and the
  ``reference`` (a plain ``DynamicCache`` holding H2O's number of tokens); interleaved steps
  (``Bench.decode``); each path's median step over the reference's.
- scoring: per-token eviction (``chunk_size=1``) over ``scoring_tokens`` tokens under each path
  vs a plain forward (``DynamicCache``, SDPA), passes alternating.

A path that cannot run here (``triton`` without CUDA, ``native`` without a compiler) is reported
with the reason, not timed. The native kernels' build time (their first-call cost) is reported
apart and never enters a step: every path is warmed up before timing.
"""

from __future__ import annotations

import statistics
import time

import torch

from h2okv.bench.runner import Bench, BenchConfig
from h2okv.core.compat import cache_arg
from h2okv.core.kernels import unavailable_reason, use_kernels
from h2okv.eval.scoring import make_cache
from h2okv.generation import new_cache

SEP = "/"  # h2o/native: the h2o policy under the native kernels


def path_name(kernels: str) -> str:
    return f"h2o{SEP}{kernels}"


def kernels_of(name: str) -> str:
    return name.split(SEP, 1)[1] if SEP in name else "eager"


class KernelBench(Bench):
    """``Bench`` whose h2o caches are named by kernel path; each path runs under its kernels."""

    def _new_cache(self, name: str):
        return new_cache(self.model, None if name in ("full", "reference") else "h2o", self.cfg.budget, self.cfg.chunk_size)

    def _step(self, name: str, state: dict) -> float:
        with use_kernels(kernels_of(name)):
            return super()._step(name, state)

    def prefill(self, name: str, context: int, memory: bool = False):
        with use_kernels(kernels_of(name)):
            pre = super().prefill(name, context, memory)
        if name != "reference":
            pre.kept_tokens = max(pre.cache.budget())
        return pre


def available_paths(kernels: list[str], device) -> tuple[list[str], dict[str, str]]:
    """The paths that can run on ``device`` and, for the others, why not (building native here)."""
    runnable, skipped = [], {}
    for k in kernels:
        reason = unavailable_reason(k, device)
        if reason is None:
            runnable.append(k)
        else:
            skipped[k] = reason
    return runnable, skipped


def decode_costs(model, tokenizer, kernels: list[str], contexts: list[int], batches: list[int], budget: float,
                 steps: int) -> list[dict]:
    rows = []
    cfg = BenchConfig(batches=batches, contexts=contexts, memory_contexts=[], budget=budget, steps=steps)
    bench = KernelBench(model, tokenizer, cfg)
    for k in kernels:  # one step of each path before any timing: builds, thread pools, lazy buffers
        with use_kernels(k):
            bench.warm_up()
    names = [*(path_name(k) for k in kernels), "reference"]
    for context in contexts:
        prefilled = {name: bench.prefill(name, context) for name in names}
        for batch in batches:
            stats = bench.decode(prefilled, dict.fromkeys(names, batch), steps)
            ref = stats["reference"]
            for name in names:
                s = stats[name]
                rows.append({"path": name, "context": context, "batch": batch, "kept_tokens": prefilled[name].kept_tokens,
                             **{key: v for key, v in s.items() if key != "batch"},
                             "vs_reference_step": s["decode_step_ms"] / ref["decode_step_ms"],
                             "vs_reference_step_cpu": s["decode_step_cpu_ms"] / ref["decode_step_cpu_ms"]})
    return rows


def scoring_costs(model, ids: torch.Tensor, kernels: list[str], budget: float, repeats: int) -> dict:
    """Seconds of a per-token-eviction pass under each path and of a plain forward, alternating."""
    def plain():
        model(ids, **cache_arg(new_cache(model, None)), use_cache=True)

    def scored(k):
        def run():
            with use_kernels(k):
                model(ids, **cache_arg(make_cache(model, "h2o", budget)), use_cache=True)
        return run

    runs = {"plain": plain, **{path_name(k): scored(k) for k in kernels}}
    wall: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        for k in kernels:  # warm-up on a short prefix (native: the build happens here, untimed)
            with use_kernels(k):
                model(ids[:, :64], **cache_arg(make_cache(model, "h2o", budget)), use_cache=True)
        for r in range(repeats):
            order = list(runs)[r % len(runs):] + list(runs)[:r % len(runs)]
            for name in order:
                start, start_cpu = time.perf_counter(), time.process_time()
                runs[name]()
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    base, base_cpu = statistics.median(wall["plain"]), statistics.median(cpu["plain"])
    return {name: {"seconds": statistics.median(w), "seconds_all": w, "cpu_seconds": statistics.median(cpu[name]),
                   "vs_plain_forward": statistics.median(w) / base,
                   "vs_plain_forward_cpu": statistics.median(cpu[name]) / base_cpu}
            for name, w in wall.items()}


def native_build() -> dict | None:
    from h2okv.core.native import build

    info = build.build_info()
    if info is None:
        return None
    return {"path": info.path, "build_seconds": info.seconds, "cached": info.cached, "error": info.error}


def markdown(result: dict) -> str:
    lines = [f"Kernel paths, budget {result['budget']:g}, {result['steps']} interleaved decode steps (median); "
             f"threads: {result['threads']}", ""]
    for k, why in result["unavailable"].items():
        lines.append(f"- `{k}`: unavailable here ({why})")
    build = result.get("native_build")
    if build and not build["error"]:
        how = "a cached build loaded" if build["cached"] else "built in {:.2f} s".format(build["build_seconds"])
        lines.append(f"- native kernels: {how} (first call only, never inside a timed step)")
    lines += ["", "| path | context | batch | kept | step ms | step CPU ms | / reference | / reference (CPU) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["decode"]:
        lines.append(f"| {r['path']} | {r['context']} | {r['batch']} | {r['kept_tokens']} | {r['decode_step_ms']:.2f} | "
                     f"{r['decode_step_cpu_ms']:.2f} | {r['vs_reference_step']:.3f} | {r['vs_reference_step_cpu']:.3f} |")
    s = result.get("scoring")
    if s:
        lines += ["", f"Per-token scoring (chunk_size=1) over {result['scoring_tokens']} tokens:", "",
                  "| pass | seconds | CPU seconds | / plain forward | / plain forward (CPU) |", "| --- | --- | --- | --- | --- |"]
        for name, r in s.items():
            lines.append(f"| {name} | {r['seconds']:.2f} | {r['cpu_seconds']:.2f} | {r['vs_plain_forward']:.3f} | "
                         f"{r['vs_plain_forward_cpu']:.3f} |")
    return "\n".join(lines) + "\n"
