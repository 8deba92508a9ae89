"""``h2okv eval reasoning``: step-by-step math (GSM8K, MATH-500) generated under a KV budget.

Long generation is where eviction during decoding matters: the prompt is short, the answer is
hundreds of tokens, and the cache of a policy that evicts stays at its budget while full's grows.
Each (policy, budget) runs the problems in batches of left-padded prompts through
``greedy.greedy_rows`` (every row evicts on its own; finished rows leave the batch); each answer is
graded by ``answers.py``. Budgets are slots per (layer, KV head) (an ``int``: with a short prompt a
fraction of it means little) or fractions of each prompt (a ``float``), ``Setup.recent_share`` of
each for the most recent tokens.

Prompt styles: ``chat`` (0-shot, the model's chat template, "reason step by step, final answer in
\\boxed{}"; ends at EOS) and ``fewshot`` (the request file's own few-shot prompt as plain text,
ending at its stop sequences).

A run is a *piece*: one JSON file (``PIECE_FORMAT``) rewritten after every batch, so an
interrupted run keeps what it finished and ``resume`` goes on from there. ``reasoning_report``
merges pieces (per policy, per problem range) into the table and the plot.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

from tqdm.auto import tqdm

from h2okv.byte_budget import Geometry
from h2okv.core.budget import DEFAULT_RECENT_SHARE
from h2okv.eval.answers import extract_answer, is_correct
from h2okv.eval.greedy import greedy_rows
from h2okv.eval.reasoning_data import Problem
from h2okv.generation import chat_prompt_ids, new_cache
from h2okv.policies import policy_class
from h2okv.recipes import recipe_policy, recipe_runs
from h2okv.settings import DEFAULT_KV_GROUP, coding_label, slot_coding_keywords

PIECE_FORMAT = "h2okv-reasoning/1"
EXPORT_FORMAT = "h2okv-reasoning-prompts/1"  # read by tools/peer/run_kvpress.py
STYLES = ("chat", "fewshot")
CHAT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class Setup:
    """What every row of a piece shares (and what must match to resume one)."""

    model: str
    task: str
    style: str
    max_new_tokens: int
    batch_size: int
    seed: int = 0
    recent_share: float = DEFAULT_RECENT_SHARE  # of each budget; the rest is the policy's ranking
    #: the recipe whose policy this piece runs with the recipe's settings (``h2okv.recipes``)
    recipe: str | None = None
    #: every evicting policy keeps the prompt whole, its budget on the answer (``H2OCache(protect_prompt=True)``)
    protect_prompt: bool = False
    #: every policy, ``full`` included, keeps its slots quantized (``H2OCache(kv_bits=...)``); None: the model's dtype
    kv_bits: int | None = None
    kv_group: int = DEFAULT_KV_GROUP  # channels per scale of quantized slots
    key_bits: int | None = None  # the keys' bits, where not kv_bits
    float_window: int = 0  # each row's last tokens also kept in float (quantized slots)
    center_keys: bool = False  # keys coded less their channel's turned mean (quantized slots)

    @property
    def kv_label(self) -> str | None:
        """How the rows' slots are coded, for their label: ``4``, ``k8v4`` (keys in other bits),
        ``4/64`` (another group), or None."""
        return coding_label(self.kv_bits, self.key_bits, self.kv_group, self.float_window, self.center_keys)

    def cache_options(self, policy: str) -> dict:
        """The recipe's further cache keywords (prefill, positions...) for the recipe's own policy,
        and ``protect_prompt`` for an evicting one."""
        protect = {"protect_prompt": True} if self.protect_prompt and policy_class(policy).evicts else {}
        protect.update(slot_coding_keywords(self.kv_bits, self.kv_group, self.key_bits, self.float_window,
                                            self.center_keys))
        if self.recipe is None:
            return protect
        own, settings, _ = recipe_runs([self.recipe])[0]
        if own != policy:
            return protect
        settings.pop("recent_share", None)  # the piece's own recent_share, set from the recipe
        return {**settings, **protect}


def config_label(policy: str, recent_share: float, recipe: str | None = None, protect_prompt: bool = False,
                 kv_bits: int | str | None = None) -> str:
    """A row's ``policy``: the policy, with its recipe or its recent share where that is not the
    default half (a piece of another share is then another line of the report, not the same one),
    ``protect-prompt`` when the prompt is kept whole and ``kv_bits=N`` when the slots are quantized."""
    bits = f" kv_bits={kv_bits}" if kv_bits is not None else ""
    if not policy_class(policy).evicts:
        return policy + bits
    suffix = (" protect-prompt" if protect_prompt else "") + bits
    if recipe is not None and recipe_policy(recipe) == policy:
        return f"{policy} recipe={recipe}{suffix}"
    if recent_share == DEFAULT_RECENT_SHARE:
        return f"{policy}{suffix}"
    return f"{policy} recent={recent_share:g}{suffix}"


def split_label(label: str) -> tuple[str, str]:
    """``config_label``'s parts: ``("h2o", "recent=0.25")``, or ``(policy, "")`` for a plain one."""
    policy, _, variant = label.partition(" ")
    return policy, variant


