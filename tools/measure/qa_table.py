"""The real-question pieces (``tools/measure/longctx_grid.py --qa``) as one markdown table.

Each row of ``eval longctx --questions-per-context N`` is one answer; the N answers over one
document share it, so they are not N draws. A document's score here is the mean of its N answers,
and the standard errors are over documents: a configuration's over its tasks' documents
(``lengths.standard_error``), and the paired difference from full over the documents both read in
the same mode (``lengths.paired_difference``)::

    python tools/measure/qa_table.py docs/results/longctx/qa/*.json

Modes: ``reuse`` reads the document once (the four answered from copies of that state; compressed
before any question, or held whole until each question ranks its copy: ``core/held.py``),
``fresh`` reads each question with the document (question-aware).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from h2okv.eval.longctx.lengths import paired_difference, ruler_average, standard_error
from h2okv.eval.longctx.report import label
from h2okv.eval.longctx.rows import questions_of, read_rows, row_key

MODES = ("reuse", "fresh")


def documents(rows: list[dict]) -> dict[tuple, dict[tuple, float]]:
    """``{(config, mode, context): {(task, sample): mean score of its questions}}``."""
    answers: dict[tuple, dict[tuple, list[float]]] = {}
    for row in rows:
        key = (label(row), row["question"], int(row["context"]))
        answers.setdefault(key, {}).setdefault((row["task"], int(row["sample"])), []).append(float(row["score"]))
    return {key: {doc: statistics.fmean(s) for doc, s in docs.items()} for key, docs in answers.items()}


def table(rows: list[dict]) -> str:
    """The markdown table of ``rows`` (rows of several questions a context)."""
    docs = documents(rows)
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    header = ["config", "mode", "context", "documents", *tasks, "average (SE)", "of full", "vs full, paired (SE)",
              "prompt tokens a document", "s an answer"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    order = sorted(docs, key=lambda k: (k[2], MODES.index(k[1]) if k[1] in MODES else 9, k[0] != "full", k[0]))
    for config, mode, context in order:
        scores = docs[config, mode, context]
        average, means = ruler_average(scores)
        se = standard_error(scores)
        full = docs.get(("full", mode, context))
        share, paired = "-", "-"
        shared = {doc: score for doc, score in (full or {}).items() if doc in scores}
        if shared and config != "full":
            # full's average on the same documents: a piece cut short holds fewer tasks than full's
            mine, _ = ruler_average({doc: scores[doc] for doc in shared})
            full_average, _ = ruler_average(shared)
            share = f"{mine / full_average:.0%}" if full_average else "-"
            found = paired_difference(scores, full)
            if found is not None:
                difference, paired_se, _ = found
                paired = f"{difference:+.1f}" + (f" ({paired_se:.1f})" if paired_se is not None else "")
        here = [r for r in rows if (label(r), r["question"], int(r["context"])) == (config, mode, context)]
        read = [int(r["prefill_tokens"]) for r in here if "prefill_tokens" in r]  # a peer's rows have none
        tokens = f"{statistics.median(read):,.0f}" if read else "-"
        seconds = statistics.median(float(r["seconds"]) for r in here)
        cells = [config, mode, str(context), str(len(scores)), *(f"{means[t]:.1f}" if t in means else "-" for t in tasks),
                 f"{average:.1f}" + (f" ({se:.1f})" if se is not None else ""), share, paired, tokens,
                 f"{seconds:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("files", nargs="+", type=Path, help="eval longctx --questions-per-context JSON files")
    args = parser.parse_args(argv)
    rows, seen = [], set()
    for path in args.files:
        if not path.is_file():
            print(f"qa_table: no such file: {path}", file=sys.stderr)
            return 2
        try:
            here = [r for r in read_rows(path) if questions_of(r) > 1]
        except ValueError as error:
            print(f"qa_table: {error}", file=sys.stderr)
            return 2
        keys = {row_key(r) for r in here}
        if keys & seen:  # two runs of one configuration would be averaged as one
            print(f"qa_table: {path} repeats {len(keys & seen)} answers of an earlier file (one run a "
                  f"configuration: give the run to report)", file=sys.stderr)
            return 2
        rows, seen = rows + here, seen | keys
    if not rows:
        print("qa_table: no rows of several questions a document (eval longctx --questions-per-context N)",
              file=sys.stderr)
        return 2
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
