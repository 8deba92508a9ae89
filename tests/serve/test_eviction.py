"""The server's eviction settings from ``--recipe``/``--budget`` and a request's ``h2o.recipe``
(``h2okv.serve.eviction``), without a model."""

import pytest

from h2okv import H2OError
from h2okv.core.budget import DEFAULT_BUDGET_FLOOR
from h2okv.serve.eviction import EvictionDefaults


def test_the_default_keeps_the_floor_for_a_short_chat_prompt():
    # 20% of a 37-token chat question was 3 + 3 slots, and the default model answered nonsense
    assert EvictionDefaults().resolve(37) == ("h2o", DEFAULT_BUDGET_FLOOR // 2, DEFAULT_BUDGET_FLOOR // 2)
    assert EvictionDefaults().resolve(5000) == ("h2o", 500, 500)  # long prompts: the paper's 10% + 10%
    assert EvictionDefaults(budget_floor=0).resolve(37) == ("h2o", 3, 3)


def test_a_server_recipe_sets_policy_prefill_and_share():
    prompt = EvictionDefaults.from_options(recipe="prompt", budget=0.2)
    assert (prompt.policy, prompt.prefill, prompt.recent_share) == ("kvzip:question=32", "late", 0.01)
    assert prompt.describe()["recipe"] == "prompt"
    # 20% of 2000 tokens, 1% of it recent; each part rounds down
    assert prompt.resolve(2000) == ("kvzip:question=32", int(0.2 * 0.99 * 2000), int(0.2 * 0.01 * 2000))
    bounded = EvictionDefaults.from_options(recipe="bounded")  # no budget: the recipe's 20%
    assert bounded.resolve(1000) == ("snapkv:window=32,kernel=31,pool=max", 184, 15)
    # flags beside the recipe replace its parts
    chunked = EvictionDefaults.from_options(recipe="prompt", prefill="chunked", policy="h2o", budget=256)
    assert chunked.prefill == "chunked" and chunked.resolve(2000) == ("h2o", 253, 3)


def test_a_request_recipe_uses_its_own_policy_and_share():
    server = EvictionDefaults.from_options(budget=0.2)
    assert server.resolve(1000, recipe="bounded") == ("snapkv:window=32,kernel=31,pool=max", 184, 15)
    assert server.resolve(1000, recipe="bounded", budget={"budget": 100}) == (
        "snapkv:window=32,kernel=31,pool=max", 92, 8)
    assert server.resolve(1000, policy="local", recipe="bounded")[0] == "local"  # an explicit policy wins
    assert server.resolve(2000, budget={"budget": 0.1, "recent_share": 0.25}) == ("h2o", 150, 50)
    assert server.resolve(1000, policy="full") == ("full", None, None)


@pytest.mark.parametrize("settings", [
    {"recipe": "nope"},
    {"budget": 0.2, "heavy": 3},
    {"budget": 2.5},
    {"recent_share": 0.1, "heavy": 3, "recent": 3},
])
def test_bad_server_settings_are_one_line_errors(settings):
    with pytest.raises(H2OError) as err:
        EvictionDefaults.from_options(**settings).validate()
    assert "\n" not in str(err.value)


def test_a_recipes_head_split_reaches_the_caches_of_its_own_policy_only():
    document = EvictionDefaults.from_options(recipe="document")
    assert document.cache_options() == {"kvzip": {"head_budgets": "layers", "head_floor": 0.0}}
    assert document.describe()["head_budgets"] == "layers"
    assert EvictionDefaults.from_options(recipe="document", policy="h2o").cache_options() == {}
    assert EvictionDefaults.from_options(recipe="bounded").cache_options() == {}
    assert EvictionDefaults.from_options(recipe="prompt").cache_options() == {
        "kvzip:question=32": {"head_budgets": "layers", "head_floor": 0.0}}
    assert "head_budgets" not in EvictionDefaults().describe()
    smoothed = EvictionDefaults.from_options(recipe="document", policy="kvzip:kernel=7")
    assert smoothed.cache_options() == {"kvzip:kernel=7": {"head_budgets": "layers", "head_floor": 0.0}}
