"""``--questions-per-context N``: N questions over one compressed context, each graded with its
family's metric, in two modes per configuration:

- ``reuse``: the context alone read once into the cache (``h2okv.read_context``), then the N
  questions answered from copies of that one state, as rows of one batch (``h2okv.ask``). Most
  policies compress it before any question exists (ranked by reconstruction for ``kvzip`` / recipe
  ``document``); one ranked by a call's last queries (``snapkv``, recipe ``bounded``) holds it whole
  until each question ranks its own copy (``core/held.py``). Each answer is the one a fresh cache
  gives reading the context, then that question (two calls);
- ``fresh``: each question read with its context into a fresh cache, question-aware (the grid's
  ``aware`` path), the N prompts of a context as one batch.

Prompt tokens read per context (``prefill_tokens`` on each row): reuse ``context + N questions``,
fresh ``N x (context + question)``. A reconstruction pass (kvzip) adds one probe pass per context
read, so the same ratio holds for it; it is not counted.

Rows: question mode ``reuse`` / ``fresh``, ``questions`` N, ``question_index``; a (task, context,
configuration, mode) cell is skipped when its rows are in ``done`` (resume).
"""

from __future__ import annotations

import time

from tqdm.auto import tqdm

from h2okv.core.reconstruction import read_context
from h2okv.eval.longctx.prompt import Frame, LongPrompt
from h2okv.eval.longctx.rows import row_key
from h2okv.eval.longctx.runner import (
    Config,
    GridSpec,
    check_positions,
    config_cache,
    generate_answers,
    prompt_row,
    question_sets,
)
from h2okv.questions import ask


def reuse_answers(model, tokenizer, prompts: list[LongPrompt], cache, max_new_tokens: int, chat_head: int = 0) -> list[str]:
    """The shared context read once (compressed before any question, or held for it:
    ``read_context``), then every question answered from its own copy of that state (``h2okv.ask``)."""
    context = prompts[0].ids[: prompts[0].question]
    read_context(model, tokenizer, cache, context, start=chat_head)
    return ask(model, tokenizer, cache, context, [p.ids[p.question :] for p in prompts], max_new_tokens=max_new_tokens)


def fresh_answers(model, tokenizer, prompts: list[LongPrompt], cache, max_new_tokens: int, chat_head: int = 0) -> list[str]:
    """Each prompt, question included, read into the (fresh) cache: the grid's question-aware path."""
    return generate_answers(model, tokenizer, prompts, cache, "aware", max_new_tokens, chat_head)


ANSWER = {"reuse": reuse_answers, "fresh": fresh_answers}


def prefill_tokens(prompts: list[LongPrompt], mode: str) -> int:
    """Prompt tokens one context's N questions cost: the context once, or once per question."""
    if mode == "reuse":
        return prompts[0].question + sum(len(p.ids) - p.question for p in prompts)
    return sum(len(p.ids) for p in prompts)


def mode_rows(model, tokenizer, sets: list[list[LongPrompt]], spec: GridSpec, config: Config, mode: str,
              meta: dict) -> list[dict]:
    """The rows of one configuration in one mode, over one (task, context)'s question sets."""
    chat_head = len(Frame(tokenizer, spec.chat).head)
    rows = []
    for prompts in sets:
        max_new = spec.max_new_tokens or max(p.max_new_tokens for p in prompts)
        start = time.perf_counter()
        answers = ANSWER[mode](model, tokenizer, prompts, config_cache(model, spec, config), max_new, chat_head)
        seconds = round((time.perf_counter() - start) / len(prompts), 3)
        rows += [prompt_row(p, answer, spec, config, mode, meta, max_new_tokens=max_new, seconds=seconds,
                            questions=spec.questions, question_index=p.index, prefill_tokens=prefill_tokens(prompts, mode))
                 for p, answer in zip(prompts, answers, strict=True)]
    return rows


def cell_keys(spec: GridSpec, task: str, context: int, config: Config, mode: str) -> set[tuple]:
    return {row_key({"haystack": spec.haystack, "seed": spec.seed, "question": mode, "policy": config.policy, "budget": config.budget, "cache_options": config.options,
                     "task": task, "context": context, "sample": s, "questions": spec.questions, "question_index": i})
            for s in range(spec.samples) for i in range(spec.questions)}


def run_reuse_grid(model, tokenizer, spec: GridSpec, done=frozenset(), on_rows=None, progress=True,
                   meta: dict | None = None) -> list[dict]:
    """Every (task, context, configuration, mode) cell not in ``done``; ``on_rows(rows)`` after each."""
    sets = question_sets(tokenizer, spec)
    check_positions(model, [p for group in sets.values() for one in group for p in one], spec.max_new_tokens)
    todo = [(t, c, config, mode) for (t, c) in sets for config in spec.configs() for mode in spec.modes
            if not cell_keys(spec, t, c, config, mode) <= done]
    found = []
    desc = f"longctx ({spec.questions} questions per context)"
    with tqdm(total=len(todo), desc=desc, unit="cell", disable=not progress) as bar:
        for task, context, config, mode in todo:
            bar.set_postfix_str(f"{task} {context} {config.name} {mode}")
            rows = mode_rows(model, tokenizer, sets[task, context], spec, config, mode, meta or {})
            found += rows
            if on_rows is not None:
                on_rows(rows)
            bar.update(1)
    return found
