"""What each configuration keeps, and what it costs, as the prompt grows: ``eval longctx`` rows
of one split (any mix of pieces) summarized per (configuration, context length), beside the full
cache's on the same prompts.

Per length and configuration:

- ``average``: RULER's average (the tasks' plain mean of sample means, x 100) over the cells it
  ran, and its standard error ``se`` (the tasks' sample variances; none with one sample a task);
  ``of_full``: that average over full's average on the *same* cells (task, sample), so a
  configuration run on fewer samples is compared on its own prompts; ``lowest``: the family with
  the lowest share of full's score (a family full scores 0 on has no share); ``paired``: its
  average less full's on those cells, and ``paired_se`` (``paired_difference``);
- the costs the rows carry (``runner.Costs``), as medians over the prompts: peak process memory
  above what was held before the batch (``peak_mib``), the KV bytes held at the end against a
  full cache's (``kv_fraction``), and the seconds to the first token and after it; ``prefill_x``:
  the median prefill time over full's median at that length (one machine's ratio; the absolute
  seconds move with its load).

The plot puts the four against the length, one line per configuration: what the recipe table
promises is read off it (``bounded``'s memory flat in the length, the others growing as full's).
"""

from __future__ import annotations

import statistics
from collections import Counter

from h2okv.eval.longctx.report import figure_with_legend, legend_columns, models_of, shared_legend
from h2okv.eval.longctx.report import label as config_of
from h2okv.eval.longctx.rows import model_name, questions_of
from h2okv.eval.output import format_table
from h2okv.eval.plots import policy_color, save_figure

FULL = "full"


def label(row: dict, main_model: str | None = None) -> str:
    """The configuration, and where it ran when not on the CPU in float32 (another machine's seconds,
    another dtype's scores) or on another model than ``main_model`` (another model's scores)."""
    config = config_of(row)
    where = [v for v, usual in ((row.get("device"), "cpu"), (row.get("dtype"), "float32")) if v and v != usual]
    if main_model is not None and model_name(row) != main_model:
        where.insert(0, model_name(row))
    return f"{config} ({' '.join(where)})" if where else config


def main_model(rows: list[dict]) -> str:
    """The model most rows ran: its lines go unlabelled, another model's name theirs."""
    return Counter(model_name(r) for r in rows).most_common(1)[0][0]


def _groups(rows: list[dict]) -> dict[tuple, list[dict]]:
    """``{(config, context): rows}`` of the one-question rows; each model's rows a group of their own
    (their ``(task, sample)`` cells are other prompts, scored by another model)."""
    main = main_model(rows) if rows else None
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if questions_of(row) == 1:
            groups.setdefault((label(row, main), int(row["context"])), []).append(row)
    return groups


def _scores(rows: list[dict]) -> dict[tuple, float]:
    """``{(task, sample): score}`` of one group's rows."""
    return {(row["task"], int(row["sample"])): float(row["score"]) for row in rows}


def ruler_average(scores: dict[tuple, float]) -> tuple[float, dict[str, float]]:
    """RULER's average of ``{(task, sample): score}`` and the per-task means, both x 100."""
    by_task = _by_task(scores)
    means = {task: 100 * sum(s) / len(s) for task, s in by_task.items()}
    return sum(means.values()) / len(means), means


def _by_task(scores: dict[tuple, float]) -> dict[str, list[float]]:
    by_task: dict[str, list[float]] = {}
    for (task, _), score in scores.items():
        by_task.setdefault(task, []).append(score)
    return by_task


def standard_error(scores: dict[tuple, float]) -> float | None:
    """The standard error of RULER's average (x 100): the tasks' means are independent, so
    ``sqrt(sum_t var_t / n_t) / T``; None where a task has a single sample (its variance unknown)."""
    by_task = _by_task(scores)
    if any(len(s) < 2 for s in by_task.values()):
        return None
    variance = sum(statistics.variance(s) / len(s) for s in by_task.values())
    return 100 * variance**0.5 / len(by_task)


