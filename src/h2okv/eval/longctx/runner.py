"""Running the long-context grid: prompts per (task, context), then one greedy batch per
configuration, scored with RULER's metric into rows (``rows.py``).

Question modes:

- ``aware``: the whole prompt, question included, is one forward call under the cache's policy,
  then greedy decoding (the question is read, and ranked, with the context).
- ``agnostic``: the context part (``ids[:question]``) is one forward call under the policy, which
  evicts down to its budget without having seen the question; the question part is then a second
  call on that cache, and decoding follows (kvpress's "question kept out" protocol).

All prompts of one (task, context) have the same length; in ``aware`` mode they run as one batch
with no padding. In ``agnostic`` mode prompts are batched when their question starts at the same
position (the first call must have one length), else they run in smaller groups.

Several questions over one context (``questions`` > 1) run in ``reuse.py`` instead: reuse of one
question-agnostic read vs a fresh question-aware read per question.

``done`` keys (rows already in the output file) are skipped, so an interrupted grid resumes, and
a grid split across sessions (``--tasks``/``--contexts``/``--policies`` pieces) merges later; a
cell with some of its samples in the file runs only the others (``--samples 5`` after 3).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field, replace

import torch
from tqdm.auto import tqdm
from transformers import LogitsProcessor, LogitsProcessorList

from h2okv.core.cache import DEFAULT_CHUNK
from h2okv.core.compat import cache_arg
from h2okv.errors import H2OError
from h2okv.eval.haystack import Haystack
from h2okv.eval.longctx.fresh_process import ModelLoad, in_fresh_process
from h2okv.eval.longctx.metric import score
from h2okv.eval.longctx.prompt import Frame, LongPrompt
from h2okv.eval.longctx.rows import make_row, row_key
from h2okv.eval.longctx.splits import split_of
from h2okv.eval.longctx.tasks import build_prompts, build_question_sets, check_questions
from h2okv.generation import new_cache, read_ahead
from h2okv.policies import policy_class
from h2okv.recipes import recipe_runs

QUESTION_MODES = ("aware", "agnostic")


@dataclass
class GridSpec:
    tasks: list[str]
    contexts: list[int]
    samples: int
    policies: list[str]
    budgets: list[float]
    question: str = "aware"
    seed: int = 0
    haystack: str = "essays"
    chunk_size: int = DEFAULT_CHUNK
    cache_options: dict = field(default_factory=dict)
    max_new_tokens: int | None = None  # None: each task's own
    chat: bool = True
    recipes: list[str] = field(default_factory=list)  # run beside the policies, each with its own settings
    questions: int = 1  # questions per context: > 1 runs reuse vs fresh (reuse.py)
    modes: tuple[str, ...] = ("reuse", "fresh")  # with questions > 1: the modes run (--question picks one)
    batch: int | None = None  # the most prompts one forward reads (None: a cell's whole group)
    #: quantized slots for every configuration, full's and the recipes' too (``settings.slot_coding_keywords``;
    #: empty: the model's dtype). Part of each row's cache options, so a quantized row is its own cell
    coding: dict = field(default_factory=dict)

    def options_for(self, policy: str) -> dict:
        """The cache keywords of ``policy``'s runs: a policy ranked by reconstruction reads the
        prompt whole (late prefill) unless the options say otherwise (which is then an error); a
        policy that keeps every token takes none (the options shape what is evicted)."""
        if not policy_class(policy).evicts:
            return {}
        late = {"prefill": "late"} if policy_class(policy).ranks_by_reconstruction else {}
        return {**late, **self.cache_options}

    def configs(self) -> list[Config]:
        """Every configuration to run; a policy that keeps everything runs once, at budget 1."""
        coding = self.coding
        runs = [Config(p, 1.0, {**coding}) for p in self.policies if not policy_class(p).evicts]
        runs += [Config(p, b, {**self.options_for(p), **coding}) for p in self.policies if policy_class(p).evicts
                 for b in self.budgets]
        return runs + [Config(p, b, {**options, **coding}, name) for p, options, name in recipe_runs(self.recipes)
                       for b in self.budgets]


@dataclass(frozen=True)
class Config:
    """One configuration of a grid: a policy at a budget with its cache keywords, and the recipe
    they came from (None for a plain policy)."""

    policy: str
    budget: float
    options: dict
    recipe: str | None = None

    @property
    def name(self) -> str:
        return f"{self.recipe or self.policy}@{self.budget:g}"


def haystack_source(tokenizer, spec: str):
    """Task haystack kind ("essay": the run's ``spec``; "filler") -> a ``Haystack``, each built once."""
    return functools.lru_cache(maxsize=None)(lambda kind: Haystack(tokenizer, spec if kind == "essay" else "filler"))


def question_sets(tokenizer, spec: GridSpec) -> dict[tuple[str, int], list[list[LongPrompt]]]:
    """Per (task, context): per sample, N prompts over one shared context (``--questions-per-context``)."""
    check_questions(spec.tasks, spec.questions)
    frame, haystacks = Frame(tokenizer, spec.chat), haystack_source(tokenizer, spec.haystack)
    return {(t, c): build_question_sets(frame, haystacks, t, c, spec.samples, spec.seed, spec.questions)
            for t in spec.tasks for c in spec.contexts}


def grid_prompts(tokenizer, spec: GridSpec) -> dict[tuple[str, int], list[LongPrompt]]:
    frame, haystacks = Frame(tokenizer, spec.chat), haystack_source(tokenizer, spec.haystack)
    return {(t, c): build_prompts(frame, haystacks, t, c, spec.samples, spec.seed) for t in spec.tasks for c in spec.contexts}


class FirstToken(LogitsProcessor):
    """Notes when the first token's logits exist: everything before is the prompt's read (prefill,
    and for ``kvzip`` its ranking), everything after is decoding."""

    def __init__(self):
        self.at = None

    def __call__(self, input_ids, scores):
        if self.at is None:
            self.at = time.perf_counter()
        return scores


@dataclass
class Costs:
    """What one batch of answers cost: seconds to the first token and after it, the process's peak
    memory above what it held before (RSS high-water mark, ``bench.memory``: the batch's, not
    divided, so compare rows of one batch size; ``--batch 1`` for per-prompt memory) and the KV
    bytes the cache held at the end against a full cache of the same tokens."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    peak_bytes: int = 0
    kv_bytes: int = 0
    full_kv_bytes: int = 0
    kv_bytes_16bit: int = 0  # the same K/V in a 16-bit model (float slots at 2 bytes, coded ones as they are)
    full_kv_bytes_16bit: int = 0  # a full cache of the same tokens in 16 bits: what quantized slots are held against

    def per_row(self, rows: int) -> dict:
        """The row fields: times per prompt of the batch, the batch's peak, the KV fraction."""
        return {"prefill_s": round(self.prefill_s / rows, 3), "decode_s": round(self.decode_s / rows, 3),
                "peak_mib": round(self.peak_bytes / 2**20, 1), "kv_fraction": round(self.kv_bytes / self.full_kv_bytes, 4)
                if self.full_kv_bytes else None,
                "kv_share_16bit": round(self.kv_bytes_16bit / self.full_kv_bytes_16bit, 4) if self.full_kv_bytes_16bit
                else None,
                "batch": rows}


def generate_answers(model, tokenizer, prompts: list[LongPrompt], cache, question: str, max_new_tokens: int,
                     chat_head: int = 0, costs: Costs | None = None) -> list[str]:
    """Greedy answers of prompts of one length (and, for ``agnostic``, one question position).

    A policy that ranks by reconstruction (``kvzip``) reads the context (``agnostic``) or all but
    the prompt's last token (``aware``), is ranked by ``h2okv.reconstruct`` (which repeats it from
    ``chat_head`` on: the chat template's own head is not text to reproduce), then generates.
    ``costs``, when given, is filled in (``Costs``)."""
    from h2okv.bench.memory import measure_peak

    ids = torch.tensor([p.ids for p in prompts], dtype=torch.long, device=model.device)
    first = FirstToken()
    with measure_peak(model.device) as peak, torch.inference_mode():
        start = time.perf_counter()
        # the context alone (agnostic): the cache evicts to its budget before the question exists
        read_ahead(model, tokenizer, cache, ids, prompts[0].question if question == "agnostic" else None, chat_head)
        # generate reads only the ids the cache has not seen: all of them, or the question part
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_arg(cache),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                             logits_processor=LogitsProcessorList([first]))
        end = time.perf_counter()
    if costs is not None:
        stats = cache.stats() if hasattr(cache, "stats") else {}
        costs.prefill_s, costs.decode_s = first.at - start, end - first.at
        costs.peak_bytes = peak.peak_bytes
        costs.kv_bytes, costs.full_kv_bytes = stats.get("kv_bytes", 0), stats.get("full_kv_bytes", 0)
        costs.kv_bytes_16bit, costs.full_kv_bytes_16bit = stats.get("kv_bytes_16bit", 0), stats.get("full_kv_bytes_16bit", 0)
    return tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)


