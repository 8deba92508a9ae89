"""``h2okv bench --recipes ...``: what each recipe costs against the full cache, in the same run.

Per prompt length, each recipe and the full cache read the same prompt (a Shakespeare play's first
tokens) and then decode ``steps`` greedy tokens, one after another in an order that alternates
each repeat (so a machine slowing down or speeding up hits both alike). Per cache:

- ``prefill_s``: reading the prompt until the first token's logits, ranking included (the
  reconstruction pass of ``prompt``/``document``: ``read_context`` then the last token);
- ``decode_ms``: the median greedy step after it;
- ``peak_mib``: the process's peak resident memory above what it held right before (weights
  already resident: ``Bench.warm_up`` ran first; ``bench.memory.measure_peak``);
- ``kv_fraction``: the KV bytes held after the steps over a full cache's for the same tokens,
  everything the cache holds counted (``kvzip``'s tail of tokens read after its ranking too).

Each recipe's row carries its ratios to the full cache of the same repeat; the report gives the
median over repeats. The README's recipe table quotes its cost column from here.
"""

from __future__ import annotations

import statistics
import time

import torch

from h2okv.bench.memory import measure_peak
from h2okv.core.cache import H2OCache
from h2okv.core.compat import cache_arg

FULL = "full"


def new_cache(model, name: str, budget: float):
    """The full cache, or ``H2OCache(recipe=name, budget=budget)`` with no floor: the fraction it names."""
    if name == FULL:
        return H2OCache(model, policy="full")
    return H2OCache(model, recipe=name, budget=budget, budget_floor=0)


def read_prompt(model, tokenizer, cache, ids: torch.Tensor) -> torch.Tensor:
    """The prompt's read, as ``generate`` does it: a policy ranked by reconstruction reads all but
    the last token and is ranked (``read_context``), then the last token; others read it whole.
    Returns the last position's logits."""
    from h2okv.core.reconstruction import read_ids

    if cache.policy.ranks_by_reconstruction:
        read_ids(model, tokenizer, cache, ids[:, :-1])
        ids = ids[:, -1:]
    out = model(input_ids=ids, **cache_arg(cache), use_cache=True, logits_to_keep=1)
    return out.logits[:, -1]


def measure(model, tokenizer, name: str, ids: torch.Tensor, budget: float, steps: int) -> dict:
    """One cache's prefill, ``steps`` greedy decode steps, peak memory and KV held."""
    cache = new_cache(model, name, budget)
    with measure_peak(model.device) as peak, torch.inference_mode():
        start = time.perf_counter()
        logits = read_prompt(model, tokenizer, cache, ids)
        prefill = time.perf_counter() - start
        times = []
        for _ in range(steps):
            token = logits.argmax(-1, keepdim=True)
            start = time.perf_counter()
            logits = model(input_ids=token, **cache_arg(cache), use_cache=True).logits[:, -1]
            times.append(time.perf_counter() - start)
    stats = cache.stats()
    return {"prefill_s": round(prefill, 3), "decode_ms": round(1000 * statistics.median(times), 2) if times else None,
            "peak_mib": round(peak.peak_bytes / 2**20, 1), "kv_bytes": stats["kv_bytes"],
            "full_kv_bytes": stats["full_kv_bytes"],
            "kv_fraction": round(stats["kv_bytes"] / stats["full_kv_bytes"], 4) if stats["full_kv_bytes"] else None}


def recipe_costs(model, tokenizer, recipes: list[str], prompts: dict[int, torch.Tensor], budget: float, steps: int,
                 repeats: int, bar=None) -> list[dict]:
    """Rows per (context, repeat, cache): the measures and, for recipes, their ratios to the
    full cache of the same context and repeat."""
    rows = []
    names = [FULL, *recipes]
    for context, ids in prompts.items():
        for repeat in range(repeats):
            order = names if repeat % 2 == 0 else names[::-1]
            measured = {}
            for name in order:
                measured[name] = measure(model, tokenizer, name, ids, budget, steps)
                if bar is not None:
                    bar.set_postfix_str(f"{context} {name}")
                    bar.update(1)
            full = measured[FULL]
            for name in names:
                row = {"recipe": name, "context": context, "repeat": repeat, **measured[name]}
                if name != FULL:
                    row.update(ratios(measured[name], full))
                rows.append(row)
    return rows


def ratios(row: dict, full: dict) -> dict:
    def over(key):
        return round(row[key] / full[key], 3) if row.get(key) and full.get(key) else None

    return {"prefill_x": over("prefill_s"), "decode_x": over("decode_ms"), "peak_x": over("peak_mib")}


def summary(rows: list[dict]) -> list[dict]:
    """Per (recipe, context): the median of each measure and ratio over the repeats."""
    keys = ("prefill_s", "decode_ms", "peak_mib", "kv_fraction", "prefill_x", "decode_x", "peak_x")
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["recipe"], row["context"]), []).append(row)
    out = []
    for (recipe, context), group in groups.items():
        medians = {}
        for key in keys:
            values = [r[key] for r in group if r.get(key) is not None]
            medians[key] = round(statistics.median(values), 3) if values else None
        out.append({"recipe": recipe, "context": context, "repeats": len(group), **medians})
    return out


def markdown(result: dict) -> str:
    lines = [f"Recipes against the full cache, budget {result['budget']:g} (no floor), {result['steps']} greedy steps, "
             f"median of {result['repeats']} repeat(s); threads: {result['threads']}", "",
             "| recipe | context | prefill s (x full) | decode ms/token (x full) | peak MiB above weights (x full) | KV held / full |",
             "|---|---:|---|---|---|---:|"]

    def cell(value, ratio):
        if value is None:
            return "-"
        return f"{value:g}" + (f" ({ratio:.2f}x)" if ratio is not None else "")

    for row in result["summary"]:
        kv = "-" if row["kv_fraction"] is None else f"{row['kv_fraction']:.0%}"
        lines.append(f"| {row['recipe']} | {row['context']} | {cell(row['prefill_s'], row['prefill_x'])} | "
                     f"{cell(row['decode_ms'], row['decode_x'])} | {cell(row['peak_mib'], row['peak_x'])} | {kv} |")
    return "\n".join(lines)
