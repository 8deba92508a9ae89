"""``H2OCache.compact``: a state kept aside (the server's prefix store) holds each head's own live
slots only when a cache-wide split left its heads uneven, and a copy taken from it generates
exactly what the uncompacted state does."""

import torch

from h2okv import H2OCache
from h2okv.core.compat import cache_arg
from h2okv.core.reconstruction import read_context
from h2okv.tools.tiny import tiny_model, word_tokenizer


def test_a_compacted_state_costs_its_live_slots_and_resumes_the_same():
    model, tok = tiny_model("llama"), word_tokenizer()
    context = torch.randint(5, 60, (1, 80), generator=torch.Generator().manual_seed(3))
    cache = H2OCache(model, recipe="document", budget=0.2, budget_floor=0)
    read_context(model, tok, cache, context, start=0)
    live = sum(int(layer.live_slots().sum()) for layer in cache.layers)
    kept = cache.take_rows([0])  # dense, as a decode batch holds it
    kept.trim()
    dense = sum(layer.kv_bytes() for layer in kept.layers)
    kept.compact()
    config = model.config
    slot = 2 * (config.hidden_size // config.num_attention_heads) * 4  # K and V of one token of one head, fp32
    assert sum(layer.kv_bytes() for layer in kept.layers) == live * slot < dense  # the heads were uneven

    def answer(state):
        ids = torch.cat([context, torch.tensor([[7, 8, 9]])], dim=1)
        with torch.inference_mode():  # read_context built the state in inference mode
            out = model.generate(ids, **cache_arg(state), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                 pad_token_id=0)
        return out[0, ids.shape[1]:].tolist()

    assert answer(kept.take_rows([0])) == answer(cache)