def batches(prompts: list[LongPrompt], question: str, size: int | None = None) -> list[list[LongPrompt]]:
    """Prompts that can share a forward (``agnostic``: the same question position), at most ``size``
    at a time."""
    groups: dict[int, list[LongPrompt]] = {}
    for p in prompts:
        groups.setdefault(0 if question == "aware" else p.question, []).append(p)
    size = size or len(prompts)
    return [group[i : i + size] for group in groups.values() for i in range(0, len(group), size)]


def config_cache(model, spec: GridSpec, config: Config):
    return new_cache(model, config.policy, config.budget, chunk_size=spec.chunk_size, seed=spec.seed, **config.options)


def run_config(model, tokenizer, prompts, spec: GridSpec, config: Config, meta: dict,
               fresh: ModelLoad | None = None) -> list[dict]:
    """The rows of one configuration on one (task, context)'s prompts; ``fresh``: each batch read
    in a process of its own that loads the model so (``fresh_process.py``: a peak not shaped by
    what this process ran before), its rows marked ``peak_process: "fresh"``."""
    rows = []
    chat_head = len(Frame(tokenizer, spec.chat).head)
    for group in batches(prompts, spec.question, spec.batch):
        max_new = spec.max_new_tokens or group[0].max_new_tokens
        if fresh is not None:
            answers, costs, settings = in_fresh_process(answer_loaded, fresh, group, spec, config, chat_head, max_new)
            seconds = (costs.prefill_s + costs.decode_s) / len(group)  # the answer's, not the child's start and load
        else:
            answers, costs, settings, seconds = answer_here(model, tokenizer, group, spec, config, chat_head, max_new)
        rows += [prompt_row(p, answer, spec, config, spec.question, meta, max_new_tokens=max_new,
                            seconds=round(seconds, 3), settings=settings,
                            peak_process="fresh" if fresh is not None else None, **costs.per_row(len(group)))
                 for p, answer in zip(group, answers, strict=True)]
    return sorted(rows, key=lambda r: r["sample"])


