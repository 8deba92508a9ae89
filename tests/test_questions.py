"""``h2okv.ask``: one context read once, many questions answered from copies of its state, as rows
of one batch; each answer is what a fresh cache gives reading the context, then that question."""

import warnings

import pytest
import torch

from h2okv import H2OCache, H2OError, read_context
from h2okv.core.compat import cache_arg
from h2okv.generation import read_ahead
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


def kept(cache) -> list[set[int]]:
    """Each layer's kept ordinals (row 0, KV head 0)."""
    return [set(layer.read("ordinal")[0, 0][layer.read("valid")[0, 0]].tolist()) for layer in cache.layers]


@pytest.mark.parametrize("prefill", ["chunked", "late"])
def test_a_context_held_for_its_question_is_ranked_as_if_read_with_it(prefill):
    """A policy ranked by a call's last 32 queries holds a context read before its question: nothing
    is evicted by the read, and the question's call ranks all of it. With a question as long as the
    window that is one call of context and question: the same kept slots, the same answer."""
    model, tok = tiny_model("llama"), word_tokenizer()
    context, question = random_ids(48, seed=3), random_ids(40, seed=5)[0].tolist()
    settings = dict(policy="snapkv:kernel=31,pool=max,words=1", prefill=prefill, budget=16, budget_floor=0,
                    recent_share=0.078, tokenizer=tok)
    held = H2OCache(model, **settings)
    read_context(model, tok, held, context)
    assert all(len(k) == 48 for k in kept(held))  # the whole context, until the question is read
    ids = torch.cat([context, torch.tensor([question])], dim=1)
    one = H2OCache(model, **settings)
    answers = []
    for cache in (held, one):
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                                 do_sample=False, pad_token_id=tok.pad_token_id, **cache_arg(cache))
        answers.append(out[0, ids.shape[1]:].tolist())
    assert kept(held) == kept(one) and all(len(k) == 16 for k in kept(held))  # brought down to the budget
    assert answers[0] == answers[1]


def test_the_bounded_recipe_holds_a_context_and_each_copy_is_ranked_by_its_question(monkeypatch):
    """``bounded`` (streamed) holds too: ``ask``'s copies are each brought to the budget by their
    own question (the answers as a fresh cache gives them in two calls: the test above), and the
    held cache stays whole, to be asked again."""
    model, tok = tiny_model("llama"), word_tokenizer()
    context = random_ids(48, seed=3)
    cache = H2OCache(model, recipe="bounded", budget=16, budget_floor=0, tokenizer=tok)
    read_context(model, tok, cache, context)
    copies = []
    original = H2OCache.take_rows

    def recorded(self, rows):
        copies.append(original(self, rows))
        return copies[-1]

    monkeypatch.setattr(H2OCache, "take_rows", recorded)
    ask_ids(model, tok, cache, context, [random_ids(20, seed=7)[0].tolist()] * 2, max_new_tokens=2)
    assert all(len(k) == 48 for k in kept(cache))
    live = {int(layer.read("valid")[row, 0].sum()) for layer in copies[0].layers for row in range(2)}
    assert live == {16}  # every copy at its budget after its question and answer (68 tokens read)


def test_a_context_ranked_by_its_own_end_warns_with_what_to_use_instead():
    """``kvzip`` past ``probe_upto`` (the ``prompt`` recipe past 2,560 tokens) ranks a context read
    alone by its last queries: the context's own end. A warning says so; within the pass's reach,
    or held (``bounded``), there is none."""
    model, tok = tiny_model("llama"), word_tokenizer()
    context = random_ids(48, seed=3)
    policy = "kvzip:question=8,probe_upto=32,question_kernel=3"
    past = H2OCache(model, policy=policy, budget=16, budget_floor=0, prefill="late")
    with pytest.warns(UserWarning, match="recipe='bounded'"):
        read_context(model, tok, past, context)
    for settings, ids in ((dict(policy=policy, prefill="late"), context[:, :30]), (dict(recipe="bounded"), context)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            read_context(model, tok, H2OCache(model, budget=16, budget_floor=0, tokenizer=tok, **settings), ids)
    with warnings.catch_warnings(), torch.inference_mode():  # generate's read of a prompt whose end is its question
        warnings.simplefilter("error")
        read_ahead(model, tok, H2OCache(model, policy=policy, budget=16, budget_floor=0, prefill="late"), context)


def test_hold_false_compresses_the_context_now_and_hold_true_where_it_cannot_is_one_line():
    model, tok = tiny_model("llama"), word_tokenizer()
    context = random_ids(48, seed=3)
    now = H2OCache(model, recipe="bounded", budget=16, budget_floor=0, tokenizer=tok)
    read_context(model, tok, now, context, hold=False)
    assert all(len(k) == 16 for k in kept(now))  # ranked by the context's own end
    for settings, reason in ((dict(policy="h2o", budget=16), "does not rank a call by its last queries"),
                             (dict(recipe="document", budget=0.25), "does not rank a call by its last queries"),
                             (dict(policy="full"), "keeps everything"),
                             (dict(policy="snapkv", budget=16, head_budgets="adaptive"), "hold needs 'uniform'")):
        cache = H2OCache(model, budget_floor=0, **settings) if "budget" in settings else H2OCache(model, **settings)
        with pytest.raises(H2OError, match=reason) as error:
            read_context(model, tok, cache, context, hold=True)
        assert "\n" not in str(error.value)
    again = H2OCache(model, recipe="bounded", budget=16, budget_floor=0, tokenizer=tok)
    read_context(model, tok, again, context)
    with pytest.raises(H2OError, match="has read tokens already"):
        read_context(model, tok, again, context, hold=True)


def test_a_question_agnostic_read_ahead_is_never_held():
    """The evaluations' agnostic mode compresses a context before its question exists, whatever the
    policy: ``read_ahead`` with an end never holds (else ``bounded``'s agnostic rows would rank by
    the question, and be question-aware rows in all but name)."""
    from h2okv.generation import read_ahead

    model, tok = tiny_model("llama"), word_tokenizer()
    ids = torch.cat([random_ids(48, seed=3), random_ids(10, seed=4)], dim=1)
    cache = H2OCache(model, recipe="bounded", budget=16, budget_floor=0, tokenizer=tok)
    with torch.inference_mode():
        read_ahead(model, tok, cache, ids, end=48)
    assert all(len(k) == 16 for k in kept(cache))


def test_a_held_context_refuses_a_one_token_question_in_one_line_and_then_ranks_a_longer_one():
    """A single token (a decode step) could evict one slot of the whole context, not bring it to
    the budget: refused in one line, on the cache and on its copies; two tokens rank it as usual."""
    model, tok = tiny_model("llama"), word_tokenizer()
    context = random_ids(48, seed=3)
    cache = H2OCache(model, recipe="bounded", budget=16, budget_floor=0, tokenizer=tok)
    read_context(model, tok, cache, context)
    with pytest.raises(H2OError, match="two tokens or more") as error:
        ask_ids(model, tok, cache, context, [[5]], max_new_tokens=2)
    assert "\n" not in str(error.value)
    with pytest.raises(H2OError, match="two tokens or more"), torch.inference_mode():
        model(input_ids=torch.tensor([[5]]), **cache_arg(cache.take_rows([0])))  # a copy holds it too
    assert ask_ids(model, tok, cache, context, [[5, 6]], max_new_tokens=2)
    assert all(len(k) == 48 for k in kept(cache))  # still held: the copies were ranked, not the cache