def budget_label(budget: int | float | None) -> str:
    if budget is None:
        return "full"
    return f"{budget} slots" if isinstance(budget, int) else f"{budget:g} of prompt"


def prompt_ids(tokenizer, problem: Problem, style: str) -> list[int]:
    if style == "chat":
        return chat_prompt_ids(tokenizer, f"{problem.question}\n{CHAT_INSTRUCTION}")
    return list(tokenizer(problem.fewshot_context, add_special_tokens=False)["input_ids"])


def answer_text(tokenizer, token_ids: list[int], stop: tuple[str, ...]) -> str:
    """The generated text, cut at the first stop string."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    cuts = [text.find(s) for s in stop if s in text]
    return text[: min(cuts)] if cuts else text


def export_prompts(model_path: str, tokenizer, setup: Setup, problems: list[Problem], budgets: list, eos_ids) -> dict:
    """The problems as plain JSON for a peer (``tools/peer/run_kvpress.py``, which cannot import
    h2okv): the very prompt ids ``run_batch`` feeds the model, the tokens and stop strings that end
    an answer, and the setup the peer's piece must carry to merge with ours. Grading stays ours:
    the peer returns each answer's text and ``reasoning_report`` grades it with ``answers.py``."""
    return {"format": EXPORT_FORMAT, "model_path": model_path, "setup": asdict(setup), "budgets": list(budgets),
            "decoding": "greedy", "eos_ids": sorted(eos_ids),
            "problems": [{"id": p.id, "prompt_ids": prompt_ids(tokenizer, p, setup.style), "gold": p.gold,
                          "stop": list(p.stop) if setup.style == "fewshot" else []} for p in problems]}


def runs_of(policies: list[str], budgets: list) -> list[tuple[str, int | float | None]]:
    """(policy, budget) pairs: a policy that keeps everything runs once, with no budget."""
    return [(p, None) for p in policies if not policy_class(p).evicts] + [
        (p, b) for p in policies if policy_class(p).evicts for b in budgets]


