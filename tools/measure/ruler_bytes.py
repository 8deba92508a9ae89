"""RULER's average against the bytes a cache holds: eviction alone, quantization alone and both,
from ``eval longctx`` row files (ours and ``tools/peer/run_kvpress.py``'s, which merge).

Each configuration (a row file's label: policy or recipe, its options, its slots' coding) is
placed at the mean bytes its caches held as a share of a full **16-bit** cache of the same tokens:
a row's ``kv_share_16bit`` where it has one (quantized slots, ours or transformers'
``QuantizedCache``), else its ``kv_fraction`` (float slots: a share of a cache of the same dtype is
the same share in 16 bits), else its budget (a press's rows), and ``full`` at 100%. Printed as a
table with each configuration's RULER average, its standard error, and, against ``--versus``, the
paired difference on the prompts both ran and its standard error; ``--plot`` draws the average
against the bytes, one marker per kind::

    python tools/measure/ruler_bytes.py docs/results/longctx/test/full-2k.json docs/results/quant/longctx-test-2k-*.json \\
        --versus "recipe bounded k8v4 @ 0.2286" --plot docs/figures/quant-ruler-bytes.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from h2okv.eval.longctx.lengths import label, ruler_average, standard_error
from h2okv.eval.longctx.rows import merge_rows
from h2okv.eval.output import format_table

KINDS = ("full", "eviction alone", "quantization alone", "eviction and quantization")


def bytes_share(row: dict) -> float:
    """What a row's cache held, as a share of a full 16-bit cache of the same tokens: coded slots as
    they are, float slots as a 16-bit model holds them (a CPU row's float32 slots are its
    ``kv_fraction`` of a float32 full cache, which is the same share in 16 bits)."""
    if quantized(row) and row.get("kv_share_16bit") is not None:
        return float(row["kv_share_16bit"])
    if row.get("kv_fraction") is not None:
        return float(row["kv_fraction"])
    return float(row["budget"])


def quantized(row: dict) -> bool:
    """Whether a row's slots were coded (ours: ``kv_bits``; transformers' QuantizedCache: ``nbits``)."""
    options = row.get("cache_options") or {}
    return options.get("kv_bits") is not None or options.get("nbits") is not None


def kind(row: dict) -> str:
    """Which of ``KINDS`` a row's configuration is."""
    evicts = not row["policy"].endswith("full") and row["policy"] != "full"
    if not evicts:
        return "quantization alone" if quantized(row) else "full"
    return "eviction and quantization" if quantized(row) else "eviction alone"


def placed(rows: list[dict], versus: str | None = None) -> list[dict]:
    """One entry per configuration: its kind, bytes share, RULER average and SE, and the paired
    difference against the configuration labelled ``versus`` (and its SE) where both ran."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        name = label(row) if kind(row) in ("full", "quantization alone") else f"{label(row)} @ {row['budget']:g}"
        groups.setdefault(name, []).append(row)
    scores = {name: {(r["task"], int(r["sample"]), int(r["context"])): float(r["score"]) for r in group}
              for name, group in groups.items()}
    out = []
    for name, group in groups.items():
        average, _ = ruler_average({k[:2]: v for k, v in scores[name].items()})
        entry = {"config": name, "kind": kind(group[0]), "n": len(group),
                 "bytes": 1.0 if kind(group[0]) == "full" else statistics.fmean(bytes_share(r) for r in group),
                 "average": average, "se": standard_error({k[:2]: v for k, v in scores[name].items()})}
        if versus in scores and name != versus:
            both = scores[name].keys() & scores[versus].keys()
            diffs = {k[:2]: scores[versus][k] - scores[name][k] for k in both}
            if diffs:
                entry["versus"] = ruler_average(diffs)[0]
                entry["versus_se"] = standard_error(diffs)
        out.append(entry)
    return sorted(out, key=lambda e: (KINDS.index(e["kind"]), e["bytes"]))


def short_name(config: str) -> str:
    """A plot's label for a table's configuration: ``bounded, 8/4 bits, 23%``, ``quanto int4``."""
    import re

    name, _, budget = config.partition(" @ ")
    share = f", {float(budget):.0%}" if budget else ""
    bits = re.search(r"nbits=(\d+)", name)
    if bits:  # transformers' QuantizedCache, with or without a press
        press = name.split(" ")[0].removeprefix("kvpress-")
        return f"quanto int{bits.group(1)}" + ("" if press == "full" else f" + kvpress {press}{share}")
    ours = re.search(r"kv_bits=(\d+)", name)
    if ours:
        return f"ours, {ours.group(1)}-bit, every token"
    name = name.removeprefix("recipe ")
    name = name.replace(" k8v4", ", 8/4 bits") if " k8v4" in name else name + ", 16-bit" if budget else name
    return name + share


def plot(entries: list[dict], path: str, title: str) -> str:
    from h2okv.eval.plots import new_figure, save_figure

    fig, axes = new_figure(width=7.0)
    ax = axes[0][0]
    markers = dict(zip(KINDS, ("*", "o", "s", "D"), strict=True))
    for name in KINDS:
        mine = [e for e in entries if e["kind"] == name]
        if not mine:
            continue
        ax.errorbar([100 * e["bytes"] for e in mine], [e["average"] for e in mine],
                    yerr=[e["se"] or 0.0 for e in mine], fmt=markers[name], markersize=8, capsize=3, label=name)
        for e in mine:
            ax.annotate(short_name(e["config"]), (100 * e["bytes"], e["average"]), fontsize=7, xytext=(5, 3),
                        textcoords="offset points")
    ax.set_xscale("log")
    ticks = [5, 10, 20, 30, 50, 100]
    ax.set_xticks(ticks, [f"{t}%" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("KV bytes held, % of a full 16-bit cache of the same tokens (log)")
    ax.set_ylabel("RULER average (error bars: one SE)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="center right")
    return save_figure(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", help="eval longctx --json row files (ours and the peers')")
    p.add_argument("--versus", default=None, help="the configuration (a table label: an evicting one's with its "
                   "budget, 'recipe bounded k8v4 @ 0.2286') each other is compared with")
    p.add_argument("--plot", default=None, help="PNG to write")
    p.add_argument("--title", default="RULER's ten families against the bytes held")
    args = p.parse_args(argv)
    rows: list[dict] = []
    for path in args.files:
        rows = merge_rows(rows, json.loads(Path(path).read_text()))
    entries = placed(rows, args.versus)

    def number(value, digits=1):
        return "-" if value is None else f"{value:.{digits}f}"

    print(format_table(
        ["configuration", "kind", "n", "bytes (% of 16-bit full)", "average", "SE", f"{args.versus} minus it", "SE"],
        [[e["config"], e["kind"], e["n"], number(100 * e["bytes"]), number(e["average"]), number(e["se"]),
          number(e.get("versus")), number(e.get("versus_se"))] for e in entries]))
    if args.plot:
        print(f"wrote {plot(entries, args.plot, args.title)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