def paired_difference(mine: dict[tuple, float], theirs: dict[tuple, float]) -> tuple[float, float | None, int] | None:
    """``(difference, se, n)``: RULER's average of ``mine`` less ``theirs`` over the ``n`` cells
    (task, sample) both ran, x 100, and its standard error, that of a mean over the prompts (the
    differences' ``sd / sqrt(n)``, each prompt one draw). Unlike the tasks' own variances it exists
    with one sample a family (16k, 32k), and a difference on the same prompts is what tells two
    configurations apart where their averages' SEs overlap. None when no cell is shared; no SE for
    a single cell."""
    shared = {cell: mine[cell] - theirs[cell] for cell in mine if cell in theirs}
    if not shared:
        return None
    difference, _ = ruler_average(shared)
    se = 100 * statistics.stdev(shared.values()) / len(shared) ** 0.5 if len(shared) > 1 else None
    return difference, se, len(shared)


def _median(rows: list[dict], field: str) -> float | None:
    values = [float(r[field]) for r in rows if r.get(field) is not None]
    return statistics.median(values) if values else None


def by_length(rows: list[dict]) -> list[dict]:
    """One entry per (configuration, context), full's first at each length (see the module's doc)."""
    groups = _groups(rows)
    cells = {key: _scores(group) for key, group in groups.items()}
    out = []
    for (config, context), scores in cells.items():
        average, means = ruler_average(scores)
        entry = {"config": config, "context": context, "prompts": len(scores), "tasks": len(means), "average": average,
                 "se": standard_error(scores), "of_full": None, "lowest": None, "paired": None, "paired_se": None}
        # full on the same device and dtype: a bfloat16 recipe is measured against a bfloat16 full
        full = cells.get((full_of(config), context))
        if not is_full(config) and full:
            shared = {cell: s for cell, s in scores.items() if cell in full}
            if shared:
                mine, mine_tasks = ruler_average(shared)
                theirs, full_tasks = ruler_average({cell: full[cell] for cell in shared})
                entry["of_full"] = mine / theirs if theirs else None
                shares = {task: mine_tasks[task] / full_tasks[task] for task in mine_tasks if full_tasks[task]}
                if shares:
                    task = min(shares, key=shares.get)
                    entry["lowest"] = (task, shares[task])
                entry["paired"], entry["paired_se"], _ = paired_difference(shared, full)
        for field in ("peak_mib", "kv_fraction", "prefill_s", "decode_s"):
            entry[field] = _median(groups[config, context], field)
        out.append(entry)
    fulls = {(e["config"], e["context"]): e["prefill_s"] for e in out if is_full(e["config"])}
    for entry in out:
        full_prefill = fulls.get((full_of(entry["config"]), entry["context"]))
        entry["prefill_x"] = entry["prefill_s"] / full_prefill if entry["prefill_s"] and full_prefill else None
    return sorted(out, key=lambda e: (not is_full(e["config"]), e["config"], e["context"]))


def where_of(config: str) -> str:
    """`` (cuda bfloat16)`` of a label, or ``""`` for the CPU in float32."""
    return config[config.index(" (") :] if config.endswith(")") and " (" in config else ""


def full_of(config: str) -> str:
    return FULL + where_of(config)


def is_full(config: str) -> bool:
    return config == full_of(config)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _paired(entry: dict) -> str:
    if entry["paired"] is None:
        return "-"
    return f"{entry['paired']:+.1f} ({_fmt(entry['paired_se'], '.1f')})"


def length_table(summary: list[dict], markdown: bool = False) -> str:
    headers = ["config", "context", "prompts", "average", "SE", "of full", "vs full, paired (SE)",
               "lowest family (of full)", "peak MiB", "KV of full", "prefill s", "prefill x full", "decode s"]
    lines = [[e["config"], e["context"], e["prompts"], _fmt(e["average"], ".1f"), _fmt(e["se"], ".1f"), _fmt(e["of_full"], ".0%"),
              _paired(e),
              f"{e['lowest'][0]} ({e['lowest'][1]:.0%})" if e["lowest"] else "-", _fmt(e["peak_mib"], ".0f"),
              _fmt(e["kv_fraction"], ".0%"), _fmt(e["prefill_s"], ".1f"), _fmt(e["prefill_x"], ".2f"),
              _fmt(e["decode_s"], ".1f")] for e in summary]
    if not markdown:
        return format_table(headers, lines)
    rule = "|" + "|".join("---" for _ in headers) + "|"
    return "\n".join(["| " + " | ".join(headers) + " |", rule, *("| " + " | ".join(map(str, line)) + " |" for line in lines)])


