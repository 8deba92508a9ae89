"""``python -m h2okv.tools.profile_step``: where a decode step's and a scoring pass's time goes.

Wall and CPU time per op group, from timers wrapped around the core's seams (not the profiler,
whose per-op overhead would dwarf ops of a few microseconds):

- decode (``--batch``, ``--context``, ``--budget``): ``h2o`` and ``reference`` (a plain
  ``DynamicCache`` holding H2O's number of tokens) steps interleaved; per step and per layer:
  the attention call (``SlotLayer.attend`` / SDPA), inside it ``slot_attention`` (the kernel:
  matmul, softmax, output, mass) and the rest (write, accumulate, evict), and the remainder of
  the model (projections, MLP, norms, RoPE, lm_head);
- scoring (``--scoring-tokens``): a per-token-eviction pass (``chunk_size=1``) vs a plain
  forward, alternating; inside it ``token_scan`` and its per-token recurrence.

Writes one JSON file (``--json``). Measurement only: nothing here changes what the core computes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

import h2okv.core.layer as layer_mod
import h2okv.core.scan as scan_mod
import h2okv.core.step as step_mod
from h2okv.core.compat import cache_arg
from h2okv.core.decode import STEPPERS
from h2okv.core.layer import SlotLayer


class Clock:
    """Accumulated wall and CPU seconds per named group."""

    def __init__(self):
        self.wall = defaultdict(float)
        self.cpu = defaultdict(float)
        self.calls = defaultdict(int)

    def wrap(self, name, fn):
        def timed(*args, **kwargs):
            w, c = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall[name] += time.perf_counter() - w
                self.cpu[name] += time.process_time() - c
                self.calls[name] += 1
        return timed

    def reset(self):
        self.wall.clear()
        self.cpu.clear()
        self.calls.clear()


@contextmanager
def instrumented(clock: Clock):
    """Timers around the seams of the core; the originals are put back on exit."""
    import h2okv.core.attention as attn_mod
    import h2okv.core.decode as decode_mod
    import h2okv.core.native.calls as native_mod

    patches = [
        (SlotLayer, "attend", "attention call (h2o)"),
        *((stepper, "decode", "decode_step") for stepper in STEPPERS),
        (step_mod, "slot_attention", "slot_attention"),
        (decode_mod, "slot_attention", "slot_attention"),
        (layer_mod, "token_scan", "token_scan"),
        (scan_mod, "scan_block", "scan recurrence"),
        (native_mod, "scan_block", "scan recurrence (native)"),
        (native_mod, "decode_dense", "decode_dense (native)"),
        (attn_mod, "sdpa_attention_forward", "attention call (sdpa)"),
    ]
    saved = []
    for owner, attr, name in patches:
        if hasattr(owner, attr):
            original = getattr(owner, attr)
            saved.append((owner, attr, original))
            setattr(owner, attr, clock.wrap(name, original))
    try:
        yield
    finally:
        for owner, attr, original in reversed(saved):
            setattr(owner, attr, original)


def _per_step(clock: Clock, steps: int, layers: int, total_wall: float, total_cpu: float) -> dict:
    groups = {name: {"wall_ms_per_step": 1000 * clock.wall[name] / steps,
                     "cpu_ms_per_step": 1000 * clock.cpu[name] / steps,
                     "wall_us_per_layer": 1e6 * clock.wall[name] / steps / layers,
                     "calls_per_step": clock.calls[name] / steps} for name in clock.wall}
    attn = sum(clock.wall[n] for n in ("attention call (h2o)", "attention call (sdpa)"))
    rest = total_wall - attn
    groups["rest of the model"] = {"wall_ms_per_step": 1000 * rest / steps,
                                   "wall_us_per_layer": 1e6 * rest / steps / layers}
    if "decode_step" in clock.wall and "slot_attention" in clock.wall:
        book = clock.wall["decode_step"] - clock.wall["slot_attention"]
        groups["decode_step bookkeeping (write, accumulate, evict)"] = {
            "wall_ms_per_step": 1000 * book / steps, "wall_us_per_layer": 1e6 * book / steps / layers}
    return {"step_wall_ms": 1000 * total_wall / steps, "step_cpu_ms": 1000 * total_cpu / steps, "groups": groups}


def profile_decode(model, ids, batch: int, budget: float, steps: int) -> dict:
    from h2okv.bench.runner import Bench, BenchConfig

    context = ids.shape[1]
    bench = Bench(model, None, BenchConfig(batches=[batch], contexts=[context], memory_contexts=[], budget=budget))
    bench.ids = ids
    bench.warm_up()
    pre = {p: bench.prefill(p, context) for p in ("h2o", "reference")}
    states = {}
    for p, pf in pre.items():
        cache, token = bench._replicate(pf, batch)
        states[p] = {"cache": cache, "token": token, "keep": pf.kept_tokens, "times": [], "cpu": []}
        for _ in range(2):
            bench._step(p, states[p])
    layers = model.config.get_text_config().num_hidden_layers
    clocks = {p: Clock() for p in states}
    totals = {p: [0.0, 0.0] for p in states}
    step_ms = {p: [] for p in states}
    for i in range(steps):
        for p in (("h2o", "reference") if i % 2 == 0 else ("reference", "h2o")):
            with instrumented(clocks[p]):
                w, c = time.perf_counter(), time.process_time()
                bench._step(p, states[p])
                dw, dc = time.perf_counter() - w, time.process_time() - c
            totals[p][0] += dw
            totals[p][1] += dc
            step_ms[p].append(1000 * dw)
    out = {p: {**_per_step(clocks[p], steps, layers, *totals[p]), "median_step_ms": statistics.median(step_ms[p])}
           for p in states}
    out["h2o_vs_reference_median"] = out["h2o"]["median_step_ms"] / out["reference"]["median_step_ms"]
    return out


def profile_scoring(model, ids, budget: float, repeats: int) -> dict:
    from h2okv.eval.scoring import make_cache
    from h2okv.generation import new_cache

    layers = model.config.get_text_config().num_hidden_layers
    runs = {"plain": lambda: new_cache(model, None), "h2o": lambda: make_cache(model, "h2o", budget)}
    result = {name: {"wall_s": [], "cpu_s": []} for name in runs}
    clock = Clock()
    with torch.inference_mode():
        model(ids[:, :64], **cache_arg(new_cache(model, None)), use_cache=True)
        for r in range(repeats):
            for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                cache = runs[name]()
                with instrumented(clock) if name == "h2o" else _nothing():
                    w, c = time.perf_counter(), time.process_time()
                    model(ids, **cache_arg(cache), use_cache=True)
                    result[name]["wall_s"].append(time.perf_counter() - w)
                    result[name]["cpu_s"].append(time.process_time() - c)
    for name in runs:
        result[name]["wall_median_s"] = statistics.median(result[name]["wall_s"])
        result[name]["cpu_median_s"] = statistics.median(result[name]["cpu_s"])
    result["h2o"]["groups_s_per_pass"] = {n: {"wall": clock.wall[n] / repeats, "cpu": clock.cpu[n] / repeats,
                                              "per_layer_per_token_us": 1e6 * clock.wall[n] / repeats / layers / ids.shape[1]}
                                          for n in clock.wall}
    result["h2o_vs_plain_wall"] = result["h2o"]["wall_median_s"] / result["plain"]["wall_median_s"]
    result["h2o_vs_plain_cpu"] = result["h2o"]["cpu_median_s"] / result["plain"]["cpu_median_s"]
    return result


@contextmanager
def _nothing():
    yield


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m h2okv.tools.profile_step", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="as h2okv's --model, or tiny:ARCH")
    p.add_argument("--batch", type=int, nargs="*", default=[1, 8])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--budget", type=float, default=0.2, help="fraction of --context kept, in (0, 1)")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--scoring-tokens", type=int, default=2048, help="0: no scoring profile")
    p.add_argument("--scoring-repeats", type=int, default=1)
    p.add_argument("--kernels", default=None, help="kernel path for the core (see h2okv.core.kernels)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    from h2okv.bench.model import load_bench_model
    from h2okv.bench.runner import prompt_ids

    if args.kernels:
        from h2okv.core.kernels import set_kernels

        set_kernels(args.kernels)
    model, tokenizer = load_bench_model(args.model, "cpu", None)
    vocab = model.config.get_text_config().vocab_size
    ids = prompt_ids(tokenizer, "hamlet_gut", max(args.context, args.scoring_tokens), vocab)
    result = {"arguments": vars(args), "torch": torch.__version__, "threads": torch.get_num_threads()}
    result["decode"] = {str(b): profile_decode(model, ids[:, :args.context], b, args.budget, args.steps)
                        for b in args.batch}
    if args.scoring_tokens:
        result["scoring"] = profile_scoring(model, ids[:, :args.scoring_tokens], args.budget, args.scoring_repeats)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "arguments"}, indent=1)[:6000])
    return 0


if __name__ == "__main__":
    from h2okv.errors import H2OError, print_error

    try:
        raise SystemExit(main())
    except H2OError as exc:  # bad input: the one-line error and exit status every h2okv command gives
        print_error(exc)
        raise SystemExit(2) from None
