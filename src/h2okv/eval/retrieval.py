"""``h2okv eval retrieval``: synthetic passkey retrieval (needle in a haystack), generated offline.

A prompt of exactly ``context`` tokens: an instruction, a haystack (repeated filler sentences or
Shakespeare), a needle "The pass key is 48213. Remember it. 48213 is the pass key." at a given
depth, and the question at the end. Greedy decoding of a few tokens; a trial is correct when the
passkey appears in the answer. The grid is policy x budget x context x depth, ``trials`` passkeys
per cell; all prompts of one context length have the same length, so they run as one batch with no
padding (and the same per-row budget).

Besides accuracy, each cell reports ``needle_kept``: the share of the needle's tokens still in the
cache after generation (mean over layers, KV heads and trials), which shows *where* a policy lost it.

A policy that ranks by reconstruction (``kvzip``) reads every token but the last whole (late
prefill), is ranked by ``h2okv.reconstruct`` (the model repeats the prompt: the instruction, the
haystack with its needle and the question, as in ``eval longctx``'s question-aware mode), then
generates from the last token on.

``export_prompts`` writes the very token ids the grid feeds the model, split into context and
question, for a peer to run on (``tools/peer/run_kvpress.py``, format ``EXPORT_FORMAT``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from h2okv.core.budget import DEFAULT_RECENT_SHARE
from h2okv.core.cache import DEFAULT_CHUNK, H2OCache
from h2okv.core.compat import cache_arg
from h2okv.errors import H2OError
from h2okv.eval.haystack import FILLER, Haystack  # noqa: F401 (FILLER: public here before)
from h2okv.eval.output import format_table
from h2okv.eval.plots import annotated_heatmap, new_figure, save_figure
from h2okv.generation import new_cache, read_ahead
from h2okv.policies import policy_class
from h2okv.recipes import recipe_runs
from h2okv.settings import DEFAULT_HEAD_FLOOR

INSTRUCTION = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n\n"
)
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key? The pass key is"


@dataclass
class PasskeyPrompt:
    ids: list[int]
    passkey: str
    depth: float
    needle: tuple[int, int]  # [start, stop) token positions of the needle
    question: int = 0  # position where the question starts: ids[:question] is the context


def build_prompt(tokenizer, haystack: Haystack, context: int, depth: float, passkey: str, offset: int = 0) -> PasskeyPrompt:
    """A prompt of exactly ``context`` tokens with the needle at ``depth`` of the haystack
    (0: right after the instruction, 1: right before the question)."""
    if not 0.0 <= depth <= 1.0:
        raise H2OError(f"depth must be in [0, 1], got {depth}")
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    head, needle, question = enc(INSTRUCTION), enc(NEEDLE.format(key=passkey)), enc(QUESTION)
    hay_len = context - len(head) - len(needle) - len(question)
    if hay_len < 16:
        raise H2OError(f"context {context} is too short: the instruction, needle and question alone take {context - hay_len} tokens")
    hay, breaks = haystack.take(hay_len, offset)
    cut = min(breaks, key=lambda b: abs(b - depth * hay_len))
    ids = head + hay[:cut] + needle + hay[cut:] + question
    start = len(head) + cut
    return PasskeyPrompt(ids, passkey, depth, (start, start + len(needle)), len(ids) - len(question))


def make_prompts(tokenizer, haystack: Haystack, context: int, depths: list[float], trials: int, seed: int = 0):
    """``trials`` prompts per depth; passkeys and haystack offsets depend only on the seed, the
    context, the depth and the trial, so every policy and budget sees the same prompts."""
    prompts = []
    for d_index, depth in enumerate(depths):
        for trial in range(trials):
            rng = random.Random(f"{seed}/{context}/{d_index}/{trial}")
            passkey = str(rng.randint(10000, 99999))
            slack = haystack.slack(context)
            offset = rng.randint(0, min(slack, 20000)) if slack else 0
            prompts.append(build_prompt(tokenizer, haystack, context, depth, passkey, offset))
    return prompts


def is_correct(answer: str, passkey: str) -> bool:
    return passkey in answer


def needle_kept(cache: H2OCache, prompts: list[PasskeyPrompt]) -> list[float]:
    """Per prompt: the share of its needle tokens still live, averaged over layers and KV heads."""
    if not cache.policy.evicts:
        return [1.0] * len(prompts)
    kept = torch.zeros(len(prompts))
    layers = [layer for layer in cache.layers if layer.is_initialized]
    for layer in layers:
        ordinals, valids = layer.read("ordinal"), layer.read("valid")  # [B, H, cap]
        for row, prompt in enumerate(prompts):
            start, stop = prompt.needle
            ordinal, valid = ordinals[row], valids[row]
            in_needle = valid & (ordinal >= start) & (ordinal < stop)
            kept[row] += in_needle.sum(-1).float().mean() / (stop - start)
    return (kept / max(len(layers), 1)).tolist()


@dataclass
class Cell:
    policy: str
    budget: float
    context: int
    depth: float
    trials: int
    correct: int
    accuracy: float
    needle_kept: float
    haystack: str
    chunk_size: int
    answers: list[str] = field(default_factory=list)
    prefill: str = "chunked"  # H2OCache's prefill mode (a peer's rows: its own, see its README)
    recent_share: float = DEFAULT_RECENT_SHARE
    head_budgets: str = "uniform"  # H2OCache's: uniform or adaptive (Ada-KV)
    head_floor: float = DEFAULT_HEAD_FLOOR
    positions: str = "true"
    recipe: str | None = None  # the recipe the settings above were expanded from (h2okv.recipes)

    @property
    def config(self) -> str:
        """The policy with the cache settings that differ from the defaults, e.g. ``knorm late r0.05``;
        a recipe's run by its name, ``recipe bounded``."""
        if self.recipe:
            return f"recipe {self.recipe}"
        parts = [self.policy]
        if self.prefill != "chunked":
            parts.append(self.prefill)
        if self.recent_share != DEFAULT_RECENT_SHARE and policy_class(self.policy).evicts:
            parts.append(f"r{self.recent_share:g}")
        if self.head_budgets != "uniform":
            parts.append(self.head_budgets)
        return " ".join(parts)


