"""Every recipe is drop-in: ``model.generate(ids, cache=H2OCache(model, recipe=R, budget=B))``.
For the recipes ranked by reconstruction (``prompt``, ``document``: kvzip) the pass runs inside
``generate`` (``core/autorank.py``): held to the explicit calls it replaces, never run twice, and
refused in one line where it cannot run."""

import pytest
import torch

from char_tokenizers import Tok
from h2okv import H2OCache, reconstruct
from h2okv.core.compat import cache_arg
from h2okv.core.layer import SlotLayer
from h2okv.core.reconstruction import read_context
from h2okv.errors import H2OError
from h2okv.recipes import RECIPE_NAMES
from h2okv.tools.tiny import random_ids, tiny_model

NEW = 6
pytestmark = pytest.mark.filterwarnings("ignore:h2okv. a budget of")


def greedy(model, ids, cache, new=NEW, **kwargs):
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_arg(cache), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=1, **kwargs)
    return out[:, ids.shape[1]:]


def held_above_budget(cache) -> int:
    """The most live tokens any (row, layer, head) holds above its budget as ranked (kvzip's tail)."""
    return max(int((layer.live_slots() - (layer.slot_budget() - layer.probe.tail_slots)).max()) for layer in cache.layers)


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_every_recipe_runs_in_generate_within_its_budget(recipe):
    model, ids = tiny_model(), random_ids(100, batch=2)
    cache = H2OCache(model, recipe=recipe, budget=0.2, budget_floor=0, tokenizer=Tok())
    new = greedy(model, ids, cache)
    assert new.shape == (2, NEW)
    assert cache.budget()[0] == cache.budget()[1] in (19, 20)  # a fifth of each prompt, rounded by its split
    assert not any(layer.probe.awaiting for layer in cache.layers)  # ranked, not held whole
    # the tokens read after a ranking by reconstruction are kvzip's tail, above the budget
    assert held_above_budget(cache) <= (NEW - 1 if cache.policy.ranks_by_reconstruction else 0)
    assert cache.stats()["above_budget_tokens"] == max(held_above_budget(cache), 0)


@pytest.mark.parametrize("recipe", ["prompt", "document"])
def test_reconstruction_in_generate_equals_the_explicit_pass(recipe):
    """Drop-in ranks the whole prompt (its last token too) after the prompt's forward, whose logits
    give the first token: the same as that forward, ``reconstruct`` on the whole prompt, then
    greedy steps by hand."""
    model, ids = tiny_model(seed=3), random_ids(60, seed=2)
    dropped = greedy(model, ids, H2OCache(model, recipe=recipe, budget=0.2, budget_floor=0, tokenizer=Tok()))

    cache = H2OCache(model, recipe=recipe, budget=0.2, budget_floor=0)
    tokens = []
    with torch.inference_mode():
        logits = model(input_ids=ids, **cache_arg(cache), use_cache=True).logits
        reconstruct(model, cache, ids, Tok())
        for _ in range(NEW):
            tokens.append(logits[:, -1].argmax(-1, keepdim=True))
            logits = model(input_ids=tokens[-1], **cache_arg(cache), use_cache=True).logits
    assert dropped.tolist() == torch.cat(tokens, 1).tolist()


@pytest.mark.parametrize("recipe", ["prompt", "document"])
def test_generate_outside_inference_mode_as_a_user_calls_it(recipe):
    """README's call has no ``torch.inference_mode()`` around it: ``generate`` decodes under
    ``no_grad``, and a ranking made in inference mode inside it left tensors its next step could
    not update ("Inplace update to inference tensor outside InferenceMode"). The same tokens as
    under inference mode; and a context read by ``read_context`` outside it decodes on too."""
    model, ids = tiny_model(seed=3), random_ids(60, seed=2)
    inside = greedy(model, ids, H2OCache(model, recipe=recipe, budget=0.2, budget_floor=0, tokenizer=Tok()))
    cache = H2OCache(model, recipe=recipe, budget=0.2, budget_floor=0, tokenizer=Tok())
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_arg(cache), max_new_tokens=NEW,
                         min_new_tokens=NEW, do_sample=False, pad_token_id=1)
    assert out[:, ids.shape[1]:].tolist() == inside.tolist()
    read = H2OCache(model, recipe=recipe, budget=0.2, budget_floor=0)
    read_context(model, Tok(), read, ids[:, :40])
    more = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_arg(read), max_new_tokens=NEW,
                          min_new_tokens=NEW, do_sample=False, pad_token_id=1)
    assert more.shape == (1, ids.shape[1] + NEW)


