"""``h2okv eval tasks-report``: merge ``h2okv eval tasks`` JSON pieces into the paper's table and figure.

The grid (task x policy x budget x model) is run in pieces, each a separate ``eval tasks`` call
writing its own JSON (``docs/results/paper/``), so that no run outlives a session. This command
reads any number of pieces and writes:

- ``--json``: one row per (model, task, shots, policy, budget) with its metrics and item count
  (a later piece replaces an earlier one for the same key);
- ``--markdown``: the paper's table, task x policy at one budget (``--table-budget``, default 0.2),
  ``acc ± stderr`` (and ``acc_norm`` where the task has it, and the fraction of items on which
  each policy picks the same answer as full), one table per model and shot count; ``eval summarize``
  pieces add ROUGE-1/2/L ± stderr rows, the paired ROUGE-L difference from full on the same articles
  ± stderr, and ROUGE-L against full's own summaries (also when each policy ran in its own piece);
- ``--png``: accuracy vs KV budget per task (one panel each), a line per evicting policy and the
  full cache as a dashed level, the items per point in each panel's title;
- ``--rouge-png``: ROUGE-1/2/L bars of the summarization pieces, one panel per model and dataset.
"""

from __future__ import annotations

import json
from pathlib import Path

from h2okv.errors import H2OError
from h2okv.eval.plots import new_figure, policy_color, save_figure
from h2okv.eval.summarize import ROUGE_TYPES

POLICY_ORDER = ("full", "h2o", "local", "sink", "random")


def _model_label(settings: dict) -> str:
    model = settings.get("model") or "smollm2"
    return Path(model).stem if model.endswith(".gguf") else model


def _summary_task(piece: dict) -> str:
    """``xsum`` for ``.../xsum_0shot.jsonl`` (the request files' own names), else the source as given;
    ``xsum (chat)`` when the prompts went through the chat template."""
    stem = Path(str(piece.get("source") or "summaries")).stem
    task = stem[: -len("_0shot")] if stem.endswith("_0shot") else stem
    # prompts in the chat template are another experiment: never merged with raw-prompt rows
    return f"{task} (chat)" if (piece.get("settings") or {}).get("chat") else task


def summary_rows(piece: dict, source: str) -> list[dict]:
    """Rows of one ``eval summarize`` JSON: ROUGE-1/2/L with standard errors (computed from the
    piece's samples when an older piece lacks them) and ``rougeL_vs_full``."""
    from h2okv.eval.summarize import rouge_scores

    settings = piece.get("settings") or {}
    samples = piece.get("samples") or []
    rows = []
    for policy, result in piece["results"].items():
        metrics = {k: result[k] for k in (*ROUGE_TYPES, "rougeL_vs_full") if k in result}
        metrics.update({f"{k}_stderr": result[f"{k}_stderr"] for k in ROUGE_TYPES if f"{k}_stderr" in result})
        if samples and not any(k.endswith("_stderr") for k in metrics):
            scores = rouge_scores([s["predictions"][policy] for s in samples], [s["reference"] for s in samples])
            metrics.update({f"{k}_stderr": scores[f"{k}_stderr"] for k in ROUGE_TYPES})
        rows.append({
            "model": _model_label(settings),
            "task": _summary_task(piece),
            "shots": settings.get("shots"),
            "policy": policy,
            "budget": 1.0 if policy == "full" else settings.get("budget"),
            "items": result.get("items"),
            "metrics": metrics,
            "split": None,
            "source": source,
            # per-article texts, to pair this policy with full when they ran in different pieces
            "summaries": {"ids": [s["id"] for s in samples], "references": [s["reference"] for s in samples],
                          "predictions": [s["predictions"][policy] for s in samples]} if samples else None,
        })
    return rows


def rows_of_piece(piece: dict, source: str) -> list[dict]:
    """Rows ``{model, task, shots, policy, budget, items, metrics, source}`` of one ``eval tasks`` or
    ``eval summarize`` JSON."""
    settings = piece.get("settings") or {}
    if "results" not in piece:
        raise H2OError(f"{source}: not an `h2okv eval tasks` or `eval summarize` result (no 'results')")
    if settings.get("eval_kind") == "summarize":
        return summary_rows(piece, source)
    budget = settings.get("budget")
    rows = []
    for policy, result in piece["results"].items():
        for task, metrics in result.get("tasks", {}).items():
            picked = (result.get("picked") or {}).get(task)
            items = metrics.get("items") or (len(picked) if picked else None)
            rows.append({
                "model": _model_label(settings),
                "task": task,
                "shots": settings.get("num_fewshot"),
                "policy": policy,
                "budget": 1.0 if policy == "full" else budget,
                "items": items,
                "metrics": {k: v for k, v in metrics.items() if k != "items"},
                "split": ((piece.get("offline_data") or {}).get(task) or {}).get("evaluated_split"),
                "source": source,
                "picked": picked,
            })
    return rows


