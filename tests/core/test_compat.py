"""The cache reaches the model under the name the installed transformers reads (``cache`` from
5.24, ``past_key_values`` before): a dropped name would run every model with a fresh, unbounded cache."""

import inspect

import torch
from transformers.models.llama.modeling_llama import LlamaModel

from h2okv import H2OCache
from h2okv.core.compat import cache_arg, cache_kwarg, passed_cache


def test_the_name_is_the_one_the_model_forward_declares():
    assert cache_kwarg() in inspect.signature(LlamaModel.forward).parameters


def test_a_cache_passed_by_that_name_is_the_one_the_model_fills_and_evicts(arch_model):
    _, model = arch_model
    cache = H2OCache(model, policy="h2o", heavy=4, recent=4)
    ids = torch.randint(3, model.config.vocab_size, (2, 24))
    model(input_ids=ids, **cache_arg(cache), use_cache=True)
    step = model(input_ids=ids[:, -1:], **cache_arg(cache), use_cache=True)
    assert cache.get_seq_length() == 25
    assert max(cache.stats()["slots"]) == 8
    assert step.logits.shape[:2] == (2, 1)


def test_a_forward_hook_finds_the_cache_under_either_spelling():
    marker = object()
    assert passed_cache({"cache": marker}) is marker
    assert passed_cache({"past_key_values": marker}) is marker
    assert passed_cache({"cache": None, "past_key_values": marker}) is marker
    assert passed_cache({"input_ids": 1}) is None
