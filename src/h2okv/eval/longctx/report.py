"""The long-context table and plot, from rows of any origin (h2okv or the kvpress adapter).

Scores are RULER's: the mean of the samples' scores x 100, per task, and their plain average over
the tasks of the group. Rows of several questions per context (``reuse.py``) get a table of their
own (reuse vs fresh per task, and the prompt tokens each read); in the summary and the plot their
question mode is named with N ("reuse, 4 per context").
"""

from __future__ import annotations

from h2okv.eval.longctx.qa import QA_TASKS
from h2okv.eval.longctx.rows import config_label, model_name, questions_of
from h2okv.eval.output import format_table
from h2okv.eval.plots import policy_color, pyplot, save_figure
from h2okv.recipes import RECIPES

MARKERS = "osD^vP*X"


def models_of(rows: list[dict]) -> str:
    """The models' folder names, for titles (``.../SmolLM2-135M-Instruct.Q4_1-...`` -> that name)."""
    return ", ".join(sorted({model_name(r) for r in rows}))


def question_label(row: dict) -> str:
    n = questions_of(row)
    return row["question"] if n == 1 else f"{row['question']}, {n} per context"


def label(row: dict) -> str:
    """A row's configuration name; a recipe row is named by the recipe, and by what departs from
    what the recipe means now (``rows.config_label``)."""
    recipe = row.get("recipe")
    return config_label(row["policy"], row.get("cache_options"), recipe, recipe_settings(recipe), row.get("context"))


def recipe_settings(name: str | None) -> dict | None:
    """The keywords recipe ``name`` stands for now (read only); None for none, or for a name no
    longer known."""
    recipe = RECIPES.get(name) if name else None
    return recipe.settings if recipe else None


def group_key(row: dict, by_model: bool = False) -> tuple:
    config = f"{label(row)} ({model_name(row)})" if by_model else label(row)
    return question_label(row), config, float(row["budget"]), int(row["context"])


def summarize(rows: list[dict]) -> list[dict]:
    """One entry per (question, configuration, budget, context): per-task scores and their average;
    with rows of several models, per model too (the configuration names it)."""
    by_model = len({model_name(r) for r in rows}) > 1
    groups: dict[tuple, dict[str, list[float]]] = {}
    for row in rows:
        groups.setdefault(group_key(row, by_model), {}).setdefault(row["task"], []).append(float(row["score"]))
    summary = []
    for (question, config, budget, context), by_task in groups.items():
        scores = {task: 100 * sum(s) / len(s) for task, s in by_task.items()}
        summary.append({"question": question, "config": config, "budget": budget, "context": context,
                        "samples": min(len(s) for s in by_task.values()), "tasks": scores,
                        "average": sum(scores.values()) / len(scores)})
    return sorted(summary, key=lambda s: (s["question"], s["context"], s["config"] != "full", s["config"], -s["budget"]))


def summary_table(rows: list[dict]) -> str:
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    headers = ["question", "context", "config", "budget", "n", *tasks, "average"]
    table = [[s["question"], s["context"], s["config"], s["budget"], s["samples"],
              *(f"{s['tasks'][t]:.1f}" if t in s["tasks"] else "-" for t in tasks), f"{s['average']:.1f}"]
             for s in summarize(rows)]
    return format_table(headers, table)


def tables(rows: list[dict]) -> str:
    """The summary of one-question rows and the reuse table of the others, each where there are rows."""
    one = [r for r in rows if questions_of(r) == 1]
    many = [r for r in rows if questions_of(r) > 1]
    return "\n\n".join([*([summary_table(one)] if one else []), *([reuse_table(many)] if many else [])]) or "(no rows)"


