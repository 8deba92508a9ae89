"""Perplexity against bytes: ``h2okv eval ppl --kv-bits ...`` rows placed by what their slots cost.

Each row of the given ``eval ppl`` JSON files (one text each) is placed at the bytes its cache
holds as a share of a full 16-bit cache of the same tokens: its budget (the share of the tokens
kept) times a slot's bytes (codes and float16 scales, ``core/quant.py``) over a 16-bit slot's. So
eviction alone, quantization alone (``full`` quantized) and the two together meet on one axis.
Printed as a table per text; ``--plot`` draws perplexity over full's against that share, one line
per coding, one panel per text::

    python tools/measure/quant_bytes.py "hamlet (dev)=docs/results/quant/ppl-0.5b-hamlet_gut.json,..." \\
        "macbeth (test)=..." --head-dim 64 --plot docs/figures/quant-ppl-bytes.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from h2okv.core.quant import SlotCodec
from h2okv.eval.output import format_table


def slot_share(row: dict, head_dim: int) -> float:
    """A slot's bytes (K and V) as a share of a 16-bit one's."""
    if row.get("kv_bits") is None:
        return 1.0
    group = min(row["kv_group"], head_dim)
    keys = SlotCodec(row.get("key_bits") or row["kv_bits"], group).bytes_per_vector(head_dim)
    values = SlotCodec(row["kv_bits"], group).bytes_per_vector(head_dim)
    return (keys + values) / (2 * 2 * head_dim)


def coding(row: dict) -> str:
    if row.get("kv_bits") is None:
        return "16-bit (eviction alone)"
    keys = row.get("key_bits") or row["kv_bits"]
    return f"{row['kv_bits']}-bit" if keys == row["kv_bits"] else f"keys {keys}-bit, values {row['kv_bits']}-bit"


def placed(rows: list[dict], head_dim: int) -> list[tuple[str, str, float, float, float]]:
    """``(coding, policy, budget, bytes share, ppl over full)`` per row, by coding then share."""
    out = [(coding(r), r["policy"], r["budget"], r["budget"] * slot_share(r, head_dim), r["ppl_ratio_to_full"])
           for r in rows]
    return sorted(out, key=lambda t: (t[0], t[3]))


def plot(texts: dict[str, list], path: str) -> str:
    from h2okv.eval.plots import new_figure, save_figure

    fig, axes = new_figure(ncols=len(texts), width=5.0)
    for ax, (name, points) in zip(axes[0], texts.items(), strict=True):
        for label in dict.fromkeys(p[0] for p in points):
            mine = [p for p in points if p[0] == label and p[1] != "full"]
            (line,) = ax.plot([100 * p[3] for p in mine], [p[4] for p in mine], marker="o", label=label)
            alone = [p for p in points if p[0] == label and p[1] == "full" and p[3] < 1]
            if alone:  # quantization alone: every token kept, fewer bits
                ax.scatter([100 * p[3] for p in alone], [p[4] for p in alone], marker="*", s=110,
                           color=line.get_color(), label=f"{label}, every token (quantization alone)")
        ax.axhline(1.0, color="grey", linestyle="--", label="full, 16-bit")
        ax.set_yscale("log")  # 4-bit keys sit at 2x; the rest within 1.3x
        ticks = [1, 1.05, 1.1, 1.2, 1.5, 2, 2.5]
        ax.set_yticks(ticks, [f"{t:g}x" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("KV bytes, % of a full 16-bit cache of the same tokens")
        ax.set_ylabel("perplexity / full's (lower is better)")
        ax.set_title(name, fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("texts", nargs="+", metavar="LABEL=FILE[,FILE...]",
                   help="a text's label and its eval ppl --json files (one panel each)")
    p.add_argument("--head-dim", type=int, default=64, help="the model's head dimension (0.5B: 64)")
    p.add_argument("--plot", default=None, help="PNG to write")
    args = p.parse_args(argv)
    texts = {}
    for text in args.texts:
        label, _, files = text.partition("=")
        rows = [row for path in files.split(",") for row in json.loads(Path(path).read_text())]
        unique = {(coding(r), r["policy"], r["budget"]): r for r in rows}  # a row in two files counts once
        points = placed(list(unique.values()), args.head_dim)
        texts[label] = points
        print(label)
        print(format_table(["coding", "policy", "budget", "bytes (% of 16-bit full)", "ppl / full"],
                           [[c, pol, f"{b:g}", f"{100 * s:.1f}", f"{r:.3f}"] for c, pol, b, s, r in points]))
    if args.plot:
        print(f"wrote {plot(texts, args.plot)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
