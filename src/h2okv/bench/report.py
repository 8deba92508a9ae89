"""Turning a benchmark result into a Markdown report, target checks and PNG plots."""

from __future__ import annotations

import json
import math
from pathlib import Path

MIB = 1024 * 1024


def write_report(result: dict, report: str, json_file=None, markdown_file=None) -> list[Path]:
    """Write a benchmark's JSON and its Markdown report (beside the JSON unless named); return the
    paths written. Neither named: nothing is written (the report was printed)."""
    outputs = []
    if json_file:
        outputs.append((Path(json_file), json.dumps(result, indent=2) + "\n"))
    if markdown_file or json_file:
        outputs.append((Path(markdown_file) if markdown_file else Path(json_file).with_suffix(".md"), report))
    for path, text in outputs:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return [path for path, _ in outputs]

# (name, what it checks, threshold, "<=" or ">=") — the project's goals for this benchmark
TARGETS = (
    ("h2o_vs_reference_step", "H2O step / reference step (bookkeeping overhead), every row", 1.10, "<="),
    ("h2o_vs_reference_step_cpu", "the same in CPU time per step (what other jobs cannot inflate)", 1.10, "<="),
    ("h2o_vs_full_throughput", "H2O / full decode tokens/s at the largest batch and context", 2.0, ">="),
    ("h2o_vs_full_prefill", "H2O / full prefill time at the longest prompt", 1.30, "<="),
    ("h2o_prefill_peak_exponent", "growth exponent of H2O's prefill peak memory in prompt length (1 = linear, 2 = quadratic)", 1.3, "<="),
    ("h2o_vs_full_kv_bytes", "H2O / full KV bytes, every row", 0.21, "<="),
    ("cap_h2o_vs_full_batch", "under the memory cap: H2O's max batch / full's", 4.5, ">="),
    ("cap_h2o_vs_full_throughput", "under the memory cap: H2O tokens/s / full's, each at its max batch", 3.0, ">="),
)


def growth_exponent(points: list[tuple[int, int]]) -> float | None:
    """Least-squares slope of log(peak) on log(length): 1 for linear growth, 2 for quadratic."""
    pts = [(math.log(n), math.log(p)) for n, p in points if n > 0 and p > 0]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    den = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / den if den else None


def check_targets(result: dict) -> list[dict]:
    summary = result["summary"]
    values: dict[str, tuple[float | None, str]] = {}
    rows = summary["rows"]
    if rows:
        worst = max(rows, key=lambda r: r["h2o_vs_reference_step"])
        values["h2o_vs_reference_step"] = (
            worst["h2o_vs_reference_step"], f"worst row: batch {worst['batch']}, context {worst['context']}"
        )
        if all("h2o_vs_reference_step_cpu" in r for r in rows):
            cpu = max(rows, key=lambda r: r["h2o_vs_reference_step_cpu"])
            values["h2o_vs_reference_step_cpu"] = (
                cpu["h2o_vs_reference_step_cpu"], f"worst row: batch {cpu['batch']}, context {cpu['context']}"
            )
        big = max(rows, key=lambda r: (r["batch"], r["context"]))
        values["h2o_vs_full_throughput"] = (
            big["h2o_vs_full_throughput"], f"batch {big['batch']}, context {big['context']}"
        )
        kv = max(rows, key=lambda r: r["h2o_vs_full_kv_bytes"])
        values["h2o_vs_full_kv_bytes"] = (kv["h2o_vs_full_kv_bytes"], f"worst row: batch {kv['batch']}, context {kv['context']}")
    prefill = summary["prefill"]
    if prefill:
        longest = max(prefill, key=lambda r: r["context"])
        values["h2o_vs_full_prefill"] = (longest["h2o_vs_full_prefill"], f"context {longest['context']}")
        exp = growth_exponent([(r["context"], r["h2o_peak_mem_bytes"]) for r in prefill])
        ctxs = ", ".join(str(r["context"]) for r in prefill)
        values["h2o_prefill_peak_exponent"] = (exp, f"fit over contexts {ctxs}")
    cap = result.get("memory_cap") or {}
    if "h2o_vs_full_batch" in cap:
        values["cap_h2o_vs_full_batch"] = (
            cap["h2o_vs_full_batch"], f"h2o {cap['max_batch']['h2o']} vs full {cap['max_batch']['full']} rows"
        )
        values["cap_h2o_vs_full_throughput"] = (cap["h2o_vs_full_throughput"], f"context {cap['context']}")
    out = []
    for name, what, threshold, op in TARGETS:
        if name not in values or values[name][0] is None:
            continue
        value, where = values[name]
        met = value <= threshold if op == "<=" else value >= threshold
        out.append({"name": name, "what": what, "value": value, "threshold": threshold, "op": op, "met": met, "where": where})
    return out


def _mib(n: float) -> str:
    return f"{n / MIB:,.1f}"


