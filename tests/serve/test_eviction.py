"""The server's eviction settings from ``--recipe``/``--budget`` and a request's ``h2o.recipe``
(``h2okv.serve.eviction``), without a model."""

import pytest

from h2okv import H2OError
from h2okv.core.budget import DEFAULT_BUDGET_FLOOR
from h2okv.serve.eviction import EvictionDefaults
from h2okv.settings import CacheSettings


def test_the_default_keeps_the_floor_for_a_short_chat_prompt():
    # 20% of a 37-token chat question was 3 + 3 slots, and the default model answered nonsense
    assert EvictionDefaults().resolve(37) == ("h2o", DEFAULT_BUDGET_FLOOR // 2, DEFAULT_BUDGET_FLOOR // 2)
    assert EvictionDefaults().resolve(5000) == ("h2o", 500, 500)  # long prompts: the paper's 10% + 10%
    assert EvictionDefaults.from_options(budget_floor=0).resolve(37) == ("h2o", 3, 3)


def test_a_server_recipe_sets_policy_prefill_and_share():
    prompt = EvictionDefaults.from_options(recipe="prompt", budget=0.2)
    assert (prompt.policy, prompt.prefill, prompt.settings.recent_share) == ("kvzip:question=32,probe_upto=2560,question_kernel=31,words=1", "late", 0.01)
    assert prompt.describe()["recipe"] == "prompt"
    # 20% of 2000 tokens, 1% of it recent; each part rounds down
    assert prompt.resolve(2000) == ("kvzip:question=32,probe_upto=2560,question_kernel=31,words=1", int(0.2 * 0.99 * 2000), int(0.2 * 0.01 * 2000))
    bounded = EvictionDefaults.from_options(recipe="bounded")  # no budget: the recipe's 20%
    assert bounded.resolve(1000) == ("snapkv:window=32,kernel=31,pool=max,words=1", 184, 15)
    # flags beside the recipe replace its parts
    chunked = EvictionDefaults.from_options(recipe="prompt", prefill="chunked", policy="h2o", budget=256)
    assert chunked.prefill == "chunked" and chunked.resolve(2000) == ("h2o", 253, 3)


def test_a_request_recipe_uses_its_own_policy_and_share():
    server = EvictionDefaults.from_options(budget=0.2)
    assert server.resolve(1000, recipe="bounded") == ("snapkv:window=32,kernel=31,pool=max,words=1", 184, 15)
    assert server.resolve(1000, recipe="bounded", budget={"budget": 100}) == (
        "snapkv:window=32,kernel=31,pool=max,words=1", 92, 8)
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
        EvictionDefaults.from_options(**settings)  # checked as it is built
    assert "\n" not in str(err.value)


def test_a_recipes_head_split_reaches_the_caches_of_its_own_policy_only():
    document = EvictionDefaults.from_options(recipe="document")
    assert document.cache_options() == {"kvzip": {"head_budgets": "layers", "head_floor": 0.0}}
    assert document.describe()["head_budgets"] == "layers"
    assert EvictionDefaults.from_options(recipe="document", policy="h2o").cache_options() == {}
    assert EvictionDefaults.from_options(recipe="bounded").cache_options() == {}
    assert EvictionDefaults.from_options(recipe="prompt").cache_options() == {
        "kvzip:question=32,probe_upto=2560,question_kernel=31,words=1": {"head_budgets": "layers", "head_floor": 0.0}}
    assert "head_budgets" not in EvictionDefaults().describe()
    smoothed = EvictionDefaults.from_options(recipe="document", policy="kvzip:kernel=7")
    assert smoothed.cache_options() == {"kvzip:kernel=7": {"head_budgets": "layers", "head_floor": 0.0}}


def test_the_server_holds_one_checked_cache_settings_value():
    bounded = EvictionDefaults.from_options(recipe="bounded", budget=0.3)
    assert isinstance(bounded.settings, CacheSettings) and bounded.settings.recipe == "bounded"
    # a streamed prefill is read chunked by the server (it schedules a prompt's chunks itself)
    assert bounded.prefill == bounded.settings.prefill == "chunked"
    assert (bounded.settings.budget, bounded.settings.recent_share) == (0.3, 0.078)
    # a policy ranked by reconstruction reads its prompts late whatever --prefill says
    assert EvictionDefaults.from_options(policy="kvzip", prefill="chunked").prefill == "late"
    assert EvictionDefaults().settings == CacheSettings.build()
    with pytest.raises(H2OError, match="policy 'full' keeps every token"):
        EvictionDefaults.from_options(policy="full", budget=0.2)


@pytest.mark.parametrize("prompt_len", [37, 1000, 5000])
@pytest.mark.parametrize(("server", "asked", "library"), [
    # a budget fraction, then slots, then parts in the request: they replace the server's whole budget
    ({"budget": 0.2}, {"budget": {"budget": 0.1, "recent_share": 0.25}},
     {"policy": "h2o", "budget": 0.1, "recent_share": 0.25}),
    ({"budget": 0.2}, {"budget": {"budget": 300}}, {"policy": "h2o", "budget": 300}),
    ({"budget": 0.2}, {"budget": {"heavy": 40, "recent": 8}}, {"policy": "h2o", "heavy": 40, "recent": 8}),
    ({"budget": 0.2}, {"budget": {"heavy_ratio": 0.05, "recent_ratio": 0.15}},
     {"policy": "h2o", "heavy_ratio": 0.05, "recent_ratio": 0.15}),
    # the server's budget carries over to a request's policy, and its recipe splits it its own way
    ({"budget": 0.3}, {"policy": "tova"}, {"policy": "tova", "budget": 0.3}),
    ({"heavy": 30, "recent": 10}, {"policy": "kvzip"}, {"policy": "kvzip", "heavy": 30, "recent": 10, "prefill": "late"}),
    ({"budget": 0.3}, {"recipe": "bounded"}, {"recipe": "bounded", "budget": 0.3}),
    ({"budget": 0.3}, {"recipe": "generation", "budget": {"budget": 256}}, {"recipe": "generation", "budget": 256}),
    ({"recipe": "prompt", "budget": 0.2}, {}, {"recipe": "prompt", "budget": 0.2}),
    # switching to or from a policy that keeps every token: the server's budget does not carry over
    ({"budget": 0.2}, {"policy": "full"}, {"policy": "full"}),
    ({"policy": "full"}, {"policy": "h2o"}, {"policy": "h2o"}),
])
def test_a_request_resolves_through_cache_settings(server, asked, library, prompt_len):
    """Each request's (policy, heavy, recent) is a ``CacheSettings``' own: the one the library
    builds from the same keywords, at the server's floor."""
    defaults = EvictionDefaults.from_options(**server)
    expected = CacheSettings.build(**library)
    assert defaults.resolve(prompt_len, **asked) == (expected.policy, *expected.resolve(prompt_len))
    settings = defaults.request(**asked)
    assert isinstance(settings, CacheSettings) and settings.resolve(prompt_len) == expected.resolve(prompt_len)
    assert settings.budget_floor == defaults.settings.budget_floor


def test_a_request_keeps_the_servers_prefill_floor_and_own_split():
    document = EvictionDefaults.from_options(recipe="document", budget_floor=16)
    same = document.request(budget={"budget": 0.1})
    assert (same.policy, same.head_budgets, same.prefill, same.budget_floor) == ("kvzip", "layers", "late", 16)
    other = document.request(policy="h2o")  # the head split goes with the server's policy only
    assert (other.head_budgets, other.prefill, other.budget_floor, other.budget) == ("uniform", "late", 16, 0.2)
    # a request's recipe brings its policy and share, not its prefill or positions
    streamed = EvictionDefaults().request(recipe="stream", policy="kvzip")
    assert (streamed.policy, streamed.prefill, streamed.positions) == ("kvzip", "late", "true")
    assert EvictionDefaults().request(recipe="bounded").prefill == "chunked"
