"""Recipes (``h2okv.recipes``), the one ``budget`` argument, the budget floor, the warning for a
degenerate budget and ``cache.summary()``."""

import warnings

import pytest
import torch

from h2okv import H2OCache, H2OError
from h2okv.core.budget import DEFAULT_BUDGET_FLOOR, DEGENERATE_SLOTS, BudgetSpec, H2OBudgetWarning, budget_keywords
from h2okv.core.compat import cache_arg
from h2okv.policies import make_policy
from h2okv.recipes import RECIPE_NAMES, RECIPES, expand, get_recipe, parse_recipes, recipe_runs
from h2okv.tools.tiny import tiny_model

# what each recipe must stand for: the configurations docs/RESULTS.md measured best for its use
EXPECTED = {
    "prompt": {"policy": "kvzip:question=32,probe_upto=2560,question_kernel=31,words=1", "prefill": "late", "head_budgets": "layers", "head_floor": 0.0,
               "recent_share": 0.01},
    "bounded": {"policy": "snapkv:kernel=31,pool=max,words=1", "prefill": "streamed", "recent_share": 0.078},
    "document": {"policy": "kvzip", "prefill": "late", "head_budgets": "layers", "head_floor": 0.0,
                 "recent_share": 0.01},
    "generation": {"policy": "rkv", "prefill": "chunked", "recent_share": 0.5},
    "stream": {"policy": "h2o-mean", "prefill": "chunked", "recent_share": 0.5, "positions": "rolling"},
}


def run(model, cache, length=40, new=4, seed=0):
    ids = torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_arg(cache),
                          max_new_tokens=new, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_recipe_expands_to_its_measured_configuration(llama, name):
    assert get_recipe(name).settings == EXPECTED[name]
    cache = H2OCache(llama, recipe=name, budget=0.25)
    spelled = EXPECTED[name]
    assert cache.policy.spec == make_policy(spelled["policy"]).spec
    assert cache.prefill == spelled["prefill"]
    assert cache.head_budgets == spelled.get("head_budgets", "uniform")
    assert (cache.rolling is not None) == (spelled.get("positions") == "rolling")
    assert cache.recipe == name and cache.stats()["recipe"] == name
    # the budget is split by the recipe's recent share: 25% of a 400-token prompt
    share = spelled["recent_share"]
    assert cache.spec.heavy_ratio == pytest.approx(0.25 * (1 - share))
    assert cache.spec.recent_ratio == pytest.approx(0.25 * share)


def test_a_recipe_is_the_same_cache_as_its_keywords_spelled_out(llama):
    by_name = H2OCache(llama, recipe="bounded", budget=0.5, budget_floor=0)
    spelled = H2OCache(llama, policy="snapkv:window=32,kernel=31,pool=max,words=1", budget=0.5, recent_share=0.078,
                       prefill="chunked", budget_floor=0)
    out_a, out_b = run(llama, by_name, new=6), run(llama, spelled, new=6)
    assert torch.equal(out_a, out_b)
    assert by_name.budget() == spelled.budget() == [19]  # 50% of 40 tokens: 18 ranked + 1 recent
    assert by_name.stats()["slots"] == spelled.stats()["slots"]


def test_keywords_beside_a_recipe_replace_its_parts(llama):
    cache = H2OCache(llama, recipe="prompt", budget=0.2, prefill="chunked", policy="h2o")
    assert cache.policy.spec == "h2o" and cache.prefill == "chunked" and cache.recipe == "prompt"
    assert cache.spec.recent_ratio == pytest.approx(0.2 * 0.01)  # the recipe's share still splits the budget
    # the older spelling of a budget beside a recipe: its parts as given, no share applied
    assert H2OCache(llama, recipe="bounded", heavy=7, recent=3).spec == BudgetSpec(heavy=7, recent=3)
    assert expand("stream", positions="true")["positions"] == "true"
    # the recipe's head split goes with its own policy: h2o beside `prompt` keeps the uniform split
    assert cache.head_budgets == "uniform" and "head_budgets" not in expand("document", policy="h2o")
    assert expand("document", policy="kvzip")["head_budgets"] == "layers"
    assert expand("document", policy="kvzip:kernel=7")["head_budgets"] == "layers"  # its own policy, other options
    assert expand(None, policy="h2o", prefill=None) == {"policy": "h2o"}


