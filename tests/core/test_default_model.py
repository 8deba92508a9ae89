"""On the real embedded SmolLM2-135M-Instruct (GQA: 9 query heads, 3 KV heads, 30 layers)."""

import pytest
import torch
from transformers import DynamicCache, LogitsProcessorList

from h2okv import H2OCache
from h2okv.core.compat import cache_arg
from h2okv.corpus import read_play
from h2okv.tools.tiny import BudgetWatch

pytestmark = pytest.mark.integration


def hamlet_ids(tokenizer, n):
    ids = tokenizer(read_play("hamlet_gut"), add_special_tokens=False)["input_ids"][:n]
    return torch.tensor([ids])


def test_hamlet_1024_plus_256_within_budget(default_model):
    """Acceptance: 1024-token prompt + 256 generated at heavy 10% + recent 10%: every layer holds
    <= budget slots at every step and kv_bytes <= 0.21 x full_kv_bytes at the end."""
    model, tokenizer = default_model
    ids = hamlet_ids(tokenizer, 1024)
    cache = H2OCache(model, policy="h2o", heavy_ratio=0.1, recent_ratio=0.1)
    watch = BudgetWatch(cache)
    model.generate(ids, **cache_arg(cache), max_new_tokens=256, min_new_tokens=256, do_sample=False,
                   logits_processor=LogitsProcessorList([watch]), pad_token_id=tokenizer.pad_token_id)
    assert cache.budget() == [204]
    assert len(watch.history) == 256
    for stats in watch.history:
        assert len(stats["slots"]) == 30
        assert max(stats["slots"]) <= 204
    final = cache.stats()
    assert final["tokens_seen"] == 1024 + 255
    assert final["kv_bytes"] <= 0.21 * final["full_kv_bytes"]
    assert cache.layers[0].keys.shape[1] == 3  # KV heads, never expanded to the 9 query heads


def test_default_model_exact_with_large_budget(default_model):
    model, tokenizer = default_model
    ids = hamlet_ids(tokenizer, 300)
    kwargs = dict(max_new_tokens=16, do_sample=False, output_logits=True, return_dict_in_generate=True,
                  pad_token_id=tokenizer.pad_token_id)
    ref = model.generate(ids, **cache_arg(DynamicCache(config=model.config)), **kwargs)
    ours = model.generate(ids, **cache_arg(H2OCache(model, heavy=200, recent=200, chunk_size=128)), **kwargs)
    assert torch.equal(ours.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(ref.logits), atol=1e-4, rtol=0)
