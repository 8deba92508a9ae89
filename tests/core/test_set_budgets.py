"""``H2OCache.set_budgets``: a history held whole (a budget that keeps every token), then a smaller
budget and a question read on it, keeps what reading history and question in one call keeps (the
same window queries rank the same keys, pooled as one sequence), and the rows end at the new budget."""

import pytest
import torch

from h2okv import H2OCache
from h2okv.core.compat import cache_arg
from h2okv.errors import H2OError

POLICY = "snapkv:kernel=7,pool=max,window=8"


def kept(cache) -> list[torch.Tensor]:
    """Each layer's live tokens, by ordinal, per head: what the cache holds."""
    return [torch.sort(torch.where(layer.valid, layer.ordinal, -1), dim=-1).values for layer in cache.layers]


def read(model, cache, ids, start=0):
    return model(input_ids=ids, position_ids=torch.arange(start, start + ids.shape[1])[None],
                 **cache_arg(cache), use_cache=True).logits[0, -1]


def test_a_history_held_whole_then_a_question_keeps_what_one_call_keeps(llama):
    torch.manual_seed(0)
    ids = torch.randint(3, llama.config.vocab_size, (1, 90))
    history, question = ids[:, :70], ids[:, 70:]  # the question at least the window: the same queries rank
    one = H2OCache(llama, policy=POLICY, heavy=20, recent=4)
    expected = read(llama, one, ids)

    held = H2OCache(llama, policy=POLICY, heavy=1000, recent=1)
    read(llama, held, history)
    assert all(int(layer.valid.sum(-1).min()) == 70 for layer in held.layers)  # nothing evicted yet
    held.set_budgets([(20, 4)])
    got = read(llama, held, question, start=70)

    torch.testing.assert_close(got, expected)
    for mine, theirs in zip(kept(held), kept(one), strict=True):
        assert torch.equal(mine[..., -24:], theirs[..., -24:])
    assert all(int(layer.valid.sum(-1).max()) == 24 for layer in held.layers)  # at the new budget
    for step in range(3):  # decode steps go on alike, each row at its budget
        token = expected.argmax()[None, None]
        expected, got = read(llama, one, token, 90 + step), read(llama, held, token, 90 + step)
        torch.testing.assert_close(got, expected)
    assert all(int(layer.valid.sum(-1).max()) == 24 for layer in held.layers)


def test_set_budgets_refuses_what_it_cannot_do(llama):
    full = H2OCache(llama, policy="full")
    with pytest.raises(H2OError, match="keeps everything"):
        full.set_budgets([(4, 4)])
    fresh = H2OCache(llama, policy=POLICY, heavy=8, recent=2)
    with pytest.raises(H2OError, match="has run"):
        fresh.set_budgets([(4, 4)])
    read(llama, fresh, torch.arange(3, 23)[None])
    with pytest.raises(H2OError, match="2 budgets for 1 rows"):
        fresh.set_budgets([(4, 4), (4, 4)])
