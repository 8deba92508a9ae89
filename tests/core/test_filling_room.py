"""Decode steps below the budget skip the eviction while no (row, head) can exceed its budget
(``decode.FillingStep.room``), and change nothing by it: the same logits and kept tokens as steps
that rank every time."""

import pytest
import torch

from h2okv import H2OCache
from h2okv.core import decode as decode_module
from h2okv.core.compat import cache_arg
from h2okv.tools.tiny import random_ids, tiny_model

PROMPT, STEPS = 14, 14  # budget 10 + 10: 6 steps of room, then 8 at the budget


def run(policy, ids, lengths, monkeypatch, room: bool):
    """Left-padded rows of ``lengths`` real prompt tokens, then ``STEPS`` decode steps."""
    if not room:
        monkeypatch.setattr(decode_module, "filling_room", lambda layer, room: 0)
    model = tiny_model("llama")
    cache = H2OCache(model, policy=policy, heavy=10, recent=10, chunk_size=4)
    mask = torch.ones(ids.shape[0], PROMPT + STEPS, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :PROMPT - n] = 0
    evictions = []
    real_evict = decode_module.evict
    monkeypatch.setattr(decode_module, "evict", lambda layer, m: evictions.append(layer.layer_idx) or real_evict(layer, m))
    logits = [model(ids[:, :PROMPT], attention_mask=mask[:, :PROMPT], **cache_arg(cache)).logits[:, -1]]
    steppers = []
    for t in range(PROMPT, PROMPT + STEPS):
        out = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], **cache_arg(cache))
        logits.append(out.logits[:, -1])
        steppers.append(type(cache.layers[0].stepper).__name__)
    kept = [sorted(layer.ordinal[layer.valid].tolist()) for layer in cache.layers]
    monkeypatch.undo()
    return torch.stack(logits), kept, evictions, steppers


@pytest.mark.parametrize("policy", ["h2o", "tova", "rkv"])
def test_room_skips_the_eviction_and_changes_nothing(policy, monkeypatch):
    ids = random_ids(PROMPT + STEPS, batch=2, seed=4)
    lengths = [PROMPT, PROMPT - 3]  # the longer row has the least room: 20 - 14 = 6 steps
    fast, fast_kept, fast_evictions, fast_steppers = run(policy, ids, lengths, monkeypatch, room=True)
    slow, slow_kept, slow_evictions, _ = run(policy, ids, lengths, monkeypatch, room=False)
    torch.testing.assert_close(fast, slow, atol=0, rtol=0)
    assert fast_kept == slow_kept
    layers = len(set(slow_evictions))
    assert len(fast_evictions) == len(slow_evictions) - 6 * layers  # the 6 steps of room ranked nothing
    assert fast_steppers[:6] == ["FillingStep"] * 6


def test_random_ranks_every_step(monkeypatch):
    """``random`` draws one number per slot and ranking: it gets no room, its draws stay in step."""
    ids = random_ids(PROMPT + STEPS, batch=1, seed=4)
    _, _, evictions, _ = run("random", ids, [PROMPT], monkeypatch, room=True)
    _, _, every_step, _ = run("random", ids, [PROMPT], monkeypatch, room=False)
    assert len(evictions) == len(every_step)
