"""Growing a layer's slots without counting them every step: counting is a device sync, which on
a GPU stalls the launch queue once per layer and step (``SlotLayer._live_bound``)."""

import pytest
import torch

from h2okv import H2OCache
from h2okv.core.compat import cache_arg
from h2okv.core.layer import SlotLayer
from h2okv.tools.tiny import random_ids, tiny_model


def decode(policy, steps=12, **budget):
    model = tiny_model("llama")
    ids = random_ids(30 + steps, batch=3, seed=1)
    cache = H2OCache(model, policy=policy, chunk_size=8, **budget)
    logits = [model(ids[:, :30], **cache_arg(cache)).logits]
    return model, ids, cache, logits


@pytest.mark.parametrize("policy, budget", [("full", {}), ("h2o", {"heavy": 20, "recent": 20})])
def test_decode_growth_counts_live_slots_only_when_buffers_change(policy, budget, monkeypatch):
    model, ids, cache, logits = decode(policy, **budget)
    counts, resizes = [], []
    original, resize = SlotLayer._count_live, SlotLayer.resize
    monkeypatch.setattr(SlotLayer, "_count_live", lambda self: counts.append(1) or original(self))
    monkeypatch.setattr(SlotLayer, "resize", lambda self, n: resizes.append(n) or resize(self, n))
    for t in range(30, ids.shape[1]):
        logits.append(model(ids[:, t:t + 1], **cache_arg(cache)).logits)
    # full grows by one slot a step and never counts; h2o (budget 40 of 42 tokens) counts when the
    # bound says "grow" and eviction may have freed slots: at most once a layer and growth
    assert len(counts) <= (0 if policy == "full" else len(resizes))
    if policy != "full":
        assert 0 < len(resizes) <= 2 * len(cache.layers)  # amortised: 30 -> 38 -> 41 slots, not one a step
    for layer in cache.layers:
        assert int(layer.valid.sum(-1).max()) <= layer.capacity
        if policy == "full":
            assert layer.capacity == ids.shape[1]  # exact growth: never more memory than a plain cache


def test_full_policy_decode_equals_the_plain_model():
    """The uncounted growth changes no result: full's logits equal the model with its own cache."""
    model, ids, cache, logits = decode("full")
    for t in range(30, ids.shape[1]):
        logits.append(model(ids[:, t:t + 1], **cache_arg(cache)).logits)
    torch.testing.assert_close(torch.cat(logits, 1), model(ids).logits, atol=1e-5, rtol=1e-5)