def test_a_recipe_without_a_budget_keeps_a_fifth(llama):
    cache = H2OCache(llama, recipe="generation", budget_floor=0)
    run(llama, cache, length=100)
    assert cache.budget() == [20]
    # the keywords README once recommended, which raised a TypeError: the default fifth, split by the share
    spelled = H2OCache(llama, policy="snapkv", prefill="late", recent_share=0.078, budget_floor=0)
    assert spelled.spec.heavy_ratio == pytest.approx(0.2 * 0.922) and spelled.spec.recent_ratio == pytest.approx(0.2 * 0.078)


def test_unknown_recipes_and_bad_budgets_are_one_line_errors(llama):
    for bad in (lambda: H2OCache(llama, recipe="fast"), lambda: parse_recipes("prompt,nope"), lambda: parse_recipes(" , ")):
        with pytest.raises(H2OError) as err:
            bad()
        assert "\n" not in str(err.value)
    assert "choose one of prompt, bounded, document, generation, stream" in str(
        pytest.raises(H2OError, H2OCache, llama, recipe="fast").value)
    for budget in (0.0, -0.1, 1.5, 0, -3, float("nan"), float("inf"), True, "0.2", None and 1):
        if budget is None:
            continue
        with pytest.raises(H2OError):
            H2OCache(llama, budget=budget)
    with pytest.raises(H2OError, match="not both"):
        H2OCache(llama, budget=0.2, heavy=4, recent=4)
    with pytest.raises(H2OError, match="recent_share= splits budget="):
        H2OCache(llama, heavy=4, recent=4, recent_share=0.1)
    with pytest.raises(H2OError, match="keeps every token"):
        H2OCache(llama, policy="full", budget=0.2)
    with pytest.raises(H2OError, match="recent_share= must be a number in"):
        H2OCache(llama, budget=0.2, recent_share=1.5)


def test_budget_is_a_fraction_or_slots():
    assert budget_keywords(0.2) == {"heavy_ratio": pytest.approx(0.1), "recent_ratio": pytest.approx(0.1)}
    assert budget_keywords(1.0) == {"heavy_ratio": 0.5, "recent_ratio": 0.5}  # 1.0 is the whole prompt
    assert budget_keywords(256) == {"heavy": 128, "recent": 128}
    assert budget_keywords(256.0) == {"heavy": 128, "recent": 128}
    assert budget_keywords(100, recent_share=0.05) == {"heavy": 95, "recent": 5}
    assert budget_keywords(0.2, recent_share=0.0) == {"heavy_ratio": pytest.approx(0.2), "recent_ratio": 0.0}


def test_slot_budgets_hold_whatever_the_prompt(llama):
    cache = H2OCache(llama, budget=12)
    run(llama, cache, length=40, new=5)
    assert cache.budget() == [12]
    assert max(cache.stats()["slots"]) <= 12


