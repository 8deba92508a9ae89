"""Two ``eval longctx`` row files on the same prompts: which answers changed, and by how much on average.

The question a re-run asks ("the recipe as it is now, on the prompts its old rows ran"): RULER's
average of each, the paired difference (second less first) on the cells (task, sample, context)
both ran with its standard error (``lengths.paired_difference``: the SE of a mean over the prompts,
as docs/RESULTS.md quotes "paired"), the families whose mean moved, and every cell whose score
changed, with both answers::

    python tools/measure/compare_rows.py docs/results/longctx/test/prompt-8192.json \\
        docs/results/longctx/test/prompt-8192-words.json

Each file holds one configuration's rows (one piece of ``tools/measure/longctx_grid.py``); a file of
several is refused in one line, since its cells would pair with the wrong rows.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from h2okv.eval.longctx.lengths import paired_difference, ruler_average
from h2okv.eval.longctx.report import label
from h2okv.eval.longctx.rows import questions_of, read_rows


def cells(rows: list[dict]) -> dict[tuple, dict]:
    """``{(task, (sample, context)): row}``: the ``(task, draw)`` keys ``ruler_average`` averages over."""
    return {(r["task"], (int(r["sample"]), int(r["context"]))): r for r in rows}


def scores(by_cell: dict[tuple, dict]) -> dict[tuple, float]:
    return {cell: float(row["score"]) for cell, row in by_cell.items()}


def compare(first: list[dict], second: list[dict]) -> str:
    a, b = cells(first), cells(second)
    score_a, score_b = scores(a), scores(b)
    lines = []
    for name, rows, by_cell in (("first", a, score_a), ("second", b, score_b)):
        average, _ = ruler_average(by_cell)
        lines.append(f"{name}: {label(next(iter(rows.values())))}: {average:.1f} ({len(rows)} prompts)")
    paired = paired_difference(score_b, score_a)
    if paired is None:
        return "\n".join([*lines, "no prompt in common: nothing to pair"])
    difference, se, n = paired
    se_text = "-" if se is None else f"{se:.1f}"
    lines.append(f"second less first on the {n} prompts both ran: {difference:+.1f} (SE {se_text})")
    shared = [cell for cell in a if cell in b]
    _, first_tasks = ruler_average({cell: score_a[cell] for cell in shared})
    _, second_tasks = ruler_average({cell: score_b[cell] for cell in shared})
    moved = [f"{task} {first_tasks[task]:.0f} -> {second_tasks[task]:.0f}" for task in first_tasks
             if abs(first_tasks[task] - second_tasks[task]) > 1e-9]
    lines.append("families that moved: " + (", ".join(moved) if moved else "none"))
    changed = [cell for cell in shared if score_a[cell] != score_b[cell]]
    lines.append(f"answers whose score changed: {len(changed)} of {n}")
    for cell in sorted(changed):
        task, (sample, context) = cell
        lines.append(f"  {task} sample {sample} at {context}: {score_a[cell]:.2f} {a[cell]['answer']!r} -> "
                     f"{score_b[cell]:.2f} {b[cell]['answer']!r}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("first", type=Path, help="the rows compared against (the old run)")
    parser.add_argument("second", type=Path, help="the rows compared (the re-run)")
    args = parser.parse_args(argv)
    loaded = []
    for path in (args.first, args.second):
        if not path.is_file():
            print(f"compare_rows: no such file: {path}", file=sys.stderr)
            return 2
        try:
            rows = [r for r in read_rows(path) if questions_of(r) == 1]
        except ValueError as error:
            print(f"compare_rows: {error}", file=sys.stderr)
            return 2
        configurations = {label(r) for r in rows}
        if len(configurations) != 1:
            print(f"compare_rows: {path} holds {len(configurations)} configurations (one a file)", file=sys.stderr)
            return 2
        loaded.append(rows)
    print(compare(*loaded))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
