"""How the word-list families are scored: RULER's score beside the score of what was asked for.

RULER's common words (``cwe``: "the 10 most common words") and frequent coded words (``fwe``: the 3
most frequent) score an answer by the share of the right words found *anywhere* in it. An answer
that copies the list for as long as it may generate finds more of them than one that names ten
words, right or wrong. So a family "below 70% of full's" may say that full wrote longer answers, not
that it counted better. This prints, per configuration, family and length:

- ``score``: RULER's (the share of the right words anywhere in the answer);
- ``as asked``: the share of the right words among the answer's first N distinct words, N the number
  asked for (10 or 3): the answer read as the task asks for it;
- ``words``: the words the answer wrote, on average.

    python tools/measure/list_answers.py docs/results/longctx/test/*.json

A diagnostic beside the reported metric, never in its place: tables and targets keep RULER's score.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

from h2okv.eval.longctx.report import label
from h2okv.eval.longctx.rows import read_rows

LIST_FAMILIES = ("cwe", "fwe")
# words a list answer joins its items with, never an item (the lists are of rare words and codes)
JOINERS = {"and", "the", "are", "is", "most", "common", "words", "frequent", "answer"}
WORD = re.compile(r"[a-z]+")


def words_of(answer: str) -> list[str]:
    """The answer's words, lower case, joiners left out, in order (repeats kept)."""
    return [w for w in WORD.findall(answer.lower()) if w not in JOINERS]


def as_asked(answer: str, references: list[str]) -> float:
    """The share of ``references`` among the answer's first ``len(references)`` distinct words."""
    first: list[str] = []
    for word in words_of(answer):
        if word not in first:
            first.append(word)
        if len(first) == len(references):
            break
    wanted = {r.lower() for r in references}
    return len(wanted & set(first)) / len(references)


def summarize(rows: list[tuple[str, dict]]) -> list[dict]:
    """One line per (file, configuration, family, length) of the list families; ``rows`` are
    ``(file name, row)`` (two files of one recipe, e.g. streamed and read in one call, stay apart)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for source, row in rows:
        if row["task"] in LIST_FAMILIES:
            groups[(row["task"], row["context"], label(row), source)].append(row)
    lines = []
    for (task, context, config, source), group in sorted(groups.items()):
        n = len(group)
        lines.append({"config": config, "file": source, "task": task, "context": context, "prompts": n,
                      "score": 100 * sum(r["score"] for r in group) / n,
                      "as_asked": 100 * sum(as_asked(r["answer"], r["references"]) for r in group) / n,
                      "words": sum(len(words_of(r["answer"])) for r in group) / n})
    return lines


def markdown(lines: list[dict]) -> str:
    out = ["| family | context | config | file | prompts | score | as asked | words written |",
           "|---|---|---|---|---|---|---|---|"]
    out += [f"| {x['task']} | {x['context']} | {x['config']} | {x['file']} | {x['prompts']} | {x['score']:.0f} "
            f"| {x['as_asked']:.0f} "
            f"| {x['words']:.0f} |" for x in lines]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("files", nargs="+", help="eval longctx JSON files (kvpress and OpenVINO rows too)")
    args = parser.parse_args(argv)
    rows = []
    for path in args.files:
        try:
            rows += [(Path(path).stem, row) for row in read_rows(path)]
        except (ValueError, OSError) as error:
            print(f"list_answers: {path}: {error}", file=sys.stderr)
            return 2
    lines = summarize(rows)
    if not lines:
        print("list_answers: no cwe or fwe rows in these files", file=sys.stderr)
        return 2
    print(markdown(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