def answer_here(model, tokenizer, group, spec: GridSpec, config: Config, chat_head: int, max_new: int):
    """``(answers, costs, settings, seconds per prompt)`` of one batch, read in this process."""
    cache, costs = config_cache(model, spec, config), Costs()
    # what the cache was built with, in full (h2okv.settings): a row says what ran, not only its label
    settings = cache.settings.describe() if hasattr(cache, "settings") else None
    start = time.perf_counter()
    answers = generate_answers(model, tokenizer, group, cache, spec.question, max_new, chat_head, costs)
    seconds = (time.perf_counter() - start) / len(group)
    del cache  # the next group's peak must not count this one's cache
    return answers, costs, settings, seconds


def answer_loaded(load: ModelLoad, group, spec: GridSpec, config: Config, chat_head: int, max_new: int):
    """``answer_here`` in a process that holds no model yet (``fresh_process.py``): the model loaded
    as ``load`` says and warmed up as ``run_grid`` does, then ``(answers, costs, settings)``."""
    from h2okv.models import load_model

    if load.threads:
        torch.set_num_threads(load.threads)
    model, tokenizer = load_model(load.name, device=load.device, dtype=load.dtype)
    warm_up(model)
    warm_config(model, tokenizer, spec, config, group[0], chat_head)
    answers, costs, settings, _ = answer_here(model, tokenizer, group, spec, config, chat_head, max_new)
    return answers, costs, settings


