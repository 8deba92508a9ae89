"""The long-context table and plot, from rows of any origin (h2okv or the kvpress adapter).

Scores are RULER's: the mean of the samples' scores x 100, per task, and their plain average over
the tasks of the group.
"""

from __future__ import annotations

import re

from h2okv.eval.longctx.rows import config_label
from h2okv.eval.plots import format_table, new_figure, policy_color, save_figure

MARKERS = "osD^vP*X"


def models_of(rows: list[dict]) -> str:
    """The models' folder names, for titles (``.../SmolLM2-135M-Instruct.Q4_1-...`` -> that name)."""
    names = {str(r.get("model") or "?").rstrip("/").rsplit("/", 1)[-1] for r in rows}
    # a converted GGUF's folder ends in "-<bytes>-transformers-<version>-v<N>": not part of the name
    return ", ".join(sorted(re.sub(r"-\d+-transformers-[\w.]+-v\d+$", "", name) for name in names))


def group_key(row: dict) -> tuple:
    return row["question"], config_label(row["policy"], row.get("cache_options"), row.get("recipe")), float(row["budget"]), int(row["context"])


def summarize(rows: list[dict]) -> list[dict]:
    """One entry per (question, configuration, budget, context): per-task scores and their average."""
    groups: dict[tuple, dict[str, list[float]]] = {}
    for row in rows:
        groups.setdefault(group_key(row), {}).setdefault(row["task"], []).append(float(row["score"]))
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


# a peer's press -> the h2okv policy that ranks the same way (one colour per method, two line styles)
PEER_METHODS = {"streaming": "sink", "observed": "h2o", "adakv-snapkv": "snapkv"}
PEER = "kvpress-"


def method_color(config: str) -> str | None:
    """The colour of a configuration's method: ours by policy, a peer's press by its counterpart."""
    name = config.split()[0].removeprefix(PEER)
    return policy_color(PEER_METHODS.get(name, name))


def plot_scores(rows: list[dict], path, title: str):
    """Average score vs budget, one line per configuration, one panel per (question mode, context);
    a configuration that keeps everything is a dashed horizontal line. A method has one colour:
    h2okv's lines are solid with filled markers, the peer's (kvpress) dotted with hollow ones; the
    legend sits beside each panel, so a grid of twenty configurations hides no line."""
    summary = summarize(rows)
    panels = sorted({(s["question"], s["context"]) for s in summary})
    # a configuration that keeps everything evicts nothing, so the question mode cannot change it:
    # its line is drawn in every panel of its context (measured in one mode is enough)
    keep_all = {(s["context"], s["config"]): s["average"] for s in summary if s["budget"] == 1.0}
    entries = max((len({s["config"] for s in summary if (s["question"], s["context"]) == panel}) for panel in panels),
                  default=1)
    fig, axes = new_figure(ncols=len(panels), width=7.6, height=max(4.0, 0.22 * entries + 1.0))
    for ax, (question, context) in zip(axes[0], panels, strict=True):
        here = [s for s in summary if (s["question"], s["context"]) == (question, context) and s["budget"] < 1.0]
        for (ctx, config), average in keep_all.items():
            if ctx == context:
                ax.axhline(average, color=method_color(config) or "black", linestyle="--", label=config)
        for index, config in enumerate(dict.fromkeys(s["config"] for s in here)):
            points = sorted((s["budget"], s["average"]) for s in here if s["config"] == config)
            peer = config.startswith(PEER)
            color = method_color(config)
            # markers of shrinking size and different shapes: equal scores stay visible
            ax.plot(*zip(*points), marker=MARKERS[index % len(MARKERS)], markersize=max(11 - 0.5 * index, 4),
                    color=color, label=config, alpha=0.85, linestyle=":" if peer else "-",
                    markerfacecolor="none" if peer else color)
        budgets = sorted({s["budget"] for s in here}) or [1.0]
        ax.set_xlim(budgets[0] - 0.1, budgets[-1] + 0.1)
        ax.set_xticks(budgets, labels=[f"{b:.0%}" for b in budgets])
        ax.set_ylim(-3, 103)
        ax.set_xlabel("cache budget (share of the prompt)")
        ax.set_ylabel("RULER score (average over tasks)")
        ax.set_title(f"{context} tokens, question {question}", fontsize=10)
        ax.legend(fontsize=6.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path)
