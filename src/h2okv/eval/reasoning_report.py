"""``h2okv eval reasoning-report``: ``eval reasoning`` pieces merged into one table and one plot.

Pieces may split a grid by policy, by budget or by problem range; rows are keyed by (model, task,
prompt style, policy, budget, problem id), and a problem graded twice keeps its last row. Per
(policy, budget):

- accuracy and its standard error (lm-eval's ``mean_stderr``: sample standard deviation / sqrt(n));
- agreement with full: the share of problems whose final answer equals full's on the same problem
  (both without an answer counts as agreeing), over the problems full also ran;
- mean generated length (does eviction make answers longer?), mean prompt + answer length;
- mean KV bytes a problem's cache holds at its end (live slots), and generated tokens per second
  over the batches that ran it (prefill included), per wall-clock second and per second of the
  process's CPU time (on a shared machine the second does not count the time other jobs took).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from h2okv.errors import H2OError
from h2okv.eval.answers import INVALID, extract_answer, is_correct
from h2okv.eval.output import format_table
from h2okv.eval.plots import new_figure, policy_color, save_figure
from h2okv.eval.reasoning import PIECE_FORMAT, budget_label, split_label

GROUP = ("model", "task", "style")  # what a table and a panel are about


def read_piece(path: str | Path) -> dict:
    try:
        piece = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise H2OError(f"cannot read piece {str(path)!r}: {exc}") from None
    if not isinstance(piece, dict) or piece.get("format") != PIECE_FORMAT:
        raise H2OError(f"{path} is not an `h2okv eval reasoning` piece (format {PIECE_FORMAT})")
    return piece


def graded(row: dict) -> dict:
    """A peer's row (``tools/peer/run_kvpress.py``) carries the answer's text and no grade: it is
    graded here, by the same ``answers.py`` functions as ours, so both sides are graded alike."""
    if row.get("predicted") is not None:
        return row
    if not isinstance(row.get("text"), str):
        raise H2OError(f"row {row.get('policy')} / problem {row.get('id')} has neither a grade nor the answer's text")
    predicted = extract_answer(row["task"], row["text"])
    return {**row, "predicted": predicted, "correct": is_correct(row["task"], predicted, row["gold"])}


def merge(paths) -> tuple[list[dict], list[dict]]:
    """``(rows, batches)`` of all pieces; a problem graded twice under the same setup keeps its last row."""
    rows: dict[tuple, dict] = {}
    batches = []
    for path in paths:
        piece = read_piece(path)
        for row in map(graded, piece["rows"]):
            rows[tuple(row[k] for k in GROUP) + (row["policy"], row["budget"], row["id"])] = row
        batches += [{**{k: piece["setup"][k] for k in GROUP}, **b} for b in piece["batches"]]
    return list(rows.values()), batches


def common_problems(rows: list[dict]) -> list[dict]:
    """The rows of the problems that every (policy, budget) of their (model, task, style) ran: pieces
    stopped at different problems (a screening of the first N, a piece still running) are then
    compared problem for problem, and accuracy differences are not differences of problem sets."""
    ran = defaultdict(lambda: defaultdict(set))
    for row in rows:
        ran[tuple(row[k] for k in GROUP)][row["policy"], row["budget"]].add(row["id"])
    common = {group: set.intersection(*cells.values()) for group, cells in ran.items()}
    return [r for r in rows if r["id"] in common[tuple(r[k] for k in GROUP)]]


def _same_answer(task: str, a: str, b: str) -> bool:
    return (a == INVALID and b == INVALID) or is_correct(task, a, b)


def _budget_order(budget) -> tuple:
    return (0, 0.0) if budget is None else (1 if isinstance(budget, float) else 2, float(budget))


def summarize(rows: list[dict], batches: list[dict]) -> list[dict]:
    """One summary per (model, task, style, policy, budget), full first, then by policy and budget."""
    from lm_eval.api.metrics import mean_stderr

    cells = defaultdict(list)
    for row in rows:
        cells[tuple(row[k] for k in GROUP) + (row["policy"], row["budget"])].append(row)
    full = {tuple(r[k] for k in GROUP) + (r["id"],): r["predicted"] for r in rows if r["budget"] is None}
    speed = defaultdict(lambda: [0, 0.0, 0.0])
    for b in batches:
        key = tuple(b[k] for k in GROUP) + (b["policy"], b["budget"])
        speed[key][0] += b["new_tokens"]
        speed[key][1] += b["seconds"]
        speed[key][2] += b.get("cpu_seconds") or float("nan")  # pieces from before it was recorded: unknown
    out = []
    for key, group in cells.items():
        n = len(group)
        scores = [float(r["correct"]) for r in group]
        paired = [(r, full[key[:3] + (r["id"],)]) for r in group if key[:3] + (r["id"],) in full]
        tokens, seconds, cpu_seconds = speed[key]
        out.append({
            **dict(zip(GROUP, key[:3], strict=True)), "policy": key[3], "budget": key[4], "n": n,
            "accuracy": sum(scores) / n, "stderr": mean_stderr(scores) if n > 1 else None,
            "agreement": (sum(_same_answer(key[1], r["predicted"], f) for r, f in paired) / len(paired)) if paired else None,
            "mean_new_tokens": sum(r["new_tokens"] for r in group) / n,
            "mean_final_length": sum(r["prompt_tokens"] + r["new_tokens"] for r in group) / n,
            "hit_max_new_tokens": sum(r["finish"] == "length" for r in group) / n,
            "mean_kv_bytes": sum(r["kv_bytes"] for r in group) / n,
            # of a full 16-bit cache of each problem's final length (rows written before it was
            # recorded: their float slots' share of the tokens, the same thing; else None)
            "mean_kv_share_16bit": (sum(_share_16bit(r) for r in group) / n
                                    if all(_share_16bit(r) is not None for r in group) else None),
            "tokens_per_s": tokens / seconds if seconds else None,
            "tokens_per_cpu_s": tokens / cpu_seconds if cpu_seconds and cpu_seconds == cpu_seconds else None,
        })
    out.sort(key=lambda s: (*(s[k] for k in GROUP), s["budget"] is not None, _budget_order(s["budget"]), s["policy"]))
    return out


def _share_16bit(row: dict) -> float | None:
    """A row's KV as a share of a full 16-bit cache of its final length: recorded, or for a row of
    float slots written before it was, its live slots over its tokens (a float slot costs a full
    cache's slot, whatever the dtype); None for a quantized row without it."""
    if "kv_share_16bit" in row:
        return row["kv_share_16bit"]
    if row.get("kv_bits") is not None or "kv_slots" not in row:
        return None
    return min(1.0, row["kv_slots"] / (row["prompt_tokens"] + row["new_tokens"]))


def summary_table(summaries: list[dict]) -> str:
    headers = ["model", "task", "style", "policy", "budget", "n", "accuracy", "agree w/ full", "gen len",
               "final len", "at max", "KV MiB", "KV of 16-bit full", "tok/s", "tok/cpu-s"]
    table = []
    for s in summaries:
        accuracy = f"{s['accuracy']:.1%}" + (f" ± {s['stderr']:.1%}" if s["stderr"] is not None else "")
        table.append([
            Path(s["model"]).name, s["task"], s["style"], s["policy"], budget_label(s["budget"]), s["n"], accuracy,
            "-" if s["agreement"] is None else f"{s['agreement']:.1%}", round(s["mean_new_tokens"], 1),
            round(s["mean_final_length"], 1), f"{s['hit_max_new_tokens']:.0%}", round(s["mean_kv_bytes"] / 2**20, 2),
            "-" if s.get("mean_kv_share_16bit") is None else f"{s['mean_kv_share_16bit']:.1%}",
            None if s["tokens_per_s"] is None else round(s["tokens_per_s"], 2),
            None if s["tokens_per_cpu_s"] is None else round(s["tokens_per_cpu_s"], 2),
        ])
    return format_table(headers, table)


def markdown_table(summaries: list[dict]) -> str:
    lines = ["| policy | budget | n | accuracy | agreement with full | generated tokens | KV at end (MiB) | tokens/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in summaries:
        se = f" ± {s['stderr']:.1%}" if s["stderr"] is not None else ""
        agree = "-" if s["agreement"] is None else f"{s['agreement']:.1%}"
        speed = "-" if s["tokens_per_s"] is None else f"{s['tokens_per_s']:.2f}"
        lines.append(f"| {s['policy']} | {budget_label(s['budget'])} | {s['n']} | {s['accuracy']:.1%}{se} | {agree} | "
                     f"{s['mean_new_tokens']:.0f} | {s['mean_kv_bytes'] / 2**20:.2f} | {speed} |")
    return "\n".join(lines)


VARIANT_MARKERS = ("s", "^", "D", "v")


# what ``plot_accuracy`` puts on x: the budget asked, the KV bytes held, or their share of a full
# 16-bit cache (so float slots of a float32 CPU run do not flatter coded ones 2x)
AXES = ("budget", "kv", "kv16")
MIB = 2**20


def full_summaries(summaries: list[dict]) -> dict:
    """Full's summary of each (model, task, style)."""
    return {tuple(s[k] for k in GROUP): s for s in summaries if s["budget"] is None}


def accuracy_lines(summaries: list[dict], x: str = "budget") -> dict:
    """What ``plot_accuracy`` draws: ``{panel: {policy: [(x, accuracy, stderr), ...]}}`` sorted by
    x, with ``"full"`` (no budget) in each panel as one point. ``x="budget"``: the budget, one panel
    per (model, task, style, budgets in slots or not), full drawn as a band; ``x="kv"``: the mean KV
    MiB held at the end of the answers, one panel per (model, task, style), so budgets given in
    slots, as fractions or as protected prompts plus slots compare at the bytes they cost."""
    if x not in AXES:
        raise H2OError(f"x axis must be one of {', '.join(AXES)}, not {x!r}")
    panels = defaultdict(lambda: defaultdict(list))
    for s in summaries:
        if s["budget"] is None:
            continue
        key = tuple(s[k] for k in GROUP) + ((isinstance(s["budget"], int),) if x == "budget" else ())
        at = _x_of(s, x)
        if at is None:
            raise H2OError(f"{s['policy']} at {budget_label(s['budget'])}: its rows hold no share of a 16-bit cache")
        panels[key][s["policy"]].append((at, s["accuracy"], s["stderr"] or 0.0))
    if not panels:
        raise H2OError("nothing to plot: the pieces hold no evicting policy's rows")
    fulls = full_summaries(summaries)
    for key, lines in panels.items():
        if (f := fulls.get(key[:3])) is not None:
            lines["full"] = [(_x_of(f, "kv" if x == "budget" else x), f["accuracy"], f["stderr"] or 0.0)]
        for points in lines.values():
            points.sort()
    return {key: dict(lines) for key, lines in panels.items()}


def _x_of(summary: dict, x: str):
    if x == "budget":
        return summary["budget"]
    if x == "kv":
        return summary["mean_kv_bytes"] / MIB
    share = summary.get("mean_kv_share_16bit")
    return 100.0 if summary["budget"] is None else None if share is None else 100 * share


def plot_accuracy(summaries: list[dict], path, x: str = "budget") -> Path:
    """Accuracy vs budget (or vs KV bytes held: ``x="kv"``), one line per policy (error bars: one
    standard error), full as a horizontal band (its accuracy ± one standard error), and with
    ``x="kv"`` also a point at the bytes it holds; one panel per ``accuracy_lines`` panel."""
    panels = accuracy_lines(summaries, x)
    fulls = full_summaries(summaries)
    fig, axes = new_figure(ncols=len(panels), width=6.0, height=4.2)
    for ax, (key, lines) in zip(axes[0], panels.items(), strict=True):
        full = lines.pop("full", None)
        if full:
            (kv, acc, se), n = full[0], fulls[key[:3]]["n"]
            ax.axhspan(acc - se, acc + se, color="black", alpha=0.12, lw=0)
            ax.axhline(acc, color="black", lw=1.2, label=f"full ({acc:.1%}, n={n})")
            if x != "budget":
                ax.plot([kv], [acc], marker="*", ms=10, color="black", ls="none")
        variants = 0
        for policy, line in lines.items():
            # a variant ("h2o recent=0.25") takes its policy's colour, hollow, in a marker of its own
            base, variant = split_label(policy)
            style = {"marker": "o"}
            if variant:
                style = {"marker": VARIANT_MARKERS[variants % len(VARIANT_MARKERS)], "mfc": "none", "ls": "--"}
                variants += 1
            xs, ys, es = zip(*line, strict=True)
            ax.errorbar(xs, ys, yerr=es, ms=5, capsize=2, label=policy, color=policy_color(base), **style)
        if x == "kv":
            ax.set_xlabel("KV cache at the end of the answer (MiB, mean over problems)")
            ax.set_xlim(left=0)
        elif x == "kv16":
            ax.set_xlabel("KV at the end of the answer, % of a full 16-bit cache (mean over problems)")
            ax.set_xlim(left=0)
        elif key[3]:
            ax.set_xscale("log", base=2)
            ticks = sorted({p[0] for line in lines.values() for p in line})
            ax.set_xticks(ticks, labels=[str(t) for t in ticks])
            ax.set_xlabel("KV budget (slots per layer and KV head)")
        else:
            ax.set_xlabel("KV budget (fraction of the prompt)")
        ax.set_ylabel("accuracy (exact match)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"{Path(key[0]).name}: {key[1]}, {key[2]}", fontsize=10)
        ax.legend(fontsize=7)
    return save_figure(fig, path)