def run_batch(model, tokenizer, setup: Setup, problems: list[Problem], policy: str, budget, eos_ids,
              keep_text: bool = False) -> tuple[list[dict], dict]:
    """Grade one batch under one (policy, budget): ``(rows, timing)``; ``keep_text``: each row keeps
    the generated text (to check the grading by eye; ~1 KB a problem)."""
    stop = () if setup.style == "chat" else problems[0].stop
    prompts = [prompt_ids(tokenizer, p, setup.style) for p in problems]
    fraction, slots = (budget, None) if isinstance(budget, float) else (None, budget)
    cache = new_cache(model, policy, fraction, seed=setup.seed, slots=slots, recent_share=setup.recent_share,
                      **setup.cache_options(policy))
    label = config_label(policy, setup.recent_share, setup.recipe, setup.protect_prompt, setup.kv_label)
    start, cpu_start = time.perf_counter(), time.process_time()
    results = greedy_rows(model, prompts, cache, setup.max_new_tokens, eos_ids, stop=stop, decode=tokenizer.decode,
                          pad_id=tokenizer.pad_token_id or 0)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    geometry = Geometry.of(model.config)
    full_slot = geometry.layers * geometry.kv_heads * geometry.full_slot_bytes()  # one token, every layer, 16-bit
    rows = []
    for problem, prompt, result in zip(problems, prompts, results, strict=True):
        text = answer_text(tokenizer, result.token_ids, stop)
        predicted = extract_answer(setup.task, text)
        rows.append({
            **asdict(setup), "policy": label, "budget": budget, "id": problem.id, "prompt_tokens": len(prompt),
            "new_tokens": len(result.token_ids), "finish": result.finish, "predicted": predicted, "gold": problem.gold,
            "correct": is_correct(setup.task, predicted, problem.gold), "kv_bytes": result.kv_bytes,
            "kv_slots": result.kv_slots, "kv_bytes_16bit": result.kv_bytes_16bit,
            # of a full 16-bit cache of this problem's final length (the long-generation target's yardstick)
            "kv_share_16bit": round(result.kv_bytes_16bit / (full_slot * (len(prompt) + len(result.token_ids))), 4),
            **({"text": text} if keep_text else {}),
            # every keyword the cache was built with (h2okv.settings), beside the row's label
            **({"settings": cache.settings.describe()} if hasattr(cache, "settings") else {}),
        })
    timing = {"policy": label, "budget": budget, "rows": len(problems),
              "new_tokens": sum(r["new_tokens"] for r in rows), "seconds": round(seconds, 3),
              # the machine may be shared: this process's CPU time (all its threads) does not count the
              # time others took, and the 1-minute load average when the batch ended gives the context
              "cpu_seconds": round(cpu_seconds, 3),
              "load_avg_1m": round(os.getloadavg()[0], 2),
              # a piece is resumed across sessions, and the libraries pip resolves move between them
              "software": software_versions()}
    return rows, timing


def software_versions() -> dict:
    import torch
    import transformers

    from h2okv import __version__

    return {"h2okv": __version__, "torch": torch.__version__, "transformers": transformers.__version__}


def reasoning_grid(model, tokenizer, setup: Setup, problems: list[Problem], policies, budgets, piece: dict | None = None,
                   on_batch=None, progress=True, keep_text=False) -> dict:
    """Run every (policy, budget) over ``problems``; returns the piece (``PIECE_FORMAT``).
    ``piece``: one to go on from (its rows are kept, the problems they cover skipped);
    ``on_batch(piece)`` is called after every batch (the command writes the JSON there)."""
    from h2okv.serve.outputs import eos_ids as model_eos_ids

    piece = piece or {"format": PIECE_FORMAT, "setup": asdict(setup), "rows": [], "batches": []}
    done = {(r["policy"], r["budget"], r["id"]) for r in piece["rows"]}
    eos = model_eos_ids(model, tokenizer)
    work = []
    for policy, budget in runs_of(policies, budgets):
        label = config_label(policy, setup.recent_share, setup.recipe, setup.protect_prompt, setup.kv_label)
        todo = [p for p in problems if (label, budget, p.id) not in done]
        work += [(policy, budget, todo[i: i + setup.batch_size]) for i in range(0, len(todo), setup.batch_size)]
    with tqdm(total=sum(len(w[2]) for w in work), desc=f"{setup.task} {setup.style}", unit="problem",
              disable=not progress) as bar:
        for policy, budget, batch in work:
            bar.set_postfix_str(f"{policy} {budget_label(budget)}")
            rows, timing = run_batch(model, tokenizer, setup, batch, policy, budget, eos, keep_text)
            piece["rows"] += rows
            piece["batches"].append(timing)
            if on_batch is not None:
                on_batch(piece)
            bar.update(len(batch))
    return piece