def markdown(result: dict) -> str:
    """The report: settings, the decode grid and its ratios, then prefill, the memory cap and the
    targets where the result has them."""
    lines = _settings(result) + _decode_tables(result) + _prefill_table(result)
    if result.get("memory_cap"):
        lines += _memory_cap_table(result["memory_cap"])
    contexts = [r["context"] for r in result["rows"]]
    lines += _targets_table(result.get("targets") or check_targets(result), max(contexts, default=None))
    return "\n".join(lines) + "\n"


def _settings(result: dict) -> list[str]:
    from h2okv.core.budget import BudgetSpec
    env = result["environment"]
    lines = [
        f"Model `{env['model']}` on {env['device']} ({env['dtype']}, {env['threads']} threads), "
        f"budget {result['config']['budget']:.0%} (heavy = recent = {BudgetSpec.from_fraction(result['config']['budget']).heavy_ratio:.0%} of the prompt).",
        "",
        "Decode: one prefilled sequence replicated across the batch; step = median of interleaved steps.",
    ]
    extra = []
    if env.get("threads_choice"):
        extra.append(f"threads: {env['threads_choice']}")
    if env.get("loadavg_start") and env.get("loadavg_end"):
        extra.append(
            f"machine load (1/5/15-min averages) at start {', '.join(f'{x:.1f}' for x in env['loadavg_start'])}, "
            f"at end {', '.join(f'{x:.1f}' for x in env['loadavg_end'])}; wall time {result.get('wall_s', 0):.0f} s"
        )
    if extra:
        lines += ["", "; ".join(extra) + "."]
    return lines