def reuse_table(rows: list[dict]) -> str:
    """Several questions per context: per (context, configuration, budget, N) and task, the score of
    reuse (one question-agnostic read) and of fresh (a question-aware read per question), and the
    prompt tokens each read per context (mean over samples); an average line over several tasks."""
    groups: dict[tuple, dict[str, dict[str, list[dict]]]] = {}
    for row in rows:
        key = (int(row["context"]), label(row), float(row["budget"]), questions_of(row))
        groups.setdefault(key, {}).setdefault(row["task"], {}).setdefault(row["question"], []).append(row)
    table = []
    for key in sorted(groups, key=lambda k: (k[0], k[1] != "full", k[1], -k[2], k[3])):
        names, lines = list(groups[key]), [reuse_line(by_mode) for by_mode in groups[key].values()]
        if len(lines) > 1:
            names, lines = [*names, "average"], [*lines, average_line(lines)]
        table += [[*key, name, *(fmt.format(v) if v is not None else "-" for fmt, v in zip(REUSE_FORMATS, line))]
                  for name, line in zip(names, lines, strict=True)]
    headers = ["context", "config", "budget", "N", "task", "n", "reuse", "fresh", "tokens reuse", "tokens fresh"]
    return format_table(headers, table)


REUSE_FORMATS = ("{}", "{:.1f}", "{:.1f}", "{:.0f}", "{:.0f}")


def reuse_line(by_mode: dict[str, list[dict]]) -> list:
    """``[samples, reuse score, fresh score, reuse tokens, fresh tokens]``, None for a mode not run."""
    def mean(mode: str, field: str):
        # a peer's rows count no prompt tokens (kvpress reads each question with its document anyway)
        found = [r for r in by_mode.get(mode, ()) if r.get(field) is not None]
        return sum(float(r[field]) for r in found) / len(found) if found else None

    samples = max(len({r["sample"] for r in found}) for found in by_mode.values())
    scores = [mean(mode, "score") for mode in ("reuse", "fresh")]
    return [samples, *(None if s is None else 100 * s for s in scores), mean("reuse", "prefill_tokens"),
            mean("fresh", "prefill_tokens")]


def average_line(lines: list[list]) -> list:
    """The tasks' plain average per column (over the tasks that have it); the fewest samples."""
    def average(column):
        values = [v for v in column if v is not None]
        return sum(values) / len(values) if values else None

    samples, *columns = zip(*lines)
    return [min(samples), *(average(c) for c in columns)]


# a peer's press -> the h2okv policy that ranks the same way (one colour per method, two line styles)
PEER_METHODS = {"streaming": "sink", "observed": "h2o", "adakv-snapkv": "snapkv"}
PEER = "kvpress-"


def method_color(config: str) -> str | None:
    """The colour of a configuration's method: ours by policy, a peer's press by its counterpart."""
    name = config.split()[0].removeprefix(PEER)
    return policy_color(PEER_METHODS.get(name, name))


# several questions a context (eval/longctx/reuse.py): its two modes in a panel's words
MODE_WORDS = {"reuse": "context read once", "fresh": "each question read with it"}


def mode_words(question: str) -> str:
    """A panel's question mode in words: ``question aware``, ``context read once``..."""
    return MODE_WORDS.get(question, f"question {question}")