def test_the_floor_raises_a_fraction_of_a_short_prompt():
    spec = BudgetSpec.build(make_policy("h2o"), heavy_ratio=0.1, recent_ratio=0.1)
    assert spec.floor == DEFAULT_BUDGET_FLOOR
    assert sum(spec.resolve(37)) == DEFAULT_BUDGET_FLOOR  # 20% of 37 tokens would be 7 slots
    heavy, recent = spec.resolve(37)
    assert heavy == recent == DEFAULT_BUDGET_FLOOR // 2  # split as the ratios are
    long = DEFAULT_BUDGET_FLOOR * 10
    assert spec.resolve(long) == (long // 10, long // 10)  # above the floor: the fraction itself
    off = BudgetSpec.build(make_policy("h2o"), heavy_ratio=0.1, recent_ratio=0.1, floor=0)
    assert off.resolve(37) == (3, 3)
    skewed = BudgetSpec.build(make_policy("snapkv"), heavy_ratio=0.19, recent_ratio=0.01, floor=100)
    assert skewed.resolve(10) == (95, 5)
    # slot counts given as such are never raised
    assert BudgetSpec.build(make_policy("h2o"), heavy=3, recent=3).resolve(37) == (3, 3)
    with pytest.raises(H2OError, match="budget_floor"):
        BudgetSpec.build(make_policy("h2o"), heavy_ratio=0.1, recent_ratio=0.1, floor=-1)


def test_the_help_texts_floor_is_the_librarys():
    import argparse

    from h2okv.cli.args import add_budget_args

    parser = argparse.ArgumentParser()
    add_budget_args(parser)
    floor = next(action for action in parser._actions if action.dest == "budget_floor")
    assert f"(default: {DEFAULT_BUDGET_FLOOR})" in floor.help  # generated from the CacheSettings field


def test_the_floor_applies_in_the_cache_and_can_be_turned_off(llama):
    floored, plain = H2OCache(llama), H2OCache(llama, budget_floor=0)
    run(llama, floored, length=40)
    run(llama, plain, length=40)
    assert floored.budget() == [DEFAULT_BUDGET_FLOOR]
    assert plain.budget() == [8]  # 4 + 4: the paper's 10% + 10% of 40 tokens


def test_a_floor_above_the_length_is_exactly_the_full_cache(llama):
    full, floored = H2OCache(llama, policy="full"), H2OCache(llama, budget=0.2)
    assert torch.equal(run(llama, full, length=30, new=8), run(llama, floored, length=30, new=8))


def test_a_degenerate_budget_warns_once_per_cache(llama):
    with pytest.warns(H2OBudgetWarning, match=f"at least {DEGENERATE_SLOTS} slots"):
        run(llama, H2OCache(llama, budget=6), new=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", H2OBudgetWarning)
        run(llama, H2OCache(llama, budget=DEGENERATE_SLOTS), new=3)  # at the threshold: no warning
        run(llama, H2OCache(llama, budget=0.2), new=3)  # the floor keeps a fraction above it
        run(llama, H2OCache(llama, policy="full"), new=3)


def test_summary_is_one_line_with_the_recipe_and_the_bytes(llama):
    cache = H2OCache(llama, recipe="bounded", budget=16)
    assert "recipe bounded" in cache.summary() and "\n" not in cache.summary()
    run(llama, cache, length=40, new=4)
    line = cache.summary()
    stats = cache.stats()
    assert "\n" not in line
    assert line.startswith("snapkv:window=32,kernel=31,pool=max,words=1 (recipe bounded): 43 tokens seen")
    assert "budget 16 slots per layer and KV head" in line and "nothing evicted" not in line
    assert f"{stats['kv_bytes'] / 2**20:.2f} MiB vs {stats['full_kv_bytes'] / 2**20:.2f} MiB full" in line
    short = H2OCache(llama, recipe="bounded", budget=0.2)  # the floor (128 slots) keeps 11 tokens whole
    run(llama, short, length=10, new=2)
    assert "budget 128 slots per layer and KV head (more than the tokens seen: nothing evicted)" in short.summary()
    full = H2OCache(llama, policy="full")
    run(llama, full, length=10, new=2)
    assert full.summary().startswith("full: 11 tokens seen, every token kept")


def test_recipe_runs_name_the_policy_and_its_settings():
    runs = recipe_runs(["bounded", "document"])
    assert runs[0] == ("snapkv:kernel=31,pool=max,words=1", {"prefill": "streamed", "recent_share": 0.078}, "bounded")
    assert runs[1][0] == "kvzip" and runs[1][1]["head_budgets"] == "layers" and runs[1][2] == "document"
    assert set(RECIPE_NAMES) == set(RECIPES) == set(EXPECTED)


def test_read_context_ranks_a_document_before_any_question():
    from h2okv import read_context
    from h2okv.tools.tiny import word_tokenizer

    model = tiny_model("llama")
    tokenizer = word_tokenizer()
    context = torch.randint(3, model.config.vocab_size, (1, 60), generator=torch.Generator().manual_seed(1))
    cache = H2OCache(model, recipe="document", budget=0.25, budget_floor=0)
    read_context(model, tokenizer, cache, context)
    assert cache.get_seq_length() == 60
    # ranked and evicted: the cache-wide split moves slots between the two layers, the total is kept
    slots = cache.stats()["slots"]
    assert cache.budget() == [15] and max(slots) < 60 and sum(slots) <= 2 * 15 + 2
    with pytest.raises(H2OError, match="needs the tokenizer"):
        read_context(model, None, H2OCache(model, recipe="document"), context)
    # any other policy just reads the context
    plain = H2OCache(model, budget=0.25, budget_floor=0)
    read_context(model, None, plain, context[0].tolist())
    assert plain.get_seq_length() == 60 and plain.budget() == [14]  # 7 + 7: each half rounds down


def test_a_recipe_is_read_in_its_own_module_only():
    """What a recipe means is expanded in h2okv.recipes (``expand``, ``recipe_runs``,
    ``recipe_policy``): no other module reads a recipe's settings itself."""
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src" / "h2okv"
    readers = sorted(str(path.relative_to(src)) for path in src.rglob("*.py") if path.name != "recipes.py"
                     and any(needle in path.read_text(encoding="utf-8")
                             for needle in ("get_recipe(", "RECIPES[", ".settings[\"policy\"]", "Recipe(")))
    assert readers == []
