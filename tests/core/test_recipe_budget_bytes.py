"""A budget is the bytes the user sees: ``budget=0.2`` under every recipe, through
``model.generate`` with the cache handed in (the drop-in path), holds at most 23% of a full cache's
KV bytes for the same tokens (the 3 points: kvzip's tail and a dense layer's room, stated in
``stats()``), and the full cache it is measured against is the one transformers would hold."""

import pytest
import torch
from transformers import DynamicCache

from char_tokenizers import CharTokenizer
from h2okv import H2OCache
from h2okv.core.compat import cache_arg
from h2okv.recipes import RECIPES
from h2okv.tools.tiny import tiny_model

PROMPT, NEW = 800, 16


def generate(model, ids, cache):
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_arg(cache), max_new_tokens=NEW,
                       min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return cache


def dynamic_bytes(cache: DynamicCache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


@pytest.fixture(scope="module")
def setting():
    model = tiny_model("qwen2", layers=3, max_position_embeddings=2048, initializer_range=0.3)  # GQA: 4 heads on 2
    g = torch.Generator().manual_seed(0)
    # two rows of different texts: their layer and head splits differ (kvzip), a batch holds both
    ids = torch.stack([torch.randint(2, 90, (PROMPT,), generator=g), torch.randint(40, 60, (PROMPT,), generator=g)])
    return model, ids, dynamic_bytes(generate(model, ids, DynamicCache(config=model.config)))


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_recipe_holds_its_budget_in_bytes(setting, recipe):
    model, ids, full_bytes = setting
    cache = generate(model, ids, H2OCache(model, recipe=recipe, budget=0.2, budget_floor=0, tokenizer=CharTokenizer()))
    stats = cache.stats()
    # the final token is sampled, never read back: a full cache holds PROMPT + NEW - 1 tokens
    assert stats["tokens_seen"] == PROMPT + NEW - 1 and stats["full_kv_bytes"] == full_bytes
    assert stats["kv_share"] == stats["kv_bytes"] / full_bytes <= 0.23, stats["kv_share"]
    assert stats["live_share"] <= 0.2 + NEW / (PROMPT + NEW)  # kvzip keeps its tail's new tokens whole