def merge(paths: list[str]) -> list[dict]:
    merged: dict[tuple, dict] = {}
    for path in paths:
        try:
            piece = json.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise H2OError(f"piece not found: {path}") from None
        except json.JSONDecodeError as exc:
            raise H2OError(f"{path}: not valid JSON ({exc.msg})") from None
        for row in rows_of_piece(piece, str(path)):
            merged[(row["model"], row["task"], row["shots"], row["policy"], row["budget"])] = row
    _agreement_across_pieces(merged)
    _summaries_paired_with_full(merged)
    return sorted(merged.values(), key=lambda r: (r["model"], r["task"], str(r["shots"]), _policy_rank(r["policy"]),
                                                  -(r["budget"] or 0)))


def _agreement_across_pieces(merged: dict) -> None:
    """A policy run in its own piece (one policy per process, so that a long grid finishes in parts)
    still gets ``agree_with_full``: the fraction of items on which it picked full's answer, from the
    two pieces' per-item choices, when both cover the same number of items (``--limit N`` takes the
    first N, so the same items).
    Drops the per-item lists afterwards."""
    for (model, task, shots, policy, _), row in merged.items():
        full = merged.get((model, task, shots, "full", 1.0))
        mine, theirs = row.get("picked"), (full or {}).get("picked")
        if policy != "full" and "agree_with_full" not in row["metrics"] and mine and theirs \
                and len(mine) == len(theirs):
            row["metrics"]["agree_with_full"] = sum(a == b for a, b in zip(mine, theirs, strict=True)) / len(mine)
        elif policy == "full" and mine and "agree_with_full" not in row["metrics"]:
            row["metrics"]["agree_with_full"] = 1.0
    for row in merged.values():
        row.pop("picked", None)


def _summaries_paired_with_full(merged: dict) -> None:
    """For each summarization row, compared article by article with full's row (same articles, from
    the same piece or another): ``rougeL_vs_full`` and ``same_as_full`` (how much eviction changed
    what was written) when the piece lacked them, and ``<rouge>_minus_full`` ± stderr, the mean
    paired difference of the policy's and full's ROUGE against the reference. The paired difference
    is the honest test of "matches full": two means each ± 0.008 can differ by a consistent 0.02.
    Drops the texts afterwards."""
    from h2okv.eval.summarize import fidelity, mean_and_stderr, rouge_per_item

    for (model, task, shots, policy, _), row in merged.items():
        full = merged.get((model, task, shots, "full", 1.0))
        mine, theirs = row.get("summaries"), (full or {}).get("summaries")
        if policy == "full" or not mine or not theirs or mine["ids"] != theirs["ids"]:
            continue
        metrics = row["metrics"]
        if "rougeL_vs_full" not in metrics:
            metrics.update(fidelity(mine["predictions"], theirs["predictions"]))
        own = rouge_per_item(mine["predictions"], mine["references"])
        base = rouge_per_item(theirs["predictions"], theirs["references"])
        for name in ROUGE_TYPES:
            diffs = [a - b for a, b in zip(own[name], base[name], strict=True)]
            metrics[f"{name}_minus_full"], metrics[f"{name}_minus_full_stderr"] = mean_and_stderr(diffs)
    for row in merged.values():
        row.pop("summaries", None)


def _policy_rank(policy: str) -> int:
    return POLICY_ORDER.index(policy) if policy in POLICY_ORDER else len(POLICY_ORDER)


def _cell(metrics: dict, name: str) -> str:
    if name not in metrics:
        return "–"
    err = metrics.get(f"{name}_stderr")
    return f"{metrics[name]:.3f}" + (f" ± {err:.3f}" if isinstance(err, (int, float)) else "")