def policy_shape(policy: str, shape: dict | None) -> dict:
    """``shape`` as ``policy`` runs it: a policy ranked by reconstruction reads its prompt late."""
    shape = dict(shape or {})
    if policy_class(policy).ranks_by_reconstruction:
        shape["prefill"] = "late"
    return shape


def run_batch(model, tokenizer, prompts, policy, budget, chunk_size, max_new_tokens, seed=0, shape=None):
    """Greedy answers for prompts of equal length under one policy/budget; ``(answers, kept)``.
    ``shape``: ``new_cache``'s ``recent_share`` and ``prefill`` (default: the defaults)."""
    cache = new_cache(model, policy, budget, chunk_size=chunk_size, seed=seed, **policy_shape(policy, shape))
    ids = torch.tensor([p.ids for p in prompts], dtype=torch.long, device=model.device)
    with torch.inference_mode():
        read_ahead(model, tokenizer, cache, ids)  # kvzip: all but the last token, ranked
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), **cache_arg(cache), max_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=tokenizer.pad_token_id,
        )
    answers = tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
    return answers, needle_kept(cache, prompts)


@dataclass(frozen=True)
class RetrievalSpec:
    """A passkey grid: every policy (with the grid's cache settings below) and every recipe (with
    its own) at every budget, ``trials`` prompts per context length and needle depth."""

    policies: Sequence[str]
    budgets: Sequence[float]  # fractions of the prompt (a policy that keeps everything runs once)
    contexts: Sequence[int]  # prompt lengths in tokens
    depths: Sequence[float]  # 0: the needle right after the instruction, 1: right before the question
    trials: int  # passkeys per cell
    haystack: str = "filler"  # or shakespeare:NAME
    chunk_size: int = DEFAULT_CHUNK
    max_new_tokens: int = 8
    seed: int = 0  # of the passkeys, the haystack offsets and the random policy
    recent_share: float = DEFAULT_RECENT_SHARE
    prefill: str = "chunked"
    head_budgets: str = "uniform"
    head_floor: float | None = None  # None: the cache's default
    recipes: Sequence[str] = ()

    @property
    def shape(self) -> dict:
        """``new_cache``'s keywords for the grid's cache settings (what each cell records)."""
        shape = {"recent_share": self.recent_share, "prefill": self.prefill, "head_budgets": self.head_budgets}
        return shape if self.head_floor is None else {**shape, "head_floor": self.head_floor}


def grid_prompts(tokenizer, spec: RetrievalSpec) -> dict[int, list[PasskeyPrompt]]:
    """The prompts of a grid per context length: what ``retrieval_grid`` runs and what is exported."""
    hay = Haystack(tokenizer, spec.haystack)
    return {c: make_prompts(tokenizer, hay, c, spec.depths, spec.trials, spec.seed) for c in spec.contexts}


def retrieval_grid(model, tokenizer, spec: RetrievalSpec, progress: bool = True) -> list[Cell]:
    """Every policy and recipe of ``spec`` at every budget, on the same prompts."""
    prompts_by_context = grid_prompts(tokenizer, spec)
    configs = [(p, policy_shape(p, spec.shape), None) for p in spec.policies] + recipe_runs(spec.recipes)
    runs = [(p, None, s, r) for p, s, r in configs if not policy_class(p).evicts]
    runs += [(p, b, s, r) for p, s, r in configs if policy_class(p).evicts for b in spec.budgets]
    cells, trials = [], spec.trials
    with tqdm(total=len(runs) * len(spec.contexts), desc="retrieval", unit="batch", disable=not progress) as bar:
        for policy, budget, shape, recipe in runs:
            name = recipe or policy
            for context in spec.contexts:
                bar.set_postfix_str(f"{name}@{budget:g} ctx {context}" if budget else f"{name} ctx {context}")
                prompts = prompts_by_context[context]
                answers, kept = run_batch(model, tokenizer, prompts, policy, budget, spec.chunk_size,
                                          spec.max_new_tokens, spec.seed, shape)
                for d_index, depth in enumerate(spec.depths):
                    rows = range(d_index * trials, (d_index + 1) * trials)
                    correct = sum(is_correct(answers[i], prompts[i].passkey) for i in rows)
                    cells.append(Cell(
                        policy=policy, budget=1.0 if budget is None else budget, context=context, depth=depth,
                        trials=trials, correct=correct, accuracy=correct / trials,
                        needle_kept=round(sum(kept[i] for i in rows) / trials, 4), haystack=spec.haystack,
                        chunk_size=spec.chunk_size, answers=[answers[i] for i in rows], recipe=recipe, **shape,
                    ))
                bar.update(1)
    return cells


