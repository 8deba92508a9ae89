"""Recipes: the best configuration we measured for one use, under one name.

A recipe is only a name for a set of ``H2OCache`` keywords (policy, prefill mode, recent share,
head split, positions). ``H2OCache(model, recipe="bounded", budget=0.2)`` is the same cache as
spelling the keywords out, and any keyword given beside the recipe replaces the recipe's. The
policies and options stay available as they are; ``stats()`` and every evaluation row record the
recipe and what it expanded to.

Each recipe is the configuration that scored best for its use on every model we measured
(docs/RESULTS.md, "Recipes"), not one tuned to a single model.

Torch-free on purpose: the command line lists the recipes in ``--help`` without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from h2okv.errors import H2OError

# the budget a recipe keeps when none is given: the paper's "20% KV cache"
DEFAULT_RECIPE_BUDGET = 0.2
# How a budget in bytes (``bytes=0.1``, ``budget="4MiB"``) is coded when kv_bits is not given:
# 8-bit keys, 4-bit values. Chosen on the dev text (Hamlet, 0.5B, streaming perplexity over full's):
# at ~10% of a 16-bit cache's bytes h2o keeping 23% of the tokens in 8/4 bits read 1.048x against
# 10% of them in 16 bits 1.198x, at ~20% 8/4 bits beat 16 bits too; 4-bit keys double the
# perplexity (their outlier channels), 4-bit values cost nothing measurable (docs/RESULTS.md).
BYTES_CODING = {"kv_bits": 4, "key_bits": 8}
# ... with the keys centered (``center_keys``) where the model turns them with RoPE, unless
# center_keys=False: on Hamlet at ~10% of the bytes h2o in 8/4 bits read 1.016x full's perplexity
# centered against 1.048x, and RULER's dev split (2k, 50 prompts) gave `bounded` 82.8 either way;
# 4/4 bits centered at 32% of the tokens (the same bytes) 1.047x and 83.4 (docs/RESULTS.md).
BYTES_CENTER_KEYS = True


# `prompt`'s policy: KVzip's pass with the question's attention beside it, for prompts of up to
# 2,560 tokens; the question's attention alone past them, each token at least at its word's best
PROMPT_POLICY = "kvzip:question=32,probe_upto=2560,question_kernel=31,words=1"
# `bounded`'s policy: the question's attention pooled over 31 tokens, then over each word
BOUNDED_POLICY = "snapkv:kernel=31,pool=max,words=1"


@dataclass(frozen=True)
class Recipe:
    name: str
    #: when to use it, in one line (help texts and README)
    use: str
    #: the ``H2OCache`` keywords it stands for
    settings: dict = field(default_factory=dict)


RECIPES: dict[str, Recipe] = {
    recipe.name: recipe
    for recipe in (
        Recipe(
            "prompt",
            "the question is in the prompt and the prompt may be read whole",
            # KVzip's reconstruction with the question in view: a token scores the larger of the
            # attention the model pays it while repeating the prompt (a whole UUID, every word of a
            # list it must count) and the attention of the question's last 32 queries (what is
            # asked); the whole cache's slots shared out by that score. Costs one more prefill, so
            # only up to 2,560 tokens: past them the question's attention alone ranks, each token
            # taking the best of the 31 around it (bounded's kernel). Dev (essays, seed 0): at 2k
            # the pass wins (88.2 against 83.4, paired -4.9, SE 3.1); at 3k it ties (80.7 against
            # 80.4, paired -0.2, SE 6.3) at 1.58x the prefill; at 6k it loses (82.7 against 85.9,
            # paired +3.2, SE 2.7). 2,560: between the last dev length it won and the first it did
            # not. Past the cut each token also ranks at least at its word's best (words=1, as
            # bounded: a UUID stays whole): dev 3k 85.4 against 80.4 (paired +5.0, SE 5.0), 6k every
            # answer the same; over the pass spans lose (2k: -7.9, SE 2.9), so kvzip never spans it
            # (docs/RESULTS.md)
            {"policy": PROMPT_POLICY, "prefill": "late", "head_budgets": "layers", "head_floor": 0.0,
             "recent_share": 0.01},
        ),
        Recipe(
            "bounded",
            "the question is in the prompt and memory must stay at budget + one chunk",
            # the prompt read through the model in pieces of 512 (core/streamed.py), each ranked by
            # the question's last 32 queries read on top, each token taking the best score within
            # 15 on either side, then its word's best (core/words.py: a UUID of ~34 tokens stays
            # whole): K/V and activations flat in the prompt's length. Dev: 82.2 against 80.3 read
            # in one call, no family lower; with words 86.2 (paired +4.0, SE 2.8: two UUIDs kept, no
            # other answer changed), at 6k every answer the same (docs/RESULTS.md)
            {"policy": BOUNDED_POLICY, "prefill": "streamed", "recent_share": 0.078},
        ),
        Recipe(
            "document",
            "the context is compressed before any question exists (a cached document)",
            # KVzip: ranked by how the model repeats the context, the whole cache's slots shared
            # out among every layer and KV head; h2okv.read_context runs the reconstruction pass
            {"policy": "kvzip", "prefill": "late", "head_budgets": "layers", "head_floor": 0.0,
             "recent_share": 0.01},
        ),
        Recipe(
            "generation",
            "long outputs (reasoning, stories): give the budget in slots, >= 2/3 of prompt + answer",
            # R-KV: h2o's attention share less redundancy, so a trace that repeats itself keeps one
            # copy and room for the rest; as good as h2o with room, far better without
            {"policy": "rkv", "prefill": "chunked", "recent_share": 0.5},
        ),
        Recipe(
            "stream",
            "text past the model's context window, in constant memory",
            # the accumulated mass divided by the number of queries that saw a token: old tokens
            # do not win by age alone over a long stream
            {"policy": "h2o-mean", "prefill": "chunked", "recent_share": 0.5, "positions": "rolling"},
        ),
    )
}
RECIPE_NAMES = tuple(RECIPES)


def get_recipe(name: str) -> Recipe:
    """The recipe called ``name``, else a one-line error that lists them."""
    recipe = RECIPES.get(str(name).strip())
    if recipe is None:
        raise H2OError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPE_NAMES)}")
    return recipe


HEAD_SPLIT = ("head_budgets", "head_floor")  # how a recipe shares its slots among heads


def expand(recipe: str | None, **given) -> dict:
    """The recipe's keywords overlaid with the ``given`` ones that are not None (what the user
    spelled out wins); with no recipe, just the given keywords. A recipe's head split
    (``head_budgets``, ``head_floor``) belongs to its own policy: another policy given beside it
    keeps the default split (as the server gives it to the recipe's policy only)."""
    explicit = {key: value for key, value in given.items() if value is not None}
    if recipe is None:
        return explicit
    settings = dict(get_recipe(recipe).settings)
    if "policy" in explicit and not owns_head_split(settings["policy"], explicit["policy"]):
        settings = {key: value for key, value in settings.items() if key not in HEAD_SPLIT}
    return {**settings, **explicit}


def owns_head_split(recipe_policy: str, policy) -> bool:
    """Whether a recipe's head split reaches ``policy`` (a spec or a ``Policy``): only the recipe's
    own policy, with any options of it (``kvzip:kernel=7`` beside ``document``), takes it."""
    from h2okv.policies import make_policy  # here, not at the top: `h2okv --help` must not import torch

    return make_policy(policy).name == make_policy(recipe_policy).name


def recipe_policy(name: str) -> str:
    """The policy recipe ``name`` runs (as its expansion says)."""
    return expand(name)["policy"]


def recipe_runs(names: list[str]) -> list[tuple[str, dict, str]]:
    """``(policy, cache keywords but the policy, recipe name)`` for each recipe in ``names``: how an
    evaluation grid runs a recipe beside its plain policies."""
    runs = []
    for name in names:
        settings = dict(get_recipe(name).settings)
        runs.append((settings.pop("policy"), settings, name))
    return runs


def parse_recipes(text: str | None) -> list[str]:
    """``--recipe prompt,bounded`` -> the names, each checked (one-line error for an unknown one)."""
    if text is None:
        return []
    names = [get_recipe(part).name for part in (p.strip() for p in text.split(",")) if part]
    if not names:
        raise H2OError(f"--recipe is empty; choose from {', '.join(RECIPE_NAMES)}")
    return list(dict.fromkeys(names))


def recipe_help() -> str:
    """One help line naming each recipe and its use."""
    return "; ".join(f"{r.name}: {r.use}" for r in RECIPES.values())