def prompt_row(p: LongPrompt, answer: str, spec: GridSpec, config: Config, question: str, meta: dict, **fields) -> dict:
    """The row of one prompt's answer, scored; ``fields``: the run's own (max_new_tokens, seconds, ...)."""
    return make_row(
        task=p.task, context=p.context, sample=p.sample, question=question, policy=config.policy, budget=config.budget,
        cache_options=config.options, recipe=config.recipe, chunk_size=spec.chunk_size, metric=p.metric,
        score=score(p.metric, answer, p.references), answer=answer, references=p.references,
        haystack=spec.haystack, seed=spec.seed, split=split_of(spec.haystack, spec.seed), model=meta.get("model"),
        device=meta.get("device"), dtype=meta.get("dtype"), **fields,
    )


def sample_key(spec: GridSpec, task: str, context: int, config: Config, sample: int) -> tuple:
    return row_key({"haystack": spec.haystack, "seed": spec.seed, "question": spec.question, "policy": config.policy,
                    "budget": config.budget,
                    "cache_options": config.options, "task": task, "context": context, "sample": sample})


def cell_keys(spec: GridSpec, task: str, context: int, config: Config) -> set[tuple]:
    return {sample_key(spec, task, context, config, s) for s in range(spec.samples)}


def warm_up(model) -> None:
    """One short forward before any cell is measured: weights loaded by memory-mapping become
    resident on first touch, which the first cell's peak memory would otherwise count (measured:
    2.6 GB above the baseline for a 2k prompt under full on the 0.5B, 1.5 GB for the 8k after it)."""
    with torch.inference_mode():
        model(input_ids=torch.zeros(1, 4, dtype=torch.long, device=model.device))


# the context a configuration's warm-up reads: two of the cache's prefill pieces' worth at the default chunk
WARM_CONTEXT = DEFAULT_CHUNK + 88


def warm_config(model, tokenizer, spec: GridSpec, config: Config, prompt: LongPrompt, chat_head: int) -> None:
    """One short answer under ``config`` before its first measured cell: what a configuration sets
    up once (its modules imported, tables built, kernels picked) stays for the process's life, and
    would otherwise be counted in the first cell's peak alone. Measured: ``bounded`` on a 2k test
    prompt, one process, three reads: 543, 115, 115 MiB (124 MiB of the first read's were Python's
    own allocations). The warm-up reads the prompt's first ``WARM_CONTEXT`` tokens and its question."""
    if len(prompt.ids) <= WARM_CONTEXT + 64:
        short = prompt
    else:
        context, question = prompt.ids[: min(prompt.question, WARM_CONTEXT)], prompt.ids[prompt.question :]
        short = replace(prompt, ids=context + question, question=len(context), evidence=[])
    cache = config_cache(model, spec, config)
    generate_answers(model, tokenizer, [short], cache, spec.question, 2, chat_head)
    del cache