def test_an_explicit_ranking_is_not_repeated(monkeypatch):
    """read_context (and the server's rank_by_probes) rank between the prompt's call and the next
    one: the hook then finds the cache ranked, and ask's copies of it are never ranked again."""
    model, ids = tiny_model(), random_ids(50)
    passes, start_probe = [], SlotLayer.start_probe
    monkeypatch.setattr(SlotLayer, "start_probe", lambda layer: (passes.append(layer.layer_idx), start_probe(layer)))
    cache = H2OCache(model, recipe="document", budget=0.2, budget_floor=0)  # no tokenizer: none is needed
    with torch.inference_mode():
        read_context(model, cache, ids[:, :-1], Tok())
    greedy(model, ids, cache)
    twin = cache.take_rows([0])
    greedy(model, torch.cat([ids, random_ids(5, seed=9)], 1), twin)
    assert passes == [0, 1]  # one pass, both layers


def test_a_prompt_of_one_call_is_ranked_before_the_next_call_only():
    model, ids = tiny_model(), random_ids(40)
    cache = H2OCache(model, recipe="document", budget=0.2, budget_floor=0, tokenizer=Tok())
    greedy(model, ids, cache, new=1)  # one new token: no second call, the prompt stays whole
    assert all(layer.probe.awaiting for layer in cache.layers)
    assert "not ranked yet" in cache.summary()
    with torch.inference_mode():
        model(input_ids=ids[:, :1], **cache_arg(cache))  # the next call ranks it first
    assert not any(layer.probe.awaiting for layer in cache.layers)
    assert cache.get_seq_length() == 41


def test_the_tokenizer_comes_from_the_models_folder(tiny_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    cache = H2OCache(model, recipe="document", budget=0.2, budget_floor=0)
    greedy(model, random_ids(40), cache, new=3)
    assert cache.tokenizer is not None and not cache.layers[0].probe.awaiting


def test_errors_are_one_line():
    model, ids = tiny_model(), random_ids(40, batch=2)
    with pytest.raises(H2OError, match="pass H2OCache\\(model, ..., tokenizer=tokenizer\\)") as err:
        greedy(model, ids, H2OCache(model, recipe="prompt", budget=0.2, budget_floor=0))
    assert "\n" not in str(err.value)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    cache = H2OCache(model, recipe="document", budget=0.2, budget_floor=0, tokenizer=Tok())
    with pytest.raises(H2OError, match="takes no padding") as err, torch.inference_mode():
        model.generate(ids, attention_mask=mask, **cache_arg(cache), max_new_tokens=2, pad_token_id=1)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("recipe", ["prompt", "document"])
def test_a_tail_in_the_budget_keeps_the_live_tokens_within_it(recipe):
    """``kvzip:tail_in_budget=1``: the ranking keeps ``tail`` fewer heavy slots and the tokens read
    after it fill them, so the cache's live tokens stay within budget x heads x layers (with the
    tail on top they pass it), and the tail's tokens are still kept whole."""
    model, ids = tiny_model(), random_ids(100)
    spec = "kvzip:tail=4" + (",question=32" if recipe == "prompt" else "")
    live = {}
    for inside in (0, 1):
        cache = H2OCache(model, recipe=recipe, policy=f"{spec},tail_in_budget={inside}", budget=0.2, budget_floor=0,
                         tokenizer=Tok())
        greedy(model, ids, cache)
        live[inside] = sum(int(layer.live_slots().sum()) for layer in cache.layers)
        for layer in cache.layers:
            layer.to_dense()  # a layer the C step holds flat is read in its dense layout
        last = cache.get_seq_length() - 4  # the tail's 4 tokens: every head holds them
        assert all(bool(((layer.ordinal >= last) & layer.valid).sum(-1).eq(4).all()) for layer in cache.layers)
        assert cache.stats()["above_budget_tokens"] == (0 if inside else 4)
    whole = cache.budget()[0] * len(cache.layers) * cache.layers[0].valid.shape[1]
    assert live[1] <= whole < live[0]


def test_a_prompt_past_probe_upto_is_ranked_in_generate_without_a_tokenizer():
    """Past ``kvzip:probe_upto`` no probe is read, so none is built: ``generate`` ranks the prompt by
    its question's attention with no tokenizer at hand, as the explicit pass does."""
    model, ids = tiny_model(seed=3), random_ids(60, seed=2)
    options = dict(recipe="prompt", policy="kvzip:question=8,probe_upto=40,question_kernel=3", budget=0.2,
                   budget_floor=0)
    cache = H2OCache(model, **options)  # no tokenizer
    dropped = greedy(model, ids, cache)
    assert not any(layer.probe.awaiting for layer in cache.layers)
    explicit = H2OCache(model, **options)
    with torch.inference_mode():
        model(input_ids=ids, **cache_arg(explicit), use_cache=True)
    reconstruct(model, explicit, ids, Tok())
    for a, b in zip(cache.layers, explicit.layers, strict=True):  # the prompt's tokens each kept (the tail on top)
        assert prompt_kept(a, 60) == prompt_kept(b, 60)
    assert dropped.shape == (1, NEW)


def prompt_kept(layer, n):
    layer.to_dense()
    return [sorted(o for o in layer.ordinal[0, h][layer.valid[0, h]].tolist() if o < n)
            for h in range(layer.valid.shape[1])]