def markdown_table(rows: list[dict], budget: float = 0.2) -> str:
    """One table per (model, shots): task (and metric) x policy at ``budget`` (full: no budget)."""
    out = []
    keys = sorted({(r["model"], str(r["shots"])) for r in rows})
    for model, shots in keys:
        mine = [r for r in rows if r["model"] == model and str(r["shots"]) == shots
                and (r["policy"] == "full" or r["budget"] == budget)]
        policies = sorted({r["policy"] for r in mine}, key=_policy_rank)
        tasks = sorted({r["task"] for r in mine})
        if not tasks:
            continue
        out.append(f"**{model}**, {shots}-shot, evicting policies at {budget:.0%} of each context "
                   f"({budget / 2:.0%} heavy + {budget / 2:.0%} recent for h2o)\n")
        out.append("| task | items | metric | " + " | ".join(policies) + " |")
        out.append("|---|---|---|" + "---|" * len(policies))
        for task in tasks:
            cells = {r["policy"]: r for r in mine if r["task"] == task}
            items = sorted({r["items"] for r in cells.values() if r["items"]})
            metrics = [m for m in ("acc", "acc_norm", "agree_with_full", *ROUGE_TYPES, "rougeL_minus_full", "rougeL_vs_full")
                       if any(m in r["metrics"] for r in cells.values())]
            for metric in metrics:
                line = [task, "/".join(map(str, items)) or "?", metric]
                line += [_cell(cells[p]["metrics"], metric) if p in cells else "–" for p in policies]
                out.append("| " + " | ".join(line) + " |")
        out.append("")
    return "\n".join(out)


def plot_budget_sweep(rows: list[dict], path, metric: str = "acc", model: str | None = None):
    """Accuracy vs KV budget, one panel per task (the model with the most rows unless given)."""
    if model is None:
        counts = {}
        for r in rows:
            counts[r["model"]] = counts.get(r["model"], 0) + 1
        model = max(counts, key=counts.get)
    mine = [r for r in rows if r["model"] == model and metric in r["metrics"]]
    tasks = sorted({r["task"] for r in mine})
    if not tasks:
        raise H2OError(f"no rows with {metric!r} for model {model!r} to plot")
    ncols = min(3, len(tasks))
    nrows = (len(tasks) + ncols - 1) // ncols
    fig, axes = new_figure(ncols=ncols, nrows=nrows, width=4.2, height=3.4)
    for k, task in enumerate(tasks):
        ax = axes[k // ncols][k % ncols]
        cells = [r for r in mine if r["task"] == task]
        items = sorted({r["items"] for r in cells if r["items"]})
        for policy in sorted({r["policy"] for r in cells}, key=_policy_rank):
            points = sorted((r["budget"], r["metrics"][metric], r["metrics"].get(f"{metric}_stderr") or 0)
                            for r in cells if r["policy"] == policy)
            if policy == "full":
                level, err = points[-1][1], points[-1][2]
                ax.axhline(level, color=policy_color("full"), linestyle="--", label="full")
                ax.axhspan(level - err, level + err, color="0.85", zorder=0)
                continue
            xs = [100 * b for b, _, _ in points]
            ax.errorbar(xs, [v for _, v, _ in points], yerr=[e for _, _, e in points], marker="o", capsize=2,
                        label=policy, color=policy_color(policy))
        ax.set_xscale("log")
        ax.set_xticks([5, 10, 20, 50, 100], ["5", "10", "20", "50", "100"])
        ax.set_xlabel("KV budget (% of context)")
        ax.set_ylabel(metric)
        ax.set_title(f"{task} ({'/'.join(map(str, items)) or '?'} items per point)", fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for k in range(len(tasks), nrows * ncols):
        axes[k // ncols][k % ncols].axis("off")
    has_err = any(r["metrics"].get(f"{metric}_stderr") for r in mine)
    note = " (error bars: lm-eval stderr; grey band: full ± stderr)" if has_err else " (paired with full on the same items)"
    fig.suptitle(f"{model}: {metric} vs KV budget{note}", fontsize=10)
    return save_figure(fig, path)


def plot_summaries(rows: list[dict], path, budget: float = 0.2):
    """ROUGE-1/2/L ± stderr of the summarization rows at ``budget`` (full: no budget), one panel per
    (model, task, shots), a bar group per ROUGE type and a bar per policy."""
    from h2okv.eval.summarize import rouge_bars

    mine = [r for r in rows if "rougeL" in r["metrics"] and (r["policy"] == "full" or r["budget"] == budget)]
    panels = sorted({(r["model"], r["task"], str(r["shots"])) for r in mine})
    if not panels:
        raise H2OError(f"no summarization rows at budget {budget} to plot")
    fig, axes = new_figure(ncols=len(panels), width=4.4, height=3.6)
    for ax, (model, task, shots) in zip(axes[0], panels, strict=True):
        cells = sorted((r for r in mine if (r["model"], r["task"], str(r["shots"])) == (model, task, shots)),
                       key=lambda r: _policy_rank(r["policy"]))
        rouge_bars(ax, {r["policy"]: r["metrics"] for r in cells})
        items = "/".join(map(str, sorted({r["items"] for r in cells if r["items"]}))) or "?"
        ax.set_title(f"{model}: {task}, {shots}-shot, {items} articles", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"Summarization with {budget:.0%} of each prompt's KV cache (full: all of it)", fontsize=10)
    return save_figure(fig, path)
