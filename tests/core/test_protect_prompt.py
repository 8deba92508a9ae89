"""``H2OCache(protect_prompt=True)``: each row's prompt is kept whole and the budget ranks what
follows (TriAttention's rule), held to the shared guarantees: the budget kept at every step,
exact with a budget that covers everything, batch == batch-of-one, GQA without expanding K/V,
the C step where the rule allows (equal to eager)."""

import pytest
import torch
from transformers import DynamicCache, LogitsProcessorList

from h2okv import H2OCache, H2OError
from h2okv.core.compat import cache_arg
from h2okv.core.kernels import unavailable_reason, use_kernels
from h2okv.generation import pad_rows
from h2okv.tools.tiny import BudgetWatch, random_ids, tiny_model


def greedy(model, ids, cache, attention_mask=None, steps=16, processors=()):
    out = model.generate(ids, attention_mask=attention_mask, **cache_arg(cache), max_new_tokens=steps,
                         min_new_tokens=steps, do_sample=False, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=0, logits_processor=LogitsProcessorList(list(processors)))
    return out.sequences, torch.stack(out.logits, dim=1)


@pytest.mark.parametrize("policy", ["h2o", "tova", "h2o-mean", "local", "h2o-sink"])
def test_the_prompt_stays_whole_and_the_budget_holds_every_step(policy):
    model = tiny_model("qwen2")  # GQA: 4 query heads on 2 KV heads
    prompt, budget, steps = 30, 8, 20
    cache = H2OCache(model, policy=policy, budget=budget, protect_prompt=True)
    watch = BudgetWatch(cache)
    greedy(model, random_ids(prompt, seed=4), cache, steps=steps, processors=[watch])
    assert cache.budget() == [prompt + budget] and cache.stats()["protect_prompt"]
    assert all(max(s["slots"]) <= prompt + budget for s in watch.history)
    assert max(watch.history[-1]["slots"]) == prompt + budget  # it did evict: 49 tokens seen, 38 kept
    for layer in cache.layers:
        live = layer.read("valid")[0]
        ordinal = layer.read("ordinal")[0]
        assert live.shape[0] == 2  # KV heads, never expanded
        for h in range(2):
            kept = set(ordinal[h][live[h]].tolist())
            assert set(range(prompt)) <= kept  # every prompt token, in every head


def test_exact_when_the_budget_covers_the_answer():
    model = tiny_model("llama")
    ids = random_ids(20, seed=2)
    tokens, logits = greedy(model, ids, H2OCache(model, budget=16, protect_prompt=True), steps=14)
    ref_tokens, ref_logits = greedy(model, ids, DynamicCache(config=model.config), steps=14)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("policy", ["h2o", "tova"])
def test_batch_equals_batch_of_one(policy):
    model = tiny_model("llama")
    seqs = [random_ids(n, seed=n)[0].tolist() for n in (12, 21)]
    ids, mask = pad_rows(seqs, pad_id=0)
    tokens, _ = greedy(model, ids, H2OCache(model, policy=policy, budget=6, protect_prompt=True),
                       attention_mask=mask)
    for i, s in enumerate(seqs):
        alone, _ = greedy(model, torch.tensor([s]), H2OCache(model, policy=policy, budget=6, protect_prompt=True))
        assert tokens[i, ids.shape[1]:].tolist() == alone[0, len(s):].tolist()


def test_the_c_step_equals_eager():
    if unavailable_reason("native", torch.device("cpu")):
        pytest.skip("no C compiler")
    model = tiny_model("qwen2")
    ids, mask = pad_rows([random_ids(n, seed=n)[0].tolist() for n in (10, 17)], pad_id=0)
    runs = {}
    for kernels in ("native", "eager"):
        with use_kernels(kernels):
            runs[kernels] = greedy(model, ids, H2OCache(model, budget=6, protect_prompt=True), attention_mask=mask)
    assert torch.equal(runs["native"][0], runs["eager"][0])
    torch.testing.assert_close(runs["native"][1], runs["eager"][1], atol=1e-5, rtol=0)


def test_refused_where_it_cannot_hold():
    model = tiny_model("llama")
    with pytest.raises(H2OError, match="protect_prompt"):
        H2OCache(model, policy="kvzip", prefill="late", protect_prompt=True)
    with pytest.raises(H2OError, match="protect_prompt"):
        H2OCache(model, policy="h2o", prefill="late", head_budgets="adaptive", protect_prompt=True)
    cache = H2OCache(model, budget=8, protect_prompt=True)
    with pytest.raises(H2OError, match="add_rows"):
        cache.add_rows([(4, 4)])