def plot_scores(rows: list[dict], path, title: str):
    """The scores, one panel per (question mode, context), one legend for all panels below them.

    One evicting budget: grouped bars, a group per task and one for the average, a bar per
    configuration, and a configuration that keeps everything (full) as a dashed black level across
    each group. Several budgets: average score vs budget, one line per configuration, full as a
    dashed horizontal line. A method has one colour: h2okv's bars are solid (lines solid, filled
    markers), the peer's (kvpress) pale and hatched (lines dotted, hollow markers); variants of one
    method differ by hatch or marker. A configuration that keeps everything evicts nothing, so the
    question mode cannot change it: it is drawn in every panel of its context (measured in one mode
    is enough)."""
    summary = summarize(rows)
    panels = sorted({(s["question"], s["context"]) for s in summary})
    keep_all = [s for s in summary if s["budget"] == 1.0]
    evicting = [s for s in summary if s["budget"] < 1.0]
    styles = config_styles(dict.fromkeys(s["config"] for s in evicting))
    budgets = sorted({s["budget"] for s in evicting})
    tasks = list(dict.fromkeys(task for s in summary for task in s["tasks"]))
    most = max((sum(1 for s in evicting if (s["question"], s["context"]) == panel) for panel in panels), default=1)
    bars = len(budgets) <= 1
    width = max(6.0, 0.16 * most * (len(tasks) + 1) + 1.5) if bars else 6.4
    fig, axes, legend_ax = figure_with_legend(len(panels), width, 4.2, len(styles) + len(keep_all))
    for ax, (question, context) in zip(axes, panels, strict=True):
        here = [s for s in evicting if (s["question"], s["context"]) == (question, context)]
        full = [s for s in keep_all if s["context"] == context]
        if bars:
            _task_bars(ax, here, full, tasks, styles)
            budget = f", {budgets[0]:.0%} budget" if budgets else ""
            ax.set_title(f"{context} tokens, {mode_words(question)}{budget}", fontsize=10)
        else:
            _budget_lines(ax, here, full, budgets, styles)
            ax.set_title(f"{context} tokens, {mode_words(question)}", fontsize=10)
    shared_legend(legend_ax, axes, 1 if len(panels) == 1 else legend_columns(width * len(panels)))
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)


# hatches that tell apart configurations of one method (one colour): h2okv's, then the peer's
HATCHES = ("", "..", "xx", "oo", "--", "++")
PEER_HATCHES = ("////", "\\\\\\\\", "xxxx", "....")
FALLBACK_COLORS = ("tab:gray", "gold", "teal", "navy", "lime", "crimson")


def config_styles(configs) -> dict[str, dict]:
    """Each configuration's colour (its method's), whether it is the peer's, its variant (the
    how-many-th of h2okv's, or of the peer's, configurations in that colour: its hatch), and its
    index (its line's marker)."""
    styles, seen = {}, {}
    for index, config in enumerate(configs):
        color = method_color(config) or FALLBACK_COLORS[index % len(FALLBACK_COLORS)]
        peer = config.startswith(PEER)
        variant = seen.get((color, peer), 0)
        seen[(color, peer)] = variant + 1
        styles[config] = {"color": color, "peer": peer, "variant": variant, "index": index}
    return styles