def _decode_tables(result: dict) -> list[str]:
    lines = [
        "",
        "| policy | batch | context | kept tokens | prefill s | prefill peak MiB | step ms | step CPU ms | tokens/s | KV MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['policy']} | {r['batch']} | {r['context']} | {r['kept_tokens']} | {r['prefill_s']:.2f} | "
            f"{_mib(r['peak_mem_bytes'])} | {r['decode_step_ms']:.1f} | {r.get('decode_step_cpu_ms', float('nan')):.1f} | "
            f"{r['decode_tokens_per_s']:.1f} | {_mib(r['kv_bytes'])} |"
        )
    lines += [
        "",
        "| batch | context | h2o/full tokens/s | h2o/reference step | (CPU time) | h2o/full KV bytes | h2o/full prefill |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in result["summary"]["rows"]:
        lines.append(
            f"| {s['batch']} | {s['context']} | {s['h2o_vs_full_throughput']:.2f} | {s['h2o_vs_reference_step']:.3f} | "
            f"{s.get('h2o_vs_reference_step_cpu', float('nan')):.3f} | "
            f"{s['h2o_vs_full_kv_bytes']:.3f} | {s['h2o_vs_full_prefill']:.2f} |"
        )
    compiled = [r for r in result["rows"] if "compiled_decode_step_ms" in r]
    if compiled:  # bench --compile: the same steps through torch.compile, in the same rounds
        lines += ["", f"Compiled (`--compile {result['config'].get('compile')}`), beside eager:", "",
                  "| policy | batch | context | eager step ms | compiled step ms | compiled/eager | compiled CPU ms |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for r in compiled:
            lines.append(
                f"| {r['policy']} | {r['batch']} | {r['context']} | {r['decode_step_ms']:.1f} | "
                f"{r['compiled_decode_step_ms']:.1f} | {r['compiled_decode_step_ms'] / r['decode_step_ms']:.3f} | "
                f"{r['compiled_decode_step_cpu_ms']:.1f} |")
        lines += ["", "| batch | context | h2o/reference step, compiled | h2o compiled/eager |", "|---:|---:|---:|---:|"]
        for s in result["summary"]["rows"]:
            if "h2o_vs_reference_step_compiled" in s:
                lines.append(f"| {s['batch']} | {s['context']} | {s['h2o_vs_reference_step_compiled']:.3f} | "
                             f"{s['h2o_compiled_vs_eager_step']:.3f} |")
    return lines


def _prefill_table(result: dict) -> list[str]:
    if not result["summary"]["prefill"]:
        return []
    lines = [
        "",
        "Prefill (batch 1, whole prompt in one forward call; peak = memory growth during it):",
        "",
        "| context | full s | h2o s | h2o/full | full peak MiB | h2o peak MiB |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    times = {(r["policy"], r["context"]): r["prefill_s"] for r in result["prefill"]}
    for p in result["summary"]["prefill"]:
        c = p["context"]
        lines.append(
            f"| {c} | {times[('full', c)]:.2f} | {times[('h2o', c)]:.2f} | {p['h2o_vs_full_prefill']:.2f} | "
            f"{_mib(p['full_peak_mem_bytes'])} | {_mib(p['h2o_peak_mem_bytes'])} |"
        )
    return lines


def _memory_cap_table(cap: dict) -> list[str]:
    lines = [
        "",
        f"Memory cap {_mib(cap['cap_bytes'])} MiB of KV at context {cap['context']} "
        f"({cap['kv_bytes_per_token']} bytes per token; full needs {cap['full_tokens_per_row']} tokens per row, "
        f"h2o {cap['h2o_slots_per_row']} slots):",
        "",
        "| policy | max batch | KV MiB (measured) | fits | step ms | tokens/s |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for policy in ("full", "h2o"):
        m = cap.get("measured", {}).get(policy)
        b = cap["max_batch"][policy]
        if m:
            lines.append(
                f"| {policy} | {b} | {_mib(m['kv_bytes'])} | {'yes' if m['fits'] else 'NO'} | "
                f"{m['decode_step_ms']:.1f} | {m['decode_tokens_per_s']:.1f} |"
            )
        else:
            lines.append(f"| {policy} | {b} | - | - | - | - |")
    return lines


# the shortest prompt of the default grid, which the targets were set for
GOAL_CONTEXT = 2048


def _targets_table(targets: list[dict], longest_context: int | None = None) -> list[str]:
    """The targets, each with what it checks, and a note on what a miss (``NO``) means."""
    if not targets:
        return []
    lines = ["", "Targets: the project's goals for H2O, set for the default grid (reference = a plain cache holding "
             "as many tokens as H2O keeps).", "",
             "| target | what it checks | value | goal | met | where |", "|---|---|---:|---:|---|---|"]
    for t in targets:
        lines.append(f"| {t['name']} | {t.get('what', '')} | {t['value']:.3f} | {t['op']} {t['threshold']} | "
                     f"{'yes' if t['met'] else 'NO'} | {t['where']} |")
    if all(t["met"] for t in targets):
        return lines
    lines += [
        "",
        "NO = missed on this run: the measured value is on the wrong side of the goal. It is not an error. "
        f"The goals are set for the default grid (prompts of {GOAL_CONTEXT:,} and {2 * GOAL_CONTEXT:,} tokens, "
        "batch 1 and 8) on an idle machine. On shorter prompts H2O's fixed bookkeeping per step is a larger share "
        "of the step and the full cache is still small, so the speed goals miss there; wall-clock ratios also move "
        "with other jobs on the machine (the CPU-time row is the steadier one). h2o_vs_full_kv_bytes misses only "
        "when H2O keeps more slots than the budget's share of the prompt (a minimum slot count on a short prompt, "
        "or a bug).",
    ]
    if longest_context is not None and longest_context < GOAL_CONTEXT:
        lines += ["", f"This run's longest prompt is {longest_context} tokens (the default grid's shortest is "
                      f"{GOAL_CONTEXT:,}): read its speed targets as a smoke test, not a verdict."]
    return lines


def _context_axis(ax, contexts: list[int]) -> None:
    """Log-2 x axis labelled with the measured context lengths themselves."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [str(c) for c in contexts])
    ax.minorticks_off()
    if len(contexts) == 1:
        ax.set_xlim(contexts[0] / 1.5, contexts[0] * 1.5)


def plot(result: dict, directory: str | Path, prefix: str = "bench") -> list[Path]:
    """Throughput and KV memory vs context per policy (one line per batch), plus prefill peak memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rows = result["rows"]
    batches = sorted({r["batch"] for r in rows})
    contexts = sorted({r["context"] for r in rows})
    policies = [p for p in ("full", "h2o", "reference") if any(r["policy"] == p for r in rows)]
    styles = {"full": "o-", "h2o": "s-", "reference": "^--"}
    paths = []

    def series(policy, batch, key):
        pts = sorted((r["context"], r[key]) for r in rows if r["policy"] == policy and r["batch"] == batch)
        return [p[0] for p in pts], [p[1] for p in pts]

    # (row key, scale, panel title, y label, file suffix)
    panels = [
        ("decode_tokens_per_s", 1, "decode throughput", "tokens / s", "throughput"),
        ("kv_bytes", MIB, "KV cache memory", "MiB", "kv_memory"),
    ]
    for key, scale, title, ylabel, suffix in panels:
        fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
        for ax, batch in zip(axes[0], batches):
            for policy in policies:
                x, y = series(policy, batch, key)
                ax.plot(x, [v / scale for v in y], styles[policy], label=policy)
            ax.set(title=f"{title}, batch {batch}", xlabel="context (tokens)", ylabel=ylabel)
            _context_axis(ax, contexts)
            _finish_axis(ax)
        paths.append(_save(plt, fig, directory / f"{prefix}_{suffix}.png"))

    prefill = result.get("prefill") or []
    if prefill:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        for policy in ("full", "h2o"):
            pts = sorted((r["context"], r["peak_mem_bytes"], r["prefill_s"]) for r in prefill if r["policy"] == policy)
            a1.plot([p[0] for p in pts], [p[1] / MIB for p in pts], styles[policy], label=policy)
            a2.plot([p[0] for p in pts], [p[2] for p in pts], styles[policy], label=policy)
        a1.set(title="prefill peak memory (growth above baseline)", xlabel="prompt tokens", ylabel="MiB")
        a2.set(title="prefill time, batch 1", xlabel="prompt tokens", ylabel="seconds")
        for ax in (a1, a2):
            _finish_axis(ax)
        paths.append(_save(plt, fig, directory / f"{prefix}_prefill.png"))
    return paths


def _finish_axis(ax) -> None:
    ax.set_ylim(bottom=0)
    ax.legend()


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
