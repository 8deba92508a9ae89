"""Attention, from transformers' call to the softmax: the registered ``"h2o"`` function, the
hand-over from the cache, the mass-returning attention over slots, and model preparation.

transformers calls ``cache.update(k, v, layer_idx)`` and then the attention function. Our cache's
update only records the new states; this function sees that the key it receives is the one the
cache just recorded and does the slot work there (it has the query). For any other cache (a
plain ``DynamicCache``, no cache) it runs the attention the model ran before ``prepare_model``
(remembered per config), with that attention's own mask, so the model keeps working as before;
``restore_model`` puts the model back as it was.

``PENDING`` is the hand-over: ``SlotLayer.update`` records ``(layer, key_states, value_states)``
in it, per thread, and the attention function takes the query to ``SlotLayer.attend`` only with
that same key object; a different key while a hand-over is pending is refused (``H2OError``).

``slot_attention`` is the attention the steps run over slot buffers (``step.py``). Grouped-query
attention without expanding K/V: the ``g`` query heads that share a KV head are packed into the
query-length axis, ``[B, Hkv, g*m, D]``, so one batched matmul per KV head serves them all, and
summing the probabilities over that axis gives exactly the per-KV-head score H2O accumulates (the
group's heads summed).
"""

from __future__ import annotations

import sys
import weakref
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedConfig, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from h2okv.core.feed_forward import slice_feed_forward, unslice_feed_forward
from h2okv.core.kernels import triton_on
from h2okv.core.runtime import RUNTIME
from h2okv.errors import H2OError

ATTN_NAME = "h2o"
PENDING: ContextVar[tuple | None] = ContextVar("h2okv_pending", default=None)
# the same hand-over while torch.compile traces a forward call: dynamo cannot trace a ContextVar
# (a graph break at every layer) but traces a module-level list, and the value never leaves the
# trace (set in ``update``, taken here, reset to None), so threads share nothing at run time
_TRACED: list = [None]


def set_pending(value) -> None:
    if torch.compiler.is_compiling():
        _TRACED[0] = value
    else:
        PENDING.set(value)


def get_pending():
    return _TRACED[0] if torch.compiler.is_compiling() else PENDING.get()


_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks", "position_bias")


def h2o_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    pending = get_pending()
    if pending is None:  # not our cache's call (a plain DynamicCache, no cache)
        return own_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    set_pending(None)  # taken here, whatever follows: a refused call leaves nothing for the next one
    if pending[1] is not key:
        # attending over the new tokens alone would drop every cached token from this step
        raise H2OError(f"layer {getattr(module, 'layer_idx', pending[0].layer_idx)} ({type(module).__name__}): "
                       f"the key reaching attention is not the one H2OCache.update was given (the model changes "
                       f"it after the cache update), so H2O cannot attend over the cached tokens")
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise H2OError(f"{type(module).__name__} uses {name!r}, which H2O attention does not support")
    set_pending(None)
    layer = pending[0]
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    out = layer.attend(query, key, value, attention_mask, scaling, sliding_window=kwargs.get("sliding_window"))
    return out, None


def _remember(config, implementation) -> None:
    """Record ``config``'s attention implementation before ``prepare_model`` (``RUNTIME``), by
    identity (configs are not hashable); the entry leaves with its config, so a later config at
    the same address is not taken for it."""
    key = id(config)
    RUNTIME.previous_attention[key] = (
        weakref.ref(config, lambda _ref: RUNTIME.previous_attention.pop(key, None)), implementation)


def previous_implementation(config) -> str | None:
    """The attention implementation ``config`` had before ``prepare_model`` (None: not known)."""
    entry = RUNTIME.previous_attention.get(id(config))
    return entry[1] if entry is not None and entry[0]() is config else None


def own_attention(module, query, key, value, attention_mask, **kwargs):
    """A call no ``H2OCache`` handed over: the attention the model ran before ``prepare_model``."""
    previous = previous_implementation(module.config)
    if key.shape[-2] == query.shape[-2] and previous not in (None, "sdpa"):
        # nothing cached before the call: ``h2o_mask`` could not tell it from our cache's call and
        # gave SDPA's mask; eager's is that mask as 0 / -inf (``eager_mask``)
        if ALL_MASK_ATTENTION_FUNCTIONS.get(previous) is eager_mask:
            attention_mask = _as_eager_mask(module, query, key, attention_mask, kwargs.get("is_causal"))
        else:
            previous = None  # a mask we do not convert to (flash's padding rows, flex's blocks): SDPA runs the call
    if previous is None or previous == "sdpa":
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    # transformers keeps eager attention out of its registry: each model's module defines its own
    # (its attention class passes it as the default); a module without one runs SDPA
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", sdpa_attention_forward)
    forward = ALL_ATTENTION_FUNCTIONS.get(previous, eager)
    return forward(module, query, key, value, attention_mask, **kwargs)


