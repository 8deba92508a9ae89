"""One prompt read, per length and recipe: the live peak memory above the weights, the K/V held
after it, and the time, each cell in a process of its own; a JSON and a plot. A recipe reads the
prompt in one call; ``RECIPE+streamed`` in pieces (``prefill="streamed"``, ``core/streamed.py``).

Why a process each: the peak is the resident set's high-water mark over the call (``measure_peak``),
and a process that ran a longer prompt before would count what glibc kept of it. Why
``MALLOC_MMAP_THRESHOLD_`` (1 MiB unless ``--allocator default``): glibc's default threshold rises
to the largest block freed (up to 32 MiB), after which blocks of activations are taken from and
kept in the heap, so the high-water mark counts freed memory too. The prompt is random token ids: memory and time do not depend on
what the tokens say. The weights are touched by a short call first (they are memory-mapped).

    python tools/measure/prefill_memory.py --lengths 2048,4096,8192,16384 --recipes bounded,full \\
        --json docs/results/longctx/prefill-memory-0.5b.json --plot docs/figures/prefill-memory.png
    python tools/measure/prefill_memory.py --recipes bounded+streamed --budget 410 ...  # 410 slots at every length

Cells already in ``--json`` are skipped (run it again to resume).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

RETURNING = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}


def one(model_name: str, length: int, recipe: str, budget: float, threads: int, sliced: bool = True) -> dict:
    """The cell, in this process (``--one``); ``sliced=False``: the feed-forward read whole, as before
    ``core/feed_forward.py`` (for the comparison)."""
    import torch

    if not sliced:
        import h2okv.core.attention as attention

        attention.slice_feed_forward = lambda model: 0

    from h2okv import CacheSettings, H2OCache, load_model
    from h2okv.bench.memory import measure_peak
    from h2okv.core.compat import cache_arg

    torch.set_num_threads(threads)
    torch.set_grad_enabled(False)
    model, _ = load_model(model_name)
    ids = torch.randint(100, 20_000, (1, length), generator=torch.Generator().manual_seed(0))
    name, _, prefill = recipe.partition("+")  # "bounded+streamed": the recipe with another prefill mode
    settings = CacheSettings.build("full") if name == "full" else CacheSettings.from_recipe(name, budget)
    cache = H2OCache(model, settings.replace(prefill=prefill) if prefill else settings)
    model(input_ids=ids[:, :64], use_cache=False)  # touch the memory-mapped weights outside the measure
    start = time.perf_counter()
    with measure_peak() as peak:
        # prefill=streamed: the cache's hook reads all but the last piece in pieces (core/streamed.py)
        model(input_ids=ids, **cache_arg(cache), use_cache=True, logits_to_keep=1)
    return {"model": model_name, "context": length, "recipe": recipe, "budget": None if recipe == "full" else budget,
            "peak_mib": round(peak.peak_bytes / 2**20, 1), "method": peak.method,
            "kv_mib": round(sum(layer.kv_bytes() for layer in cache.layers) / 2**20, 1),
            "prefill_s": round(time.perf_counter() - start, 2), "threads": threads,
            "feed_forward": "sliced" if sliced else "whole"}


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for i, (recipe, budget) in enumerate(sorted({(r["recipe"], str(r["budget"])) for r in rows})):
        mine = sorted((r for r in rows if (r["recipe"], str(r["budget"])) == (recipe, budget)), key=lambda r: r["context"])
        recipe = recipe if budget == "None" else f"{recipe} at {budget}"
        lengths, color = [r["context"] for r in mine], f"C{i}"
        axes[0].plot(lengths, [r["peak_mib"] for r in mine], marker="o", color=color,
                     label=f"{recipe}: peak above the weights")
        axes[0].plot(lengths, [r["kv_mib"] for r in mine], marker="x", linestyle="--", color=color,
                     label=f"{recipe}: K/V held")
        axes[1].plot(lengths, [r["prefill_s"] for r in mine], marker="o", color=color, label=recipe)
    for ax, label in zip(axes, ("MiB", "seconds (one thread)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    axes[0].set_title("memory of one prefill")
    axes[1].set_title("prefill time (a shared core: see the bench for ratios)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--lengths", default="2048,4096,8192,16384")
    parser.add_argument("--recipes", default="bounded,full",
                        help="recipes, 'full' for the full cache; RECIPE+MODE: the recipe with prefill MODE (bounded+streamed)")
    parser.add_argument("--budget", type=lambda v: int(v) if v.isdigit() else float(v), default=0.2,
                        help="a fraction of the prompt (0.2) or slots per layer and KV head (410)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--allocator", choices=("returning", "default"), default="returning",
                        help="returning: glibc hands freed blocks of 1 MiB or more back (the live peak); default: as is")
    parser.add_argument("--feed-forward", choices=("sliced", "whole"), default="sliced",
                        help="whole: the feed-forward unsliced, as before core/feed_forward.py")
    parser.add_argument("--json", required=True)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",") if n]
    recipes = [r for r in args.recipes.split(",") if r]
    if args.one:  # a child: one cell, its row on stdout
        print(json.dumps(one(args.model, lengths[0], recipes[0], args.budget, args.threads,
                             args.feed_forward == "sliced")))
        return 0
    out = Path(args.json)
    rows = json.loads(out.read_text()) if out.exists() else []
    done = {(r["model"], r["context"], r["recipe"], r["budget"]) for r in rows}
    cells = [(n, r) for n in lengths for r in recipes
             if (args.model, n, r, None if r == "full" else args.budget) not in done]
    env = {**os.environ, **(RETURNING if args.allocator == "returning" else {})}
    for length, recipe in tqdm(cells, desc="prefill memory", unit="cell"):
        child = subprocess.run([sys.executable, __file__, "--one", "--model", args.model, "--lengths", str(length),
                                "--recipes", recipe, "--budget", str(args.budget), "--threads", str(args.threads),
                                "--feed-forward", args.feed_forward, "--json", args.json], env=env, capture_output=True, text=True)
        if child.returncode != 0:
            print(f"{length} {recipe}: failed: {child.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            return 1
        row = json.loads(child.stdout.strip().splitlines()[-1])
        row["allocator"] = args.allocator
        rows.append(row)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rows, indent=1) + "\n")
    for row in sorted(rows, key=lambda r: (r["recipe"], r["context"])):
        print(f"{row['recipe']:>8} {row['context']:>6}: peak {row['peak_mib']:>7.1f} MiB, K/V {row['kv_mib']:>6.1f} MiB, "
              f"{row['prefill_s']:>6.1f} s")
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
