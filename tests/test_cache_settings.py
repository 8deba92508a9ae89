"""``CacheSettings`` (``h2okv.settings``): one value from the keywords to the cache, checked once,
the same for the library and the server, and recorded by ``stats()``."""

import subprocess
import sys

import pytest
import torch

from h2okv import (
    CacheSettings,  # exported at the top level, as the library guide shows
    H2OCache,
    H2OError,
)
from h2okv.core.compat import cache_arg
from h2okv.recipes import RECIPE_NAMES
from h2okv.serve.eviction import EvictionDefaults


def read(model, cache, length=60):
    ids = torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(input_ids=ids, **cache_arg(cache), use_cache=True)
    return cache


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_a_value_and_its_keywords_build_the_same_cache(llama, recipe):
    keywords = {"recipe": recipe, "budget": 0.3, "budget_floor": 0}
    by_value = H2OCache(llama, CacheSettings.build(**keywords))
    by_keywords = H2OCache(llama, **keywords)
    for name in ("prefill", "recent_share", "head_budgets", "head_floor", "chunk_size", "recipe", "spec"):
        assert getattr(by_value, name) == getattr(by_keywords, name), name
    assert by_value.policy.spec == by_keywords.policy.spec
    assert by_value.stats()["settings"] == by_keywords.stats()["settings"]


def test_from_recipe_expands_the_recipe_and_overrides_win():
    settings = CacheSettings.from_recipe("bounded", 0.25, chunk_size=64)
    assert settings.policy == "snapkv:window=32,kernel=31,pool=max,words=1"  # the spec with every option spelled out
    assert settings.prefill == "streamed"
    assert settings.recent_share == 0.078 and settings.budget == 0.25 and settings.chunk_size == 64
    assert CacheSettings.from_recipe("generation").budget == 0.2  # a recipe without a budget keeps its fifth
    described = settings.describe()
    assert described["recipe"] == "bounded" and described["budget"] == 0.25 and described["chunk_size"] == 64
    assert "compileable" not in described  # only what differs from the defaults


def test_resolve_is_the_cache_s_budget_after_a_prompt(llama):
    settings = CacheSettings.build(policy="h2o", budget=0.2, budget_floor=0)
    cache = read(llama, H2OCache(llama, settings))
    heavy, recent = settings.resolve(60)
    assert cache.budget() == [heavy + recent] and (heavy, recent) == (6, 6)
    assert CacheSettings.build(policy="full").resolve(60) == (None, None)


def test_one_spelling_per_value_and_replace_switches_it():
    with pytest.raises(H2OError, match="give either budget= or heavy=, not both"):
        CacheSettings.build(budget=0.2, heavy=4)
    parts = CacheSettings.build(budget=0.2).replace(heavy=4, recent=4)  # the parts replace the budget
    assert parts.budget is None and parts.recent_share is None and parts.resolve(1000) == (4, 4)
    back = parts.replace(budget=16)
    assert back.heavy is None and back.resolve(1000) == (8, 8)


@pytest.mark.parametrize("bad, message", [
    ({"policy": "nope"}, "unknown policy"),
    ({"prefill": "sometimes"}, "prefill must be one of chunked, late"),
    ({"chunk_size": 0}, "chunk_size must be >= 1"),
    ({"policy": "kvzip"}, "use prefill=late"),
    ({"head_budgets": "layers"}, "head_budgets=layers shares slots among all layers"),
    ({"colour": "blue"}, "unknown cache setting(s): colour"),
])
def test_bad_settings_fail_before_any_model(bad, message):
    with pytest.raises(H2OError) as info:
        CacheSettings.build(**bad)
    assert message in str(info.value)


def test_a_value_and_keywords_together_are_refused(llama):
    with pytest.raises(H2OError, match="CacheSettings or keywords, not both"):
        H2OCache(llama, CacheSettings.build(), budget=0.3)


@pytest.mark.parametrize("recipe", ["bounded", "generation", "stream", "prompt"])
@pytest.mark.parametrize("prompt_len", [40, 1000, 5000])
def test_the_server_splits_a_budget_as_the_library_does(recipe, prompt_len):
    server = EvictionDefaults.from_options(recipe=recipe, budget=0.2)
    policy, heavy, recent = server.resolve(prompt_len)
    library = CacheSettings.from_recipe(recipe, 0.2)
    assert policy == library.policy and (heavy, recent) == library.resolve(prompt_len)


def test_the_module_loads_no_torch():
    code = "import sys, h2okv.settings; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
