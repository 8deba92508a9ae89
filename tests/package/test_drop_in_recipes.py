"""Every recipe is drop-in on the real default model: ``model.generate`` with
``H2OCache(model, recipe=R, budget=0.2)`` and nothing else (kvzip's pass runs inside generate,
with the tokenizer of the model's folder)."""

import pytest
import torch

from h2okv import H2OCache
from h2okv.core.compat import cache_arg
from h2okv.corpus import read_play, token_prefix
from h2okv.recipes import RECIPE_NAMES

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_every_recipe_runs_in_generate(default_model, recipe):
    model, tokenizer = default_model
    ids = torch.tensor([token_prefix(tokenizer, read_play(), 400)])
    cache = H2OCache(model, recipe=recipe, budget=0.2)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_arg(cache), max_new_tokens=8,
                             min_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape == (1, 408)
    stats = cache.stats()
    assert not stats["awaiting_ranking"] and stats["tokens_seen"] == 407
    for layer in cache.layers:  # each head within its own budget (a cache-wide split's, kvzip's tail included)
        assert bool((layer.live_slots() <= layer.slot_budget()).all())
    assert stats["above_budget_tokens"] <= (7 if cache.policy.ranks_by_reconstruction else 0)