def figure_with_legend(panels: int, width: float, height: float, entries: int):
    """``(fig, panel axes, legend axes)``: the panels side by side and the one legend in axes of
    its own, so it covers no panel: below the panels, as wide as the figure, or for a single panel
    beside it (one column of labels beneath a narrow panel would be taller than the panel)."""
    plt = pyplot()
    if panels == 1:
        fig = plt.figure(figsize=(width + LEGEND_WIDTH, max(height, 0.5 + 0.2 * entries)))
        grid = fig.add_gridspec(1, 2, width_ratios=[width, LEGEND_WIDTH])
        axes, legend_ax = [fig.add_subplot(grid[0, 0])], fig.add_subplot(grid[0, 1])
    else:
        legend_height = 0.3 + 0.2 * -(-max(entries, 1) // legend_columns(width * panels))
        fig = plt.figure(figsize=(width * panels, height + legend_height))
        grid = fig.add_gridspec(2, panels, height_ratios=[height, legend_height])
        axes, legend_ax = [fig.add_subplot(grid[0, i]) for i in range(panels)], fig.add_subplot(grid[1, :])
    legend_ax.axis("off")
    return fig, axes, legend_ax


# inches of one legend column: a long label ("snapkv:window=1,... [recent_share=0.05]") is ~4 in
LEGEND_WIDTH = 4.6


def legend_columns(figure_width: float) -> int:
    return max(1, int(figure_width // LEGEND_WIDTH))


def shared_legend(legend_ax, axes, columns: int) -> None:
    """One legend for every panel: each label once, in the order first drawn."""
    entries = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    if entries:
        legend_ax.legend(entries.values(), entries.keys(), loc="center", ncol=columns, fontsize=7.5, frameon=False)


def _task_bars(ax, here: list[dict], full: list[dict], tasks: list[str], styles: dict) -> None:
    """A group of bars per task and one for the average; each keep-everything configuration a
    dashed level across each group."""
    from matplotlib.colors import to_rgb

    groups = [*tasks, "average"]
    configs = [config for config in styles if any(s["config"] == config for s in here)]
    step = 0.8 / max(len(configs), 1)
    for slot, config in enumerate(configs):
        entry = next(s for s in here if s["config"] == config)
        style = styles[config]
        values = [entry["average"] if g == "average" else entry["tasks"].get(g, float("nan")) for g in groups]
        x = [g + (slot - (len(configs) - 1) / 2) * step for g in range(len(groups))]
        if style["peer"]:
            pale = tuple(0.7 + 0.3 * c for c in to_rgb(style["color"]))
            look = {"color": pale, "edgecolor": style["color"],
                    "hatch": PEER_HATCHES[style["variant"] % len(PEER_HATCHES)]}
        else:
            look = {"color": style["color"], "edgecolor": "white", "hatch": HATCHES[style["variant"] % len(HATCHES)]}
        ax.bar(x, values, width=step, label=config, linewidth=0.6, **look)
        for where, value in zip(x, values):
            if value == 0:  # a bar of height 0 is invisible: say it scored nothing
                ax.text(where, 0.5, "0", ha="center", va="bottom", fontsize=6, color=style["color"])
    for entry in full:
        levels = [(g, entry["average"] if name == "average" else entry["tasks"].get(name))
                  for g, name in enumerate(groups)]
        levels = [(g, level) for g, level in levels if level is not None]
        ax.hlines([level for _, level in levels], [g - 0.45 for g, _ in levels], [g + 0.45 for g, _ in levels],
                  colors=method_color(entry["config"]) or "black", linestyles="--", linewidth=1.6,
                  label=entry["config"])
    ax.set_xticks(range(len(groups)), labels=groups, fontsize=8)
    ax.set_xlim(-0.5, len(groups) - 0.5)
    ax.set_ylim(0, 105)
    ax.set_ylabel(score_name(tasks) + " (mean over samples)")


def tasks_name(rows: list[dict]) -> str:
    """What a plot's title calls the rows' tasks: real questions, RULER-style tasks, or both."""
    real = {r["task"] in QA_TASKS for r in rows}
    return "Real questions" if real == {True} else "RULER-style tasks" if real == {False} else "RULER-style tasks and real questions"


def score_name(tasks: list[str]) -> str:
    """What the bars measure: RULER's score, or the data sets' F1 where every task is a real question's."""
    return "F1 x 100" if tasks and all(task in QA_TASKS for task in tasks) else "RULER score"


def _budget_lines(ax, here: list[dict], full: list[dict], budgets: list[float], styles: dict) -> None:
    """Average score vs budget, a line per configuration; keep-everything ones as dashed levels."""
    for entry in full:
        ax.axhline(entry["average"], color=method_color(entry["config"]) or "black", linestyle="--",
                   label=entry["config"])
    for config, style in styles.items():
        points = sorted((s["budget"], s["average"]) for s in here if s["config"] == config)
        if not points:
            continue
        index, peer = style["index"], style["peer"]
        # markers of shrinking size and different shapes: equal scores stay visible
        ax.plot(*zip(*points), marker=MARKERS[index % len(MARKERS)], markersize=max(11 - 0.5 * index, 4),
                color=style["color"], label=config, alpha=0.85, linestyle=":" if peer else "-",
                markerfacecolor="none" if peer else style["color"])
    ax.set_xlim(budgets[0] - 0.1, budgets[-1] + 0.1)
    ax.set_xticks(budgets, labels=[f"{b:.0%}" for b in budgets])
    ax.set_ylim(-3, 103)
    ax.set_xlabel("cache budget (share of the prompt)")
    ax.set_ylabel("RULER score (average over tasks)")