def _as_eager_mask(module, query, key, mask, is_causal):
    """SDPA's boolean mask (None: SDPA's ``is_causal``, upper-left aligned) as eager's additive one."""
    if mask is None:
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        if query.shape[-2] == 1 or not causal:
            return None
        mask = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
    return torch.where(mask, torch.zeros((), dtype=query.dtype, device=query.device), torch.finfo(query.dtype).min)


def heads_share(allowed: torch.Tensor) -> bool:
    """Whether every KV head's ``[B, Hkv, m, cap]`` mask is its first head's."""
    return bool((allowed == allowed[:, :1]).all())


def fused_mass_on(device) -> bool:
    """Whether ``slot_attention`` takes the mass from the Triton kernels on ``device``."""
    return triton_on(device)


def slot_attention(
    query: torch.Tensor,  # [B, Hq, m, D]
    keys: torch.Tensor,  # [B, Hkv, cap, D]
    values: torch.Tensor,  # [B, Hkv, cap, Dv]
    allowed: torch.Tensor | None,  # [B, Hkv, m, cap] bool (or broadcastable on m); None: every slot
    scaling: float,
    need_mass: bool,
    query_weight: torch.Tensor | None = None,  # [B, m] bool: which queries count towards the score
    fused: bool | None = None,  # the Triton kernels for the mass (None: where they run, fused_mass_on)
):
    b, hq, m, d = query.shape
    hkv, cap = keys.shape[1], keys.shape[2]
    g = hq // hkv
    packed = query.reshape(b, hkv, g * m, d)

    if not need_mass:
        if (query.device.type == "cpu" and allowed is not None and g > 1 and m > 1 and allowed.shape[1] > 1
                and heads_share(allowed)):
            # every KV head sees the same slots (a prefill before any head evicted): one [m, cap]
            # mask for all query heads, where the mask expanded over each group's queries cost as
            # much to build as the attention it masked (CPU, 512 queries over 2k slots: 2x the call).
            # Not on CUDA, where a masked grouped call falls back to SDPA's math kernel
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=allowed[:, :1], scale=scaling,
                                                 enable_gqa=True)
            return out, None
        mask = None
        if allowed is not None:
            mask = allowed.expand(b, hkv, m, cap)
            if g > 1 and m > 1:  # with one query the [.., 1, cap] mask already broadcasts over the group
                mask = mask[:, :, None].expand(b, hkv, g, m, cap).reshape(b, hkv, g * m, cap)
        out = F.scaled_dot_product_attention(packed, keys, values, attn_mask=mask, scale=scaling)
        return out.reshape(b, hq, m, values.shape[-1]), None

    if fused_mass_on(query.device) if fused is None else fused:  # the mass from the log-sum-exp, no probability matrix
        from h2okv.core.triton_attention import triton_slot_attention

        return triton_slot_attention(query, keys, values, allowed, scaling, query_weight)
    # in place where the tensor is fresh: on the decode path every op counts, and in a prefill
    # chunk the logits are the largest tensor there is
    logits = torch.matmul(packed, keys.transpose(-1, -2))
    if logits.dtype != torch.float32:
        logits = logits.float()
    logits.mul_(scaling)
    if allowed is not None:
        # rows are (group head, query): the [m, cap] mask broadcasts over the group, never copied
        hidden = ~allowed.expand(b, hkv, m, cap)
        logits.view(b, hkv, g, m, cap).masked_fill_(hidden[:, :, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.matmul(probs if probs.dtype == values.dtype else probs.to(values.dtype), values)
    if query_weight is not None:
        weight = query_weight[:, None, None, :].expand(b, 1, g, m).reshape(b, 1, g * m, 1)
        probs = probs * weight
    mass = probs.sum(dim=2)  # [B, Hkv, cap]
    return out.reshape(b, hq, m, values.shape[-1]), mass


def h2o_mask(*args, q_length=None, kv_length=None, attention_mask=None, config=None, **kwargs):
    """The ordinary boolean SDPA mask (our cache sizes it to the new tokens only). transformers
    refuses a compileable cache its ``is_causal`` skip at one query, and a mask there would send a
    decode step off its stepper: at one query the skip is allowed again (eager: None when the token
    is real, as for any other cache), and traced, the 2D mask's last column is returned as it is
    (no look at the data; ``SlotLayer.attend`` asserts on the device that the token is real).

    A mask longer than the call is another cache's: the mask of the model's own attention
    (``own_attention``). A call with nothing cached before it cannot be told from ours here."""
    kwargs.update(kv_length=kv_length, config=config)
    if kv_length != q_length:
        own = ALL_MASK_ATTENTION_FUNCTIONS.get(previous_implementation(config), sdpa_mask)
        return own(*args, q_length=q_length, attention_mask=attention_mask, **kwargs)
    if q_length == 1:
        if attention_mask is None:
            return None
        if torch.compiler.is_compiling():
            return attention_mask.to(torch.bool)[:, -1].view(-1, 1, 1, 1)
        kwargs["allow_is_causal_skip"] = True
    return sdpa_mask(*args, q_length=q_length, attention_mask=attention_mask, **kwargs)


def _register() -> None:
    if ATTN_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTN_NAME, h2o_attention_forward)
        AttentionMaskInterface.register(ATTN_NAME, h2o_mask)


def attention_modules(model):
    """(layer_idx, module) for every self-attention module that goes through the interface."""
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if idx is not None and hasattr(module, "config") and type(module).__name__.endswith("Attention"):
            yield idx, module


def check_supported(model) -> int:
    """Raise ``H2OError`` naming the reason if H2O cannot run on ``model``; return its layer count."""
    config = model.config
    name = type(model).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise H2OError(f"{name} is an encoder-decoder model; h2okv supports decoder-only models")
    if not getattr(model, "_supports_attention_backend", False):
        raise H2OError(
            f"{name} does not route attention through transformers' AttentionInterface, so H2O cannot plug in"
        )
    text = config.get_text_config()
    layer_types = getattr(text, "layer_types", None) or []
    odd = sorted({t for t in layer_types if t != "full_attention" and t != "sliding_attention"})
    if odd:
        raise H2OError(f"{name} has {', '.join(odd)} layers; h2okv supports attention-only decoders")
    if getattr(text, "attn_logit_softcapping", None):
        raise H2OError(f"{name} soft-caps attention logits, which H2O attention does not support")
    layers = {idx for idx, _ in attention_modules(model)}
    if not layers:
        raise H2OError(f"{name}: found no attention modules with a layer index")
    return max(layers) + 1


_HOOKS = "_h2okv_hooks"  # the model attribute holding prepare_model's forward pre-hooks


def _configs(model):
    """Every config of ``model`` an attention implementation is set on (sub-configs too), once each."""
    found = {}
    todo = [model.config] + [getattr(m, "config", None) for m in model.modules()]
    while todo:
        config = todo.pop()
        if isinstance(config, PreTrainedConfig) and id(config) not in found:
            found[id(config)] = config
            todo += [getattr(config, key, None) for key in config.sub_configs]
    return list(found.values())


def _fresh_call(module, args) -> None:
    """A model call starts with nothing handed over: a hand-over left by a call that never reached
    attention (a layer fed by hand, an interrupted forward) is not this call's."""
    set_pending(None)


def prepare_model(model) -> int:
    """Route the model's attention through ``h2o_attention_forward``; returns the number of layers.

    Each config's attention implementation before the switch is remembered: calls no ``H2OCache``
    hands over run it (``own_attention``). A forward pre-hook on each of its ``PreTrainedModel``
    modules clears a stale hand-over. Its dense feed-forward runs long calls in slices
    (``feed_forward.py``: the numbers of one pass, up to float rounding; one slice's activations
    held). Idempotent; ``restore_model`` undoes it.
    """
    num_layers = check_supported(model)
    _register()
    slice_feed_forward(model)  # a prompt read in one call holds one slice's activations, not the prompt's
    for config in _configs(model):
        if config._attn_implementation != ATTN_NAME:  # prepared again: what it had first stays
            _remember(config, config._attn_implementation)
    if model.config._attn_implementation != ATTN_NAME:
        model.set_attn_implementation(ATTN_NAME)
    if not hasattr(model, _HOOKS):
        setattr(model, _HOOKS, [m.register_forward_pre_hook(_fresh_call) for m in model.modules()
                                if isinstance(m, PreTrainedModel)])
    return num_layers


def restore_model(model) -> None:
    """Undo ``prepare_model``: each config's attention implementation as it was, the hooks removed,
    the feed-forward whole again (``unslice_feed_forward``). An ``H2OCache`` built on the model
    before must not be used after: the model no longer hands it its keys."""
    for config in _configs(model):
        entry = RUNTIME.previous_attention.pop(id(config), None)
        if entry is not None and entry[0]() is config and config._attn_implementation == ATTN_NAME:
            # each config by itself, not ``set_attn_implementation``: a composite model's sub-configs
            # may each have had their own, and each was checked by transformers when first set
            config._attn_implementation_internal = entry[1]
    for handle in vars(model).pop(_HOOKS, ()):
        handle.remove()
    unslice_feed_forward(model)
