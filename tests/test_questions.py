"""``h2okv.ask``: one context read once, many questions answered from copies of its state, as rows
of one batch; each answer is what a fresh cache gives reading the context, then that question."""

import pytest
import torch

from h2okv import H2OCache, H2OError, read_context
from h2okv.core.compat import cache_arg
from h2okv.questions import ask, ask_ids
from h2okv.tools.tiny import random_ids, tiny_model, word_tokenizer

SETTINGS = {
    "h2o": dict(policy="h2o", budget=12),
    "document": dict(recipe="document", budget=0.25),  # kvzip: ranked by reconstruction before any question
    "bounded": dict(recipe="bounded", budget=16),
}


def alone(model, tok, settings, context, question, new):
    """Reading the context, then the question, into a fresh cache: two calls."""
    cache = H2OCache(model, budget_floor=0, **settings)
    read_context(model, tok, cache, context)
    ids = torch.cat([context, torch.tensor([question])], dim=1)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             do_sample=False, pad_token_id=tok.pad_token_id, **cache_arg(cache))
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_each_answer_is_the_two_call_answer_and_the_context_is_read_once(name):
    model, tok = tiny_model("llama"), word_tokenizer()
    context = random_ids(48, seed=3)
    questions = [random_ids(n, seed=10 + n)[0].tolist() for n in (3, 9, 5)]
    cache = H2OCache(model, budget_floor=0, **SETTINGS[name])
    read_context(model, tok, cache, context)
    before = cache.stats()
    calls = []
    hook = model.register_forward_pre_hook(lambda m, a, k: calls.append(k["input_ids"].shape), with_kwargs=True)
    answers = ask_ids(model, tok, cache, context, questions, max_new_tokens=6)
    hook.remove()
    assert calls[0] == (3, 9)  # one batch: only the questions are read, the context never again
    assert cache.stats() == before  # the context's own state is untouched: ask again at will
    for question, answer in zip(questions, answers, strict=True):
        assert answer == alone(model, tok, SETTINGS[name], context, question, 6)


def test_text_questions_and_clear_errors():
    model, tok = tiny_model("llama"), word_tokenizer()
    context = random_ids(30, seed=1)
    cache = H2OCache(model, budget=10)
    with pytest.raises(H2OError, match="read_context first"):
        ask(model, tok, cache, context, ["w5 w6"])
    read_context(model, tok, cache, context)
    texts = ask(model, tok, cache, context, ["w5 w6", "w7"], max_new_tokens=3)
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
    with pytest.raises(H2OError, match="list of questions"):
        ask(model, tok, cache, context, "w5")
    with pytest.raises(H2OError, match="at least one token"):
        ask(model, tok, cache, context, ["w5", []])
