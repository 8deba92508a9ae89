"""The hand-over from ``SlotLayer.update`` to the ``"h2o"`` attention function fails closed, and a
model prepared by h2okv runs its own attention for every call no ``H2OCache`` hands over, until
``restore_model`` puts it back as it was."""

import pytest
import torch
from transformers import AttentionInterface, DynamicCache

from h2okv import H2OCache, restore_model
from h2okv.core.attention import ATTN_NAME, get_pending, h2o_attention_forward, set_pending
from h2okv.core.compat import cache_arg
from h2okv.errors import H2OError
from h2okv.tools.tiny import random_ids, tiny_model

ARCHS = ("llama", "qwen2")
IMPLS = ("eager", "sdpa")


def built(arch, impl):
    model = tiny_model(arch)
    model.set_attn_implementation(impl)
    return model


def mlps(model):
    return [module for name, module in model.named_modules() if name.endswith(".mlp")]


@pytest.mark.parametrize("arch", ARCHS)
def test_a_key_changed_after_the_cache_update_is_refused_naming_the_layer(arch, monkeypatch):
    model = tiny_model(arch)
    cache = H2OCache(model)

    def copying_key(module, query, key, value, attention_mask, **kwargs):
        # a model that changes the key between cache.update and attention (a cast, a repeat_kv, a norm)
        return h2o_attention_forward(module, query, key.clone(), value, attention_mask, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, ATTN_NAME, copying_key)
    attention = type(model.model.layers[0].self_attn).__name__
    with pytest.raises(H2OError, match=rf"^layer 0 \({attention}\): the key reaching attention is not the one"):
        model(input_ids=random_ids(10), **cache_arg(cache))
    assert get_pending() is None  # the refused call left nothing for the next one


def test_a_hand_over_for_another_key_is_refused():
    model = tiny_model("llama")
    layer = H2OCache(model).layers[1]
    module = model.model.layers[1].self_attn
    q, k, v = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16)
    set_pending((layer, k.clone(), v))
    with pytest.raises(H2OError, match=r"layer 1 \(LlamaAttention\)"):
        h2o_attention_forward(module, q, k, v, None)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("arch", ARCHS)
def test_a_prepared_model_gives_its_own_logits_with_any_other_cache(arch, impl):
    reference, model = built(arch, impl), built(arch, impl)  # the same seed: the same weights
    H2OCache(model)
    assert model.config._attn_implementation == ATTN_NAME
    ids = random_ids(12, batch=2)
    padded = torch.ones_like(ids)
    padded[0, :3] = 0  # a left-padded row: the masks differ by implementation (eager's is additive)
    for mask in (None, padded):
        assert torch.equal(model(input_ids=ids, attention_mask=mask, use_cache=False).logits,
                           reference(input_ids=ids, attention_mask=mask, use_cache=False).logits)
        # a prompt, then a call over what is cached (the masks' lengths then differ from the call's)
        caches = DynamicCache(config=model.config), DynamicCache(config=reference.config)
        for part in (slice(0, 8), slice(8, 11), slice(11, 12)):
            kwargs = {} if mask is None else {"attention_mask": mask[:, :part.stop]}
            got, want = (m(input_ids=ids[:, part], **kwargs, **cache_arg(c)).logits
                         for m, c in zip((model, reference), caches, strict=True))
            assert torch.equal(got, want), (mask is not None, part)


def test_a_hand_over_a_plain_call_never_reaches_is_not_taken_for_its_own():
    model, reference = tiny_model("llama"), tiny_model("llama")
    k = torch.randn(1, 2, 5, 16)
    H2OCache(model).layers[0].update(k, k)  # a layer fed by hand: its hand-over is never taken
    ids = random_ids(9)
    assert torch.equal(model(input_ids=ids, use_cache=False).logits, reference(input_ids=ids, use_cache=False).logits)


@pytest.mark.parametrize("impl", IMPLS)
def test_restore_model_puts_the_attention_hooks_and_feed_forward_back(impl):
    model = built("llama", impl)
    H2OCache(model)
    H2OCache(model)  # prepared twice: the implementation before the first is the one remembered
    assert model.config._attn_implementation == ATTN_NAME
    assert all("forward" in vars(mlp) for mlp in mlps(model))
    restore_model(model)
    assert model.config._attn_implementation == impl
    assert not any(module._forward_pre_hooks for module in model.modules())
    assert all("forward" not in vars(mlp) and not hasattr(mlp, "_h2okv_sliced") for mlp in mlps(model))
    # a new cache prepares it again
    cache = H2OCache(model)
    assert model.config._attn_implementation == ATTN_NAME
    model(input_ids=random_ids(6), **cache_arg(cache))
    restore_model(model)
    assert model.config._attn_implementation == impl


def test_restore_keeps_a_forward_set_on_the_module_before():
    model = tiny_model("llama")
    mlp = mlps(model)[0]
    own = mlp.forward  # a forward on the module itself, as a hook library sets one
    mlp.forward = own
    H2OCache(model)
    assert mlp.forward is not own
    restore_model(model)
    assert vars(mlp)["forward"] is own