EXPORT_FORMAT = "h2okv-retrieval-prompts/1"


def export_prompts(model_path: str, tokenizer, spec: RetrievalSpec) -> dict:
    """The grid's prompts as plain JSON for a peer: token ids split at the question, the passkey
    (a trial is correct when it appears in the answer), and how to decode (greedy)."""
    prompts = []
    for context, group in grid_prompts(tokenizer, spec).items():
        for index, prompt in enumerate(group):
            prompts.append({
                "context": context, "depth": prompt.depth, "trial": index % spec.trials, "passkey": prompt.passkey,
                "needle": list(prompt.needle), "context_ids": prompt.ids[: prompt.question],
                "question_ids": prompt.ids[prompt.question :],
            })
    return {
        "format": EXPORT_FORMAT, "model": model_path, "haystack": spec.haystack, "seed": spec.seed,
        "trials": spec.trials, "budgets": list(spec.budgets), "decoding": "greedy",
        "max_new_tokens": spec.max_new_tokens, "pad_token_id": tokenizer.pad_token_id, "prompts": prompts,
    }


# -- outputs -------------------------------------------------------------------------------------
def configs(cells: list[Cell]) -> list[tuple[str, float]]:
    """``(config, budget)`` pairs in first-seen order (``Cell.config``: policy and cache settings)."""
    return list(dict.fromkeys((c.config, c.budget) for c in cells))


def plot_heatmap(cells: list[Cell], path, title: str):
    """One panel per policy/budget: needle depth (rows) x context length (columns) -> accuracy,
    with the share of needle tokens still cached under each number."""
    panels = configs(cells)
    contexts = sorted({c.context for c in cells})
    depths = sorted({c.depth for c in cells})
    ncols = min(len(panels), 3)
    nrows = -(-len(panels) // ncols)
    fig, axes = new_figure(ncols=ncols, nrows=nrows, width=1.0 + 1.1 * len(contexts), height=0.6 + 0.5 * len(depths))
    for index, (policy, budget) in enumerate(panels):
        ax = axes[index // ncols][index % ncols]
        group = [c for c in cells if (c.config, c.budget) == (policy, budget)]
        by_key = {(c.depth, c.context): c for c in group}
        grid = [[by_key[d, ctx].accuracy if (d, ctx) in by_key else float("nan") for ctx in contexts] for d in depths]
        notes = None
        if policy_class(group[0].policy).evicts:
            notes = [[f"kept {by_key[d, ctx].needle_kept:.0%}" if (d, ctx) in by_key else "" for ctx in contexts]
                     for d in depths]
        annotated_heatmap(ax, grid, [f"{d:g}" for d in depths], [str(c) for c in contexts], notes=notes)
        ax.set_title(policy if not policy_class(group[0].policy).evicts else f"{policy}, {budget:.0%} cache", fontsize=10)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("needle depth")
    for index in range(len(panels), nrows * ncols):
        axes[index // ncols][index % ncols].axis("off")
    fig.suptitle(title + "\ncell: accuracy; kept = share of the needle's tokens still cached after generation", fontsize=10)
    return save_figure(fig, path)


def summary_table(cells: list[Cell]) -> str:
    depths = sorted({c.depth for c in cells})
    headers = ["policy", "budget", "context", *[f"d={d:g}" for d in depths], "mean", "needle kept"]
    rows = []
    for policy, budget in configs(cells):
        for context in sorted({c.context for c in cells}):
            group = [c for c in cells if (c.config, c.budget, c.context) == (policy, budget, context)]
            by_depth = {c.depth: c for c in group}
            accuracy = [f"{by_depth[d].correct}/{by_depth[d].trials}" for d in depths]
            mean = sum(c.accuracy for c in group) / len(group)
            # None: a peer's row (tools/peer/run_kvpress.py), whose cache keeps no token positions
            kept = [c.needle_kept for c in group if c.needle_kept is not None]
            rows.append([policy, budget, context, *accuracy, f"{mean:.0%}", f"{sum(kept) / len(kept):.0%}" if kept else "-"])
    return format_table(headers, rows)