# (field, axis label, log scale): the four panels of the plot
PANELS = (
    ("average", "RULER average (full dashed)", False),
    ("peak_mib", "peak memory above the weights, MiB", True),
    ("kv_fraction", "KV held at the end, of full's", False),
    ("prefill_s", "seconds to the first token (median)", True),
)
RECIPE_COLORS = {"recipe prompt": "darkblue", "recipe document": "tab:purple", "recipe bounded": "tab:brown",
                 "recipe generation": "goldenrod", "recipe stream": "tab:olive"}


# the peers' engines and presses, each a colour no recipe or policy of ours takes
PEER_COLORS = {"kvpress-chunkkv-snapkv": "tab:cyan", "kvpress-kvzip": "tab:pink", "kvpress-snapkv": "teal",
               "openvino-full": "tab:green", "openvino-h2o-sum": "tab:red", "openvino-h2o-norm_sum": "tab:orange"}
PEERS = ("kvpress-", "openvino-")


def _color(config: str) -> str | None:
    config = config.removesuffix(where_of(config))
    name = config.split(" [")[0]
    return RECIPE_COLORS.get(name) or PEER_COLORS.get(config.split()[0]) or policy_color(config.split()[0])


def _line(config: str) -> tuple[str | tuple, str]:
    """``(line style, marker)``: full dashed, another device dotted, a peer dash-dotted with
    triangles, a recipe run with options of its own (``recipe bounded [prefill=chunked]``) in its
    recipe's colour with diamonds, so no two lines of one plot look alike."""
    if is_full(config):
        return "--", "s"
    if where_of(config):
        return ":", "o"
    if config.startswith(PEERS):
        return "-.", "^"
    if config.startswith("recipe ") and " [" in config:
        return (0, (4, 1, 1, 1)), "D"
    return "-", "o"


def plot_lengths(summary: list[dict], path, title: str):
    """The four costs against the context length (log 2), a line per configuration; full is the
    black dashed line in every panel, rows from another device or dtype are dotted."""
    configs = list(dict.fromkeys(e["config"] for e in summary))
    fig, axes, legend_ax = figure_with_legend(len(PANELS), 4.4, 3.8, len(configs))
    contexts = sorted({e["context"] for e in summary})
    for ax, (field, axis, log) in zip(axes, PANELS, strict=True):
        for config in configs:
            points = sorted((e["context"], e[field]) for e in summary if e["config"] == config and e[field] is not None)
            if not points:
                continue
            xs, ys = zip(*points, strict=True)
            full, elsewhere = is_full(config), bool(where_of(config))  # another device: dotted, hollow
            style, marker = _line(config)
            ax.plot(xs, ys, linestyle=style, marker=marker,
                    markersize=4 if full else 6, color="black" if full else _color(config),
                    markerfacecolor="white" if elsewhere else None, label=config, linewidth=1.6)
        ax.set_xscale("log", base=2)
        if log:
            ax.set_yscale("log")
        ax.set_xticks(contexts, labels=tick_labels(contexts))
        ax.minorticks_off() if not log else None
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(axis, fontsize=9)
        ax.grid(alpha=0.3)
    shared_legend(legend_ax, axes, legend_columns(4.4 * len(PANELS)))
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


def tick_labels(contexts: list[int]) -> list[str]:
    """``2k``, ``4k``, ...; two lengths a label apart (32,640 and 32,768 both read ``32k``) label once,
    where two labels would print over each other."""
    labels = [f"{round(c / 1024)}k" if c >= 1024 else str(c) for c in contexts]
    return [label if label not in labels[:i] else "" for i, label in enumerate(labels)]


def title_of(rows: list[dict]) -> str:
    splits = sorted({str(r["split"]) for r in rows if r.get("split")}) or ["none"]
    budgets = sorted({float(r["budget"]) for r in rows if float(r["budget"]) < 1})
    budget = ", ".join(f"{b:.0%}" for b in budgets) or "full only"
    return f"{models_of(rows)}, split {'/'.join(splits)}, budget {budget}"
