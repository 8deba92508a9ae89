"""Gemma-3-270M (sliding-window + global layers, one KV head, head_dim 256) on CPU, one thread:
h2o's generation against plain ``generate``, and the slot attention with and without flushing
subnormals, interleaved in one process. The issue that asked for it saw h2o at 1.05-1.2x plain
(once 3x under load) and ``slot_attention`` at 1.1 ms a call against 0.2 ms with the flush.

    python tools/measure/gemma_step.py --json docs/results/gemma3-step.json
"""

import argparse
import json
import statistics
import time

import torch

import h2okv.core.decode as decode_mod
import h2okv.core.step as step_mod
from h2okv import H2OCache, load_model
from h2okv.core.compat import cache_arg
from h2okv.eval.output import write_json
from h2okv.paths import models_dir


def timed_attention(calls: list):
    """Wrap ``slot_attention`` where the steps call it: every call's seconds go to ``calls``."""
    original = step_mod.slot_attention

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = original(*args, **kwargs)
        calls.append(time.perf_counter() - start)
        return out

    step_mod.slot_attention = decode_mod.slot_attention = timed


def run(model, ids, tokens, h2o: bool) -> float:
    kwargs = cache_arg(H2OCache(model, policy="h2o", heavy=16, recent=16)) if h2o else {}
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, **kwargs)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", default=str(models_dir() / "gemma-3-270m-q4_k_m.gguf"))
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model(args.gguf)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    calls = {False: [], True: []}
    seconds = {"plain": [], "h2o": [], "h2o flushed": []}
    with torch.inference_mode():
        run(model, ids, 4, True)  # warm-up: kernels built, buffers allocated
        run(model, ids, 4, False)
        for _ in range(args.repeats):
            seconds["plain"].append(run(model, ids, args.tokens, False))
            for flush in (False, True):
                torch.set_flush_denormal(flush)
                sink: list = []
                timed_attention(sink)
                seconds["h2o flushed" if flush else "h2o"].append(run(model, ids, args.tokens, True))
                calls[flush] += sink
            torch.set_flush_denormal(False)
    median = {k: statistics.median(v) for k, v in seconds.items()}
    result = {
        "model": args.gguf, "prompt_tokens": ids.shape[1], "new_tokens": args.tokens, "repeats": args.repeats,
        "threads": 1, "seconds": seconds, "median_s": median,
        "h2o_vs_plain": median["h2o"] / median["plain"],
        "slot_attention_ms": {"no flush": 1000 * statistics.median(calls[False]),
                              "flush": 1000 * statistics.median(calls[True])},
        "slot_attention_calls": len(calls[False]),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "seconds"}, indent=1))
    if args.json:
        write_json(result, args.json)


if __name__ == "__main__":
    main()