def check_positions(model, prompts: list[LongPrompt], max_new_tokens: int | None) -> None:
    """Each prompt and its answer inside the model's positions, before any cell runs: past them the
    rotary turns are ones the model never trained on (transformers only warns), and a score there
    is not the length's. A 32,768-token prompt leaves Qwen2.5 no room for its answer."""
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if not limit or not prompts:
        return
    worst = max(prompts, key=lambda p: len(p.ids) + (max_new_tokens or p.max_new_tokens))
    new = max_new_tokens or worst.max_new_tokens
    if len(worst.ids) + new > limit:
        raise H2OError(f"context {worst.context} ({worst.task}: {len(worst.ids)} prompt tokens + {new} new) passes "
                       f"the model's {limit} positions; give --contexts at most {limit - new}")


def run_grid(model, tokenizer, spec: GridSpec, done: set[tuple] = frozenset(), on_rows=None, progress=True,
             meta: dict | None = None, fresh: ModelLoad | None = None) -> list[dict]:
    """Every (task, context, configuration) cell not in ``done``; ``on_rows(rows)`` after each. One
    question per context (several: ``reuse.run_reuse_grid``, which builds on this module).
    ``fresh``: each batch in a process of its own (``run_config``)."""
    if spec.questions > 1:
        raise ValueError("run_grid asks one question per context; run_reuse_grid asks several")
    prompts = grid_prompts(tokenizer, spec)
    check_positions(model, [p for group in prompts.values() for p in group], spec.max_new_tokens)
    todo = [(t, c, config) for (t, c) in prompts for config in spec.configs() if not cell_keys(spec, t, c, config) <= done]
    if todo:
        warm_up(model)
    found = []
    with tqdm(total=len(todo), desc=f"longctx ({spec.question})", unit="cell", disable=not progress) as bar:
        warmed, chat_head = set(), len(Frame(tokenizer, spec.chat).head)
        for task, context, config in todo:
            bar.set_postfix_str(f"{task} {context} {config.name}")
            # only the samples not in the file: a cell cut short, or grown by a larger --samples, runs the rest
            missing = [p for p in prompts[task, context] if sample_key(spec, task, context, config, p.sample) not in done]
            if fresh is None and repr(config) not in warmed:  # a fresh process warms itself
                warm_config(model, tokenizer, spec, config, missing[0], chat_head)
                warmed.add(repr(config))
            rows = run_config(model, tokenizer, missing, spec, config, meta or {}, fresh)
            found += rows
            if on_rows is not None:
                on_rows(rows)
            bar.update(1)
    return found


EXPORT_FORMAT = "h2okv-longctx-prompts/1"


def _exported(tokenizer, spec: GridSpec) -> list[LongPrompt]:
    """The prompts an export holds: the grid's, or with several questions a context each question
    over its context (the same contexts ``--questions-per-context`` reads; a prompt's ``index`` is
    its question's), in the order the grid reads them."""
    if spec.questions == 1:
        return [p for group in grid_prompts(tokenizer, spec).values() for p in group]
    return [p for sets in question_sets(tokenizer, spec).values() for one in sets for p in one]


def export_prompts(model_path: str, tokenizer, spec: GridSpec) -> dict:
    """The grid's prompts as plain JSON for a peer (``tools/peer/run_kvpress.py``): token ids split
    at the question, the references and metric each answer is scored with, and how to decode; with
    several questions a context, each prompt's ``questions`` and ``question_index`` too."""
    prompts = [
        {"task": p.task, "context": p.context, "sample": p.sample, "context_ids": p.ids[: p.question],
         "question_ids": p.ids[p.question :], "references": p.references, "metric": p.metric,
         "max_new_tokens": spec.max_new_tokens or p.max_new_tokens,
         **({"questions": spec.questions, "question_index": p.index} if spec.questions > 1 else {})}
        for p in _exported(tokenizer, spec)
    ]
    return {"format": EXPORT_FORMAT, "model": model_path, "haystack": spec.haystack, "seed": spec.seed,
            "chat": spec.chat, "budgets": list(spec.budgets), "decoding": "greedy",
            "pad_token_id": tokenizer.pad_token_id, "prompts": prompts}
